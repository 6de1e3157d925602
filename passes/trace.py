r"""Pass `trace` (phase import): checkpoint -> the model's decode program as an ONNX graph.

The traced program processes a chunk of L tokens per row for B rows, each row at its own start
position, against a KV cache it only reads:

    input_ids [B, L]   positions [B] (start of the chunk)   past.key.{l} / past.value.{l} [B, kvh, T, hd]
        |
    embed -> layer 0 -> hidden.0 -> layer 1 -> hidden.1 ... -> hidden.{N-1} -> norm -> lm_head -> logits
    (embeddings and hidden.{l} are token rows [B*L, H]: the residual stream is 2-D, models/row_layer.py)
                                 \__ after exit_layer layers: exit_norm -> lm_head -> exit_logits
    each layer also returns present.key.{l} / present.value.{l} [B, kvh, L, hd] (the chunk's new rows)

Each layer is models/row_layer.py's layer_over_rows (the PyTorch backend runs the same code): the
past and the chunk are scored separately, so the cache is never copied or concatenated in-graph, and
the runtime writes the new rows into its own cache buffer.

With B=1 this is the prefill / plain decode graph; the step_graph pass turns it into the P-slot step
graph. Every projection is F.linear on 2-D input (ONNX Gemm, transB=1) so initializers are exactly
the checkpoint tensors: nothing is transposed or duplicated, and shared blocks stay one initializer.

No weight is read here. The program is traced with its parameters as extra inputs (uninitialised
placeholders of the right shapes: untouched memory, whatever the model's size), and each such input
then becomes a constant holding a SourceWeight: where the checkpoint keeps that tensor's bytes.

    torch.onnx.export(weights as inputs) -> input "model.blocks.0.mlp.up.weight" -> Constant(SourceWeight)
"""

from __future__ import annotations

import io
import warnings
from dataclasses import replace

import onnx
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F
from torch import nn

from speedc.format import contract
from speedc.errors import BuildError
from speedc.models.config import ModelConfig
from speedc.models.llama import SharedLlama
from speedc.models.row_layer import CrossRead, RowOps, layer_over_rows, rms_norm, row_context, rotary_inv_freq
from speedc.models.trip import read_out, walk
from speedc.format.depth_plan import CODA
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import linear_to_gemm, replace_uses
from speedc.passes.source_weights import weight_constant

OPSET = 17
TRACED_HEADS = ("logits", "exit_logits")  # the traced program's own heads (exit_heads replaces them)


