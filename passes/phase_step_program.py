r"""The batch step of a depth plan with a prelude or a coda (speedc/format/depth_plan.py), traced from PyTorch.

n sequences x P slots = R rows, slot-major (row s*n + b), as the cycle's batch step (passes/batch_step_graph.py);
what differs is that slot 0's rows run the prelude first and each readout runs the coda on its own rows
with its own coda K/V (speedc/format/cache_layout.py: the final readout's coda only ever sees final-depth states):

    input_ids [n,1] -> embed [n,H] -> prelude layers (positions of slot 0; cache.{kind}.prelude.{i}) -> e [n,H]
    hidden_in [(P-1)n,1,H] -> [(P-1)n,H] ----------------------------------------------------\
    Concat(e, ...) [R,H] -> stage layers j < S (all R rows; past = Concat_s cache.{kind}.{j}.{s}) -> hidden.{S-1} [R,H]
          |                                                                                     |
      tap after layer draft_layer - 1, rows of slot 0 [n,H]        Gather [repeat end k, row s*n + b] [n,H]
          |                                                                                     |
      coda layers (cache.{kind}.coda.{i}.0)                              coda layers (cache.{kind}.coda.{i}.1)
          |                                                                                     |
      readout.draft = Concat(draft [n,H], zeros [(P-1)n,H]) [R,H]      readout.final = Where(slot == s_b, final[b], 0)
                                                                           [P,n,H] -> [R,H]

The final readout reads each sequence's state at the end of slot P-1, or, where the plan's core is recurrent
and a request runs fewer repeats (runtimes/exit_rule.py), after READOUT_REPEATS[b] = r of them: the end of
repeat k = (r-1) % K of slot s_b = (r-1) // K (K = R/P repeats a slot), that row's final head reading it.

With an injection (Huginn) a slot carries [state | e] (2H wide: hidden_in, hidden.{S-1}): slot 0's state
starts at zero beside e = the prelude's output, every repeat first reads adapter(cat[state, e]), and each
readout applies model.norm before its coda where the plan says (readout_norm). Parcae's plan norms the
prelude's output (prelude_norm), injects with its diagonal decay, and projects the state at each readout
(readout_projection); its value embeddings read each row's token, so a slot also carries its token's id
([state | e | id], 2H + 1 wide: the id as a float, exact below 2^24) for its core and coda layers.

With cross-repeat attention (IQuest-Coder-V1-Loop; one core, one repeat a slot) every row of stage layer j
also reads slot 0's slab of j (repeat 0's K/V): slot 0's rows over [pool | their own new rows] (causal) with
g = 1, their plain attention; the rows of later slots over the pool below their own position and, as their
chunk, the pool's row at it (slot 0 wrote it a step earlier), gated against their own K/V's last W positions.
Past and chunk split as plain decoding splits them (its chunk: repeat 0's row it just computed), so the
softmax sums the same terms in the same order and SPEED's logits are plain decoding's bit for bit. A cycle:
the readouts are every row's state at the tap and at the stage's end (the heads gather slot 0's and slot P-1's).

The heads (passes/batch_step_graph.add_batch_heads) gather their rows from the readouts: exit rows are
slot 0's, final rows slot P-1's (runtimes/batch.py). New K/V: present.{kind}.{j} per stage layer (the
kv_cache pass stacks them), new_{kind}.prelude [Lp, n, kvh, 1, hd], new_{kind}.coda [Lc, 2, n, kvh, 1, hd].
"""

from __future__ import annotations

import io
import warnings

import onnx
import onnx_graphsurgeon as gs
import torch
from torch import nn

from speedc.format import contract
from speedc.format.cache_layout import CacheLayout
from speedc.errors import BuildError
from speedc.models.config import ModelConfig
from speedc.format.depth_plan import SlotPlan
from speedc.models.llama import SharedLlama
from speedc.format.depth_plan import PRELUDE
from speedc.models.row_layer import RowOps, layer_over_rows, row_context, rotary_inv_freq, step_cross_read
from speedc.models.trip import read_out, walk
from speedc.passes.trace import OPSET, WeightsAsInputs

STAGE_OUT_PREFIX = "hidden."  # hidden.{S-1}: the stage output (hidden_out)
READOUT_DRAFT, READOUT_FINAL = "readout.draft", "readout.final"