class DecodeProgram(nn.Module):
    """Export-friendly formulation of SharedLlama's cached forward (same math, same weights)."""

    def __init__(self, llama: SharedLlama) -> None:
        super().__init__()
        self.cfg = llama.cfg
        self.model = llama.model  # parameter names stay the checkpoint's: model.blocks.{m}...
        if not llama.cfg.tie_word_embeddings:
            self.lm_head = llama.lm_head
        self.register_buffer("inv_freq", rotary_inv_freq(self.cfg), persistent=False)

    def _head(self, x2d: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        normed = x2d if norm_weight is None else rms_norm(x2d, norm_weight, self.cfg.rms_norm_eps)
        return F.linear(normed, weight)  # [B*L, V]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor):
        cfg, plan = self.cfg, self.cfg.depth_plan
        b, length = positions.shape[0], input_ids.shape[1]
        initial = readout_repeats = None
        if random_state(cfg):  # [B*L, H]: each token row's drawn start state
            initial, past = past[0], past[1:]
        if plan.recurrent:  # [B]: the core repeats each row's final readout follows
            readout_repeats, past = past[0], past[1:]
        x = self.model.embed_tokens(input_ids).reshape(-1, cfg.hidden_size)  # [B*L, H]: token rows (-1: a step embeds fewer rows than it runs)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        embeddings = x
        token_ids = input_ids.reshape(-1)  # [B*L]: the rows' tokens (value embeddings)
        ctx = row_context(positions, length, past[0].shape[2], self.inv_freq,
                          cfg.num_attention_heads // cfg.num_key_value_heads, plan.cross_window)
        ops = _TraceOps(self, ctx, past, token_ids, initial)
        if readout_repeats is None:
            x = walk(plan, plan.trip(), ops, x)  # prelude, core repeats, coda (models/trip.py)
        else:  # every repeat runs; the state after each row's READOUT_REPEATS is what its readout takes
            ops.readout_repeats = readout_repeats.repeat_interleave(length)[:, None]  # [B*L, 1]
            walk(plan, core_trip(plan), ops, x)
            x = read_out(plan, ops, ops.readout_state)  # its norm / projection, then the coda
            if not plan.coda:  # hidden.{N-1}, what the head reads (exit_heads), is the readout
                ops.hidden_out[-1] = x
        final_norm = self.model.norm.weight if cfg.final_norm else None
        logits = self._head(x, final_norm).reshape(b, length, -1)
        exit_logits = None if ops.tap is None else ops.exit_logits.reshape(b, length, -1)
        if draft_coda(cfg):  # the draft readout's own coda over the tap (cache entries N..N+Lc-1)
            readout = _TraceOps(self, ctx, past, token_ids, initial, cache_offset=len(plan.coda), present=ops.present)
            exit_logits = self._head(read_out(plan, readout, ops.tap), final_norm).reshape(b, length, -1)
        return (logits, exit_logits, embeddings, *ops.hidden_out, *ops.present)


class _TraceOps(RowOps):
    """The walker's ops for the decode program: each layer reads its cache input, returns its new rows
    (PRESENT) and its output (HIDDEN_OUT); the exit head taps after exit_layer layers. A readout's coda with
    its own K/V reads the cache entries CACHE_OFFSET past its logical layers."""

    def __init__(self, program: DecodeProgram, ctx, past, token_ids, initial, *, cache_offset: int = 0,
                 present: list | None = None) -> None:
        super().__init__(program.model, program.cfg, initial)
        self.program, self.ctx, self.past, self.token_ids, self.cache_offset = program, ctx, past, token_ids, cache_offset
        self.present = [] if present is None else present  # key, value per layer so far
        self.hidden_out, self.tap, self.exit_logits = [], None, None
        self.readout_repeats = self.readout_state = None  # [B*L, 1] repeats, and the state after them [B*L, H]

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        entry = step.layer + self.cache_offset
        x, k, v = layer_over_rows(self.decoder.blocks[step.block], x, self.ctx, self.past[2 * entry], self.past[2 * entry + 1],
                                  self.cfg, self.token_ids, self._cross_read(step.layer))
        self.present += [k, v]
        return x

    def after(self, step, x: torch.Tensor) -> None:
        if self.cache_offset:  # a readout's coda: its rows are not the trip's hidden outputs
            return
        self.hidden_out.append(x)
        if self.readout_repeats is not None and self.cfg.depth_plan.ends_repeat(step.layer):
            chosen = self.readout_repeats == step.repeat + 1  # [B*L, 1]
            self.readout_state = x if self.readout_state is None else torch.where(chosen, x, self.readout_state)
        if step.layer + 1 == self.cfg.exit_layer:
            self.tap = x
            norm = {"own": getattr(self.decoder, "exit_norm", None), "final": self.decoder.norm, "none": None}[self.cfg.exit_norm]
            self.exit_logits = self.program._head(x, None if norm is None else norm.weight)

    def _cross_read(self, layer: int) -> CrossRead | None:
        """Logical layer LAYER's read of repeat 0's K/V (cross-repeat attention): that layer's cache input
        and the chunk's rows it returned this call."""
        plan = self.cfg.depth_plan
        source = plan.cross_source(layer)
        if source is None:
            return None
        gate = self.decoder.gate_projections[source - len(plan.prelude)]
        return CrossRead(self.past[2 * source], self.past[2 * source + 1], self.ctx.past_mask, self.present[2 * source],
                         self.present[2 * source + 1], self.ctx.chunk_mask, gate.weight, gate.bias)


def core_trip(plan) -> list:
    """The steps of a trip up to the end of the core, whose state is left for a readout to take (read_out)."""
    return [replace(step, ends_core=False) for step in plan.trip() if step.phase != CODA]


def random_state(cfg: ModelConfig) -> bool:
    """Whether the programs take contract.INITIAL_STATE (a recurrent core started from a random draw)."""
    return cfg.depth_plan.state_init == "random"


def draft_coda(cfg: ModelConfig) -> bool:
    """Whether the decode program also runs the draft readout's coda (a plan with a coda that may pipeline:
    its draft tap after the prelude, inside the core), so SPEED finds that readout depth's K/V filled."""
    plan = cfg.depth_plan
    return bool(plan.coda) and plan.repeats > 1 and len(plan.prelude) < cfg.exit_layer <= plan.num_layers - len(plan.coda)


def cache_entries(cfg: ModelConfig) -> int:
    """K/V entries the decode program reads and writes: its logical layers, then the draft readout's coda."""
    return cfg.num_hidden_layers + (len(cfg.depth_plan.coda) if draft_coda(cfg) else 0)


def io_names(num_layers: int, entries: int | None = None, initial_state: bool = False,
             readout_repeats: bool = False) -> tuple[list[str], list[str]]:
    entries = num_layers if entries is None else entries
    inputs = [contract.INPUT_IDS, contract.POSITIONS] + ([contract.INITIAL_STATE] if initial_state else [])
    inputs += [contract.READOUT_REPEATS] if readout_repeats else []
    for layer in range(entries):
        inputs += [f"past.key.{layer}", f"past.value.{layer}"]
    outputs = [*TRACED_HEADS, "embeddings"] + [f"hidden.{layer}" for layer in range(num_layers)]
    for layer in range(entries):
        outputs += [f"present.key.{layer}", f"present.value.{layer}"]
    return inputs, outputs


class WeightsAsInputs(nn.Module):
    """DecodeProgram with every parameter passed in as an input after the cache. Traced this way the
    exporter knows no weight's values: it neither folds nor serialises them (with parameters it
    spends minutes and gigabytes on shape inference over a multi-GB model)."""

    def __init__(self, program: DecodeProgram) -> None:
        super().__init__()
        self.program = program
        self.weight_names = [name for name, _ in program.named_parameters()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *rest: torch.Tensor):
        past, weights = rest[:-len(self.weight_names)], rest[-len(self.weight_names):]
        for name, value in zip(self.weight_names, weights):
            owner, _, leaf = name.rpartition(".")
            self.program.get_submodule(owner)._parameters[leaf] = value  # the input, used where the parameter was
        return self.program(input_ids, positions, *past)


def trace_decode_program(cfg: ModelConfig) -> onnx.ModelProto:
    """The decode program with every parameter a graph input named as in the checkpoint (weights are
    uninitialised placeholders: the trace needs shapes only, and untouched memory costs nothing)."""
    with torch.device("meta"):
        llama = SharedLlama(cfg)  # shapes only
    program = WeightsAsInputs(DecodeProgram(llama).eval())
    weights = [torch.empty(p.shape) for _, p in program.program.named_parameters()]
    batch, length, past_len = 2, 3, 5  # non-1 sizes so nothing specialises on them
    kv_shape = (batch, cfg.num_key_value_heads, past_len, cfg.head_dim)
    initial = [torch.zeros(batch * length, cfg.hidden_size)] if random_state(cfg) else []
    readout = [torch.tensor([cfg.depth_plan.repeats, 1])] if cfg.depth_plan.recurrent else []  # [B]
    args = (torch.zeros(batch, length, dtype=torch.long), torch.tensor([5, 2]), *initial, *readout,
            *[torch.zeros(kv_shape) for _ in range(2 * cache_entries(cfg))], *weights)
    inputs, outputs = io_names(cfg.num_hidden_layers, cache_entries(cfg), random_state(cfg), bool(readout))
    dynamic = {contract.INPUT_IDS: {0: "batch", 1: "chunk"}, contract.POSITIONS: {0: "batch"},
               **({contract.INITIAL_STATE: {0: "rows"}} if initial else {}),
               **({contract.READOUT_REPEATS: {0: "batch"}} if readout else {})}
    for name in inputs[2 + len(initial) + len(readout):]:
        dynamic[name] = {0: "batch", 2: "context"}
    for name in outputs:
        if name.startswith("present"):
            dynamic[name] = {0: "batch", 2: "chunk"}
        elif name in TRACED_HEADS:
            dynamic[name] = {0: "batch", 1: "chunk"}
        else:  # embeddings, hidden.{l}: token rows [B*L, H]
            dynamic[name] = {0: "rows"}
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(program, args, buffer, input_names=inputs + program.weight_names, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, do_constant_folding=False, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def bind_weights(graph: gs.Graph, state: CompileState, program_inputs: list[str] | None = None) -> int:
    """Each parameter input (every input not in PROGRAM_INPUTS; None: the decode program's) -> a constant
    over the checkpoint tensor of that name (nothing is read)."""
    program_inputs = set(program_inputs or io_names(state.cfg.num_hidden_layers, cache_entries(state.cfg),
                                                    random_state(state.cfg), state.cfg.depth_plan.recurrent)[0])
    bound = 0
    for inp in [i for i in graph.inputs if i.name not in program_inputs]:
        source = state.weights.get(inp.name)
        if source is None:
            raise BuildError(f"internal: the traced program reads parameter {inp.name}, which the checkpoint lacks")
        replace_uses(inp, weight_constant(inp.name, source))
        graph.inputs.remove(inp)
        bound += 1
    graph.cleanup()
    return bound


@register_pass("trace", phase="import", provides=("decode_program", "separate_projections"))
def trace(state: CompileState) -> CompileState:
    """Trace the checkpoint's decode program (all N layers, chunked, cache read-only) into ONNX."""
    graph = gs.import_onnx(trace_decode_program(state.cfg))
    bind_weights(graph, state)
    linear_to_gemm(graph)
    state.graphs["decode"] = graph.toposort()
    state.notes.append(f"traced {state.cfg.num_hidden_layers} layers over {state.cfg.num_blocks} stored blocks")
    return state