def slab_names(layout: CacheLayout) -> list[str]:
    """The step's cache inputs in the program's argument order: core (j, s), prelude i, coda (i, depth)."""
    names = [contract.batch_cache_input(kind, j, s) for j in range(layout.stage_layers) for s in range(layout.slots)
             for kind in contract.KV_KINDS]
    names += [contract.phase_cache_input(kind, "prelude", i) for i in range(layout.prelude_layers)
              for kind in contract.KV_KINDS]
    names += [contract.phase_cache_input(kind, "coda", i, d) for i in range(layout.coda_layers)
              for d in range(layout.readouts) for kind in contract.KV_KINDS]
    return names


class PhaseStepProgram(nn.Module):
    """One batch step of SLOTS over a plan with phases (the diagram above). Same layer code as the
    traced decode program (models/row_layer.py), so plain decoding and SPEED compute the same rows."""

    def __init__(self, llama: SharedLlama, pipeline: SlotPlan) -> None:
        super().__init__()
        self.cfg, self.pipeline = llama.cfg, pipeline
        self.model = llama.model
        if not llama.cfg.tie_word_embeddings:
            self.lm_head = llama.lm_head  # unused here; kept so parameter names match the checkpoint's
        self.register_buffer("inv_freq", rotary_inv_freq(self.cfg), persistent=False)
        self.layout = pipeline.plan.cache_layout(pipeline.slots)  # the runtime's addressing

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_in: torch.Tensor, *slabs: torch.Tensor):
        cfg, layout, plan = self.cfg, self.layout, self.pipeline.plan
        initial = readout_repeats = None
        if plan.state_init == "random":  # [n, H]: the entering tokens' drawn start states
            initial, slabs = slabs[0], slabs[1:]
        if plan.recurrent:  # [n]: the core repeats each sequence's final readout follows
            readout_repeats, slabs = slabs[0], slabs[1:]
        p, hidden = layout.slots, cfg.hidden_size
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        core_count = 2 * layout.stage_layers * p
        prelude_count = 2 * layout.prelude_layers
        core, prelude, coda = slabs[:core_count], slabs[core_count:core_count + prelude_count], slabs[core_count + prelude_count:]
        by_slot = positions.reshape(p, -1)  # [P, n]
        past_len = slabs[0].shape[2]
        first_ctx = row_context(by_slot[0], 1, past_len, self.inv_freq, groups)  # slot 0's rows
        n, per_slot = input_ids.shape[0], self.pipeline.repeats_per_slot
        if readout_repeats is None:
            readout_repeats = torch.full((n,), plan.repeats, dtype=torch.long)  # [n]
        readout_slots = torch.div(readout_repeats - 1, per_slot, rounding_mode="floor")  # [n]
        final_rows = readout_slots * n + torch.arange(n)  # [n]: each sequence's row in its readout slot
        final_ctx = row_context(positions[final_rows], 1, past_len, self.inv_freq, groups)
        x = self.model.embed_tokens(input_ids).reshape(-1, hidden)  # [n, H]
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        entering = input_ids.reshape(-1)  # [n]: slot 0's tokens
        behind = hidden_in.reshape(-1, cfg.state_width)  # [(P-1)n, H], [state | e] 2H, or [state | e | id] 2H + 1
        ctx = row_context(positions, 1, past_len, self.inv_freq, groups, plan.cross_window)
        stage = _StageOps(self, initial, first_ctx, ctx, prelude, core, entering, behind, positions)
        x = walk(plan, self.pipeline.entry_steps(), stage, x)  # slot 0's prelude, then every slot's stage (models/trip.py)
        token_ids, entry, taps = stage.token_ids, stage.entry, stage.taps
        tap = self.pipeline.draft_layer - layout.prelude_layers - 1  # stage layer after which the draft reads out
        rows = taps[tap].reshape(p, -1, hidden)  # [P, n, H]
        final_ids = token_ids[final_rows] if cfg.carries_token_id else None  # [n]: the readout rows' tokens
        draft_coda = _CodaOps(self, first_ctx, coda[0::4], coda[1::4], entering)  # coda slabs (i, depth 0)
        final_coda = _CodaOps(self, final_ctx, coda[2::4], coda[3::4], final_ids)  # (i, depth 1)
        final_in = x[final_rows]  # [n, H]: the state at the end of each readout slot
        if plan.recurrent and per_slot > 1:  # a count may end inside its slot: the state after r repeats
            repeat_ends = torch.stack([taps[(k + 1) * len(plan.core) - 1] for k in range(per_slot)])  # [K, R, H]
            final_in = repeat_ends[(readout_repeats - 1) % per_slot, final_rows]  # [n, H]
        draft, final = read_out(plan, draft_coda, rows[0]), read_out(plan, final_coda, final_in)  # [n, H]
        draft_k, draft_v, final_k, final_v = draft_coda.keys, draft_coda.values, final_coda.keys, final_coda.values
        zeros = torch.zeros_like(behind[:, :hidden])  # [(P-1)n, H]: rows no readout reads
        readout_draft = torch.cat((draft, zeros), dim=0)  # [R, H]
        at_readout = (torch.arange(p)[:, None] == readout_slots[None, :])[:, :, None]  # [P, n, 1]
        readout_final = torch.where(at_readout, final[None], 0.0).reshape(-1, hidden)  # [R, H]: final rows in their slots
        if plan.cross_window:  # a cycle: every row's state reads out as in its step (early-flush checks read deeper slots)
            readout_draft, readout_final = taps[tap], x
        carried = torch.cat((x, entry), dim=-1) if plan.injection else x  # [R, 2H] or [R, H]
        if cfg.carries_token_id:  # [R, 2H + 1]: each row's token id rides along for its next slot's layers
            carried = torch.cat((carried, token_ids.to(x.dtype)[:, None]), dim=-1)

        def stacked(parts):  # [k, n, kvh, 1, hd] (an empty phase: [0, ...])
            return torch.stack(parts) if parts else torch.zeros((0, *stage.core_k[0].shape), dtype=x.dtype)

        coda_k = torch.stack((stacked(draft_k), stacked(final_k)), dim=1)  # [Lc, 2, n, kvh, 1, hd]
        coda_v = torch.stack((stacked(draft_v), stacked(final_v)), dim=1)
        presents = [t for pair in zip(stage.core_k, stage.core_v) for t in pair]
        return (readout_draft, readout_final, carried, stacked(stage.prelude_k), stacked(stage.prelude_v), coda_k, coda_v,
                *presents)


class _StageOps(RowOps):
    """The walker's ops for slot 0's prelude (its n rows, the prelude slabs) and then the stage of all R rows:
    entering the core adds the slots behind (their state, e and token id ride in HIDDEN_IN); stage layer j
    reads the concatenation of its P slot slabs."""

    def __init__(self, program: PhaseStepProgram, initial, first_ctx, ctx, prelude, core, entering, behind, positions) -> None:
        super().__init__(program.model, program.cfg, initial)
        self.program, self.ctx, self.core, self.behind, self.positions = program, first_ctx, core, behind, positions
        self.stage_ctx, self.prelude, self.token_ids = ctx, prelude, entering
        self.prelude_k, self.prelude_v, self.core_k, self.core_v, self.taps = [], [], [], [], []
        self.entry = None

    def enter_core(self, x: torch.Tensor, entry):
        cfg, plan, hidden, behind = self.cfg, self.cfg.depth_plan, self.cfg.hidden_size, self.behind
        vectors = hidden * plan.carried_vectors
        if cfg.carries_token_id:  # [R]: every row's token, where value embeddings read it past slot 0
            self.token_ids = torch.cat((self.token_ids, behind[:, vectors].round().to(torch.long)), dim=0)
        if plan.injection:  # slot 0: e = the prelude's output beside its start state
            entry = torch.cat((entry, behind[:, hidden:vectors]), dim=0)  # [R, H]
            x = torch.cat((x, behind[:, :hidden]), dim=0)  # [R, H]
        else:
            x = torch.cat((x, behind), dim=0)  # [R, H]
        self.ctx, self.entry = self.stage_ctx, entry
        return x, entry

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        block = self.decoder.blocks[step.block]
        if step.phase == PRELUDE:
            past_k, past_v = self.prelude[2 * step.layer], self.prelude[2 * step.layer + 1]
            x, k, v = layer_over_rows(block, x, self.ctx, past_k, past_v, self.cfg, self.token_ids)
            self.prelude_k.append(k)
            self.prelude_v.append(v)
            return x
        p, plan = self.program.layout.slots, self.cfg.depth_plan
        j = step.layer - len(plan.prelude)
        at = 2 * j * p  # core slabs: (j, s) for s < P, key then value
        past_k = torch.cat([self.core[at + 2 * s] for s in range(p)], dim=0)  # [R, kvh, T, hd]
        past_v = torch.cat([self.core[at + 2 * s + 1] for s in range(p)], dim=0)
        cross = None
        if plan.cross_window:  # slot 0's slab of j: repeat 0's K/V (see the module docstring)
            gate = self.decoder.gate_projections[j % len(plan.core)]
            cross = step_cross_read(self.core[at], self.core[at + 1], self.positions, p, gate, self.ctx.past_mask)
        x, k, v = layer_over_rows(block, x, self.ctx, past_k, past_v, self.cfg, self.token_ids, cross)
        self.core_k.append(k)
        self.core_v.append(v)
        return x

    def after(self, step, x: torch.Tensor) -> None:
        if step.phase != PRELUDE:
            self.taps.append(x)


class _CodaOps(RowOps):
    """The walker's ops for one readout's coda: coda layer i reads KEYS[i] / VALUES[i] (that readout depth's own
    K/V) at CTX; its new rows are kept in self.keys / self.values."""

    def __init__(self, program: PhaseStepProgram, ctx, keys, values, token_ids) -> None:
        super().__init__(program.model, program.cfg)
        self.ctx, self.past_keys, self.past_values, self.token_ids = ctx, keys, values, token_ids
        self.first = program.pipeline.plan.num_layers - len(program.pipeline.plan.coda)
        self.keys, self.values = [], []

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        i = step.layer - self.first
        x, k, v = layer_over_rows(self.decoder.blocks[step.block], x, self.ctx, self.past_keys[i], self.past_values[i],
                                  self.cfg, self.token_ids)
        self.keys.append(k)
        self.values.append(v)
        return x


def output_names(layout: CacheLayout) -> list[str]:
    names = [READOUT_DRAFT, READOUT_FINAL, f"{STAGE_OUT_PREFIX}{layout.stage_layers - 1}"]
    names += [contract.phase_new_rows(kind, "prelude") for kind in contract.KV_KINDS]
    names += [contract.phase_new_rows(kind, "coda") for kind in contract.KV_KINDS]
    names += [f"present.{kind}.{j}" for j in range(layout.stage_layers) for kind in contract.KV_KINDS]
    return names


def trace_phase_step(cfg: ModelConfig, pipeline: SlotPlan) -> tuple[onnx.ModelProto, list[str], CacheLayout]:
    """The step program with its weights as graph inputs named as in the checkpoint (shapes only)."""
    if not 0 <= pipeline.draft_layer - len(pipeline.plan.prelude) - 1 < pipeline.stage_layers:
        raise BuildError(f"the draft readout (after layer {pipeline.draft_layer}) must lie in slot 0's core layers "
                         f"({len(pipeline.plan.prelude) + 1}..{len(pipeline.plan.prelude) + pipeline.stage_layers})")
    with torch.device("meta"):
        llama = SharedLlama(cfg)
    step = PhaseStepProgram(llama, pipeline).eval()
    program = WeightsAsInputs(step)
    layout = step.layout
    weights = [torch.empty(p.shape) for _, p in step.named_parameters()]
    n, past = 2, 5  # non-1 sizes so nothing specialises on them
    kv = (n, cfg.num_key_value_heads, past, cfg.head_dim)
    slabs = slab_names(layout)
    width = cfg.state_width  # a slot's carried state: [state | e] with an injection, [state | e | id] with value embeddings
    initial = [torch.zeros(n, cfg.hidden_size)] if pipeline.plan.state_init == "random" else []  # [n, H]
    readout = [torch.tensor([pipeline.plan.repeats, 1])] if pipeline.plan.recurrent else []  # [n]
    args = (torch.zeros(n, 1, dtype=torch.long), torch.arange(layout.slots * n), torch.zeros((layout.slots - 1) * n, 1, width),
            *initial, *readout, *[torch.zeros(kv) for _ in slabs], *weights)
    inputs = [contract.INPUT_IDS, contract.POSITIONS, contract.HIDDEN_IN, *([contract.INITIAL_STATE] if initial else []),
              *([contract.READOUT_REPEATS] if readout else []), *slabs]
    outputs = output_names(layout)
    dynamic = {contract.INPUT_IDS: {0: "sequences"}, contract.POSITIONS: {0: "rows"}, contract.HIDDEN_IN: {0: "rows_behind"},
               **({contract.INITIAL_STATE: {0: "sequences"}} if initial else {}),
               **({contract.READOUT_REPEATS: {0: "sequences"}} if readout else {})}
    dynamic.update({name: {0: "sequences", 2: "context"} for name in slabs})
    dynamic.update({name: {0: "rows"} for name in outputs[:3]})
    dynamic.update({name: {1: "sequences"} for name in outputs[3:5]})
    dynamic.update({name: {2: "sequences"} for name in outputs[5:7]})
    dynamic.update({name: {0: "rows"} for name in outputs[7:]})
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(program, args, buffer, input_names=inputs + program.weight_names, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, do_constant_folding=False, dynamo=False)
    return onnx.load_from_string(buffer.getvalue()), inputs, layout


def import_phase_step(cfg: ModelConfig, pipeline: SlotPlan) -> tuple[gs.Graph, CacheLayout]:
    model, _, layout = trace_phase_step(cfg, pipeline)
    return gs.import_onnx(model), layout
