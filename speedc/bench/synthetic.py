"""Step cost on a memory-bound configuration: a random-weight model, compiled at each pipeline
depth, then c(P) = (P-slot step time) / (plain token time / P), interleaved.

Shapes (`--shape`): the zoo family made large (hidden 1024 by default: unique fp32 weights far beyond
a CPU's last-level cache), or the real shapes of the looped checkpoints (Ouro-1.4B / 2.6B,
Nanbeige4.2-3B: their widths, heads, MLP, vocabulary, layer and loop counts, block and loop norms),
written in bf16 in their published layout and built like a real checkpoint (`--layers K` for fewer).

Plain random weights make acceptance meaningless, so by default the rows are step cost only. With
--end-to-end the blocks' residual updates are scaled down (--residual-scale) so the early exit agrees
with the final head often, as in a trained looped model, and each row adds SPEED vs plain decoding at
the acceptance measured in the same run (ids checked identical)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from speedc.bench.floor import measure_floor, measure_kernel
from speedc.step_timer import measure_step_times
from speedc.errors import SpeedcError
from speedc.runtimes.speculation import MODES

# Residual scale for --end-to-end on random weights: each block then adds little to the residual
# stream, so the state after the first pass predicts the last (as in a trained looped model). The zoo
# shape's was chosen for an exit/final agreement near 0.8 along greedy continuations of random prompts
# (teacher-forced, torch reference): zoo-1024 untied 0.001 -> 0.91, 0.002 -> 0.69.
ZOO_RESIDUAL_SCALE = 0.0015
# A looped shape's loop norm renormalises the state each loop; what loops 2..R then add grows as the
# square root of the sublayers they run, so the scale is a budget over sqrt(layers x (loops - 1)).
# Chosen for agreement near 0.9 at full depth (teacher-forced exit vs final head on random prompts,
# torch reference, 2026-12-02): Ouro-1.4B (24 x 4, sandwich norms: each sublayer's update RMS-normed,
# then scaled) 0.004 -> 0.85, 0.002 -> 0.99; Nanbeige-3B (22 x 2, Llama blocks: o_proj and down_proj
# scaled) 0.004 -> 0.83, 0.002 -> 0.95. Huginn (4 core layers x 32 repeats, post-norm blocks: attn.proj,
# mlp.proj and the adapter's noise scaled, its state half near the identity) at hidden 1056: 0.002 -> 0.94,
# 0.005 -> 0.79; at hidden 2112: 0.0012 -> 0.92, 0.002 -> 0.79 (the update grows as sqrt(hidden)): its
# budget is that extrapolated to 5280.
LOOPED_RESIDUAL_BUDGET = {"sandwich": 0.025, "llama": 0.015, "huginn": 0.0085}
PROMPT_IDS = 8  # --end-to-end's random prompts: this many ids each
MAX_DEPTH = 8  # the deepest pipeline measured


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int  # unique blocks (a looped model's layers)
    loops: int  # passes over them (P)
    looped: bool  # loop-boundary norm, heads read the loop-normed state (Ouro, Nanbeige)
    sandwich_norms: bool = False
    tied: bool = False
    prelude: int = 0  # recurrent depth (Huginn): blocks run once on entry,
    coda: int = 0  # blocks run at every readout,
    recurrent: bool = False  # and the LAYERS core blocks repeat LOOPS times reading adapter(cat[state, e])
    family: str = "huginn"  # with recurrent: whose published layout ("huginn", or "parcae": its diagonal
    #                         injection, non-gated ReLU^2 MLP and value-embedding tables)
    value_embeds: int = 0  # Parcae: [vocab, kv_heads * head_dim] value-embedding tables (alternating blocks)
    cross_window: int = 0  # cross-repeat attention (IQuest-Coder-V1-Loop): later loops read loop 0's K/V, own window

    @property
    def gated_mlp(self) -> bool:
        return self.family != "parcae"

    @property
    def published_name(self) -> str:
        """The architecture as peers would name it."""
        return "Parcae" if self.family == "parcae" else "Huginn (RavenForCausalLM)"

    @property
    def published(self) -> bool:
        """A published architecture's layout (a looped or recurrent checkpoint), not the zoo family."""
        return self.looped or self.recurrent or bool(self.cross_window)

    def block_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        gate = self.heads * (self.head_dim + 1) if self.cross_window else 0  # a cross-repeat layer's gate
        return attention + mlp + (4 if self.sandwich_norms else 2) * self.hidden + gate

    def fixed_params(self) -> int:  # embedding, LM head, norms, value-embedding tables
        return (self.vocab * self.hidden * (1 if self.tied else 2) + 2 * self.hidden
                + self.value_embeds * self.vocab * self.kv_heads * self.head_dim)


SHAPES = {
    "ouro-1.4b": Shape("ouro-1.4b", 2048, 16, 16, 128, 5632, 49152, 24, 4, looped=True, sandwich_norms=True),
    "ouro-2.6b": Shape("ouro-2.6b", 2048, 16, 16, 128, 5632, 49152, 48, 4, looped=True, sandwich_norms=True),
    "nanbeige-3b": Shape("nanbeige-3b", 3072, 48, 8, 128, 10752, 166144, 22, 2, looped=True),
    "huginn-3.5b": Shape("huginn-3.5b", 5280, 55, 55, 96, 17920, 65536, 4, 32, looped=False, tied=True,
                         prelude=2, coda=2, recurrent=True),
    # Parcae-770M (sandyresearch/parcae, parcae-large-770m): prelude / core / coda 6 / 6 / 6, R = 8; value
    # embeddings on the 9 odd blocks of 18 (half its parameters)
    "parcae-770m": Shape("parcae-770m", 1280, 10, 10, 128, 5120, 32768, 6, 8, looped=False, tied=True,
                         prelude=6, coda=6, recurrent=True, family="parcae", value_embeds=9),
    "iquest-loop": Shape("iquest-loop", 5120, 40, 8, 128, 27648, 76800, 80, 2, looped=False, cross_window=64),
}


def zoo_shape(hidden: int, blocks: int = 4, passes: int = 4) -> Shape:
    """The zoo family made large: cycle of BLOCKS blocks, PASSES passes, exit after the first."""
    heads = max(hidden // 64, 1)
    return Shape(f"zoo-{hidden}", hidden, heads, max(hidden // 256, 1), hidden // heads, 3 * hidden, 4096, blocks, passes,
                 looped=False, tied=True)


def end_to_end_shape(shape: Shape) -> Shape:
    """The shape --end-to-end decodes: the zoo family with an untied LM head. Tied, a random model
    whose residual updates are small predicts the token it just read (its embedding row matches
    itself best), greedy text collapses to one repeated token and acceptance is a trivial 0.99."""
    return shape if shape.published else dataclasses.replace(shape, tied=False, name=f"{shape.name}-untied")


def default_residual_scale(shape: Shape, layers: int) -> float:
    """--end-to-end's residual scale for SHAPE at LAYERS unique layers (see LOOPED_RESIDUAL_BUDGET)."""
    if not shape.published:
        return ZOO_RESIDUAL_SCALE
    budget = LOOPED_RESIDUAL_BUDGET["huginn" if shape.recurrent else "sandwich" if shape.sandwich_norms else "llama"]
    return round(budget / math.sqrt(layers * max(shape.loops - 1, 1)), 5)


def layers_that_fit(shape: Shape, requested: int | None = None) -> int:
    """The requested layer count (default: the real one), at most the real one."""
    return int(min(requested or shape.layers, shape.layers))


def shape_config(shape: Shape, layers: int):
    """ModelConfig of SHAPE with LAYERS unique blocks looped shape.loops times."""
    from speedc.models.config import ModelConfig
    from speedc.format.depth_plan import DepthPlan
    from speedc.models.layer_map import cycle_map

    n = layers * shape.loops
    cross = DepthPlan((), tuple(range(layers)), shape.loops, cross_window=shape.cross_window) if shape.cross_window else None
    return ModelConfig.from_layer_map(
        cycle_map(n, layers), loop_norm=shape.looped, final_norm=not shape.looped, declared=cross,
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, exit_layer=layers, head_dim=shape.head_dim,
        exit_norm="none" if shape.looped else "final" if cross else "own", max_position_embeddings=1024,
        tie_word_embeddings=shape.tied, sandwich_norms=shape.sandwich_norms,
        architecture=shape.name.split("-")[0] if shape.looped else "iquest_loop" if cross else "llama")


def pipeline_depths(shape: Shape, layers: int) -> list[int]:
    """The pipeline depths P measured: valid for SHAPE at LAYERS unique (core) layers, 2..MAX_DEPTH."""
    if shape.recurrent:  # P slots of R / P core repeats each
        return [p for p in range(2, MAX_DEPTH + 1) if shape.loops % p == 0]
    cfg = shape_config(shape, layers)
    return [p for p in cfg.depth_plan.valid_slots(cfg.exit_layer) if 1 < p <= MAX_DEPTH]


def synthetic_config(hidden: int, blocks: int, passes: int):
    return shape_config(zoo_shape(hidden, blocks, passes), blocks)


def random_model(hidden: int, blocks: int, passes: int, residual_scale: float = 1.0, seed: int = 0):
    """Random-weight shared model of the zoo shape (cycle map, exit after the first pass)."""
    return random_model_of(synthetic_config(hidden, blocks, passes), residual_scale, seed)


def random_model_of(cfg, residual_scale: float = 1.0, seed: int = 0):
    """Random weights N(0, 0.02), norms 1. RESIDUAL_SCALE < 1 shrinks what each block adds (o_proj,
    down_proj), so the early exit agrees with the final head often (end-to-end timings need that)."""
    import torch

    from speedc.models.llama import SharedLlama

    torch.manual_seed(seed)
    model = SharedLlama(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
                if residual_scale != 1.0 and name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(residual_scale)
    return model.eval()


def synthetic_checkpoint(shape: Shape, layers: int, directory: Path, residual_scale: float = 1.0) -> Path:
    """A random-weight checkpoint of SHAPE: a looped shape in its family's published layout, streamed
    to disk (bf16, any size); the zoo shape as a speedc checkpoint (fp32, built in memory: it is small)."""
    if shape.published:
        from speedc.bench.random_checkpoint import write_random_checkpoint

        return write_random_checkpoint(shape, layers, directory, residual_scale=residual_scale)
    from speedc.models.checkpoint.torch_io import save_checkpoint

    return save_checkpoint(random_model_of(shape_config(shape, layers), residual_scale), directory)


def end_to_end_row(engine, *, prompts: int, new_tokens: int, seed: int = 0, peers: dict | None = None) -> dict:
    """SPEED (the default mode: speculating while it pays on this host), SPEED speculating at every step
    (speed-always) and plain decoding on random prompt ids, interleaved (after an untimed warm-up of each, in
    every order in turn), greedy; ids must be identical. PEERS:
    name -> (generate(prompt ids, new tokens) -> (ids, decode seconds per token), what it ran), timed
    in the same rounds (after SPEED and plain decoding, per prompt); their ids' agreement with SPEED's
    is reported (another precision or architecture: not required equal). A peer that fails
    (PeerFailed: it crashed or hung in its own process) is not asked again; its row says why."""
    import numpy as np

    from speedc.bench.peers import PeerFailed
    from speedc.bench.run import Agreement, mode_order, policy_summary, warm_up
    from speedc.errors import GenerationError
    from speedc.runtimes.decode import pooled_acceptance

    peers = peers or {}
    vocab = engine.manifest.dims.vocab_size
    rng = np.random.default_rng(seed)
    modes = tuple(MODES)
    ms = {**{mode: [] for mode in modes}, **{name: [] for name in peers}}
    agreement = {name: Agreement(same_weights=False) for name in peers}
    speed_runs, adaptive_runs, failed = [], [], {}
    warm_up(engine, [int(i) for i in rng.integers(0, vocab, size=PROMPT_IDS)], modes, new_tokens)
    for turn in range(prompts):
        prompt = [int(i) for i in rng.integers(0, vocab, size=PROMPT_IDS)]
        results = {mode: engine.generate(prompt, max_new_tokens=new_tokens, mode=mode, stop_at_eos=False)
                   for mode in mode_order(modes, turn)}
        if not results["speed"].ids == results["speed-always"].ids == results["autoregressive"].ids:
            raise GenerationError("SPEED and plain decoding produced different ids on a random prompt: not lossless")
        for mode, result in results.items():
            ms[mode].append(1000 * result.stats.decode_seconds / max(1, result.stats.new_tokens - 1))
        speed_runs.append(results["speed-always"].stats)  # acceptance: of a run that speculated throughout
        adaptive_runs.append(results["speed"].stats)
        for name, (generate, _) in peers.items():
            if name in failed:
                continue
            try:
                ids, seconds = generate(prompt, new_tokens)
            except PeerFailed as bad:
                failed[name] = f"{bad} on prompt {turn + 1} of {prompts}"
                continue
            ms[name].append(1000 * seconds)
            agreement[name].add(ids, results["speed"].ids)
    speed, plain = statistics.median(ms["speed"]), statistics.median(ms["autoregressive"])
    always = statistics.median(ms["speed-always"])
    row = {"acceptance": round(pooled_acceptance(speed_runs), 3), "speed_ms_per_token": round(speed, 2),
           "speed_always_ms_per_token": round(always, 2),
           "autoregressive_ms_per_token": round(plain, 2), "speedup_decode": round(plain / speed, 3),
           "speedup_decode_always": round(plain / always, 3), "ids_identical": True,
           "policy": policy_summary(adaptive_runs)}
    if peers:
        row["peers"] = {name: ({"failed": failed[name], "ran": ran} if name in failed else
                               {"ms_per_token": round(statistics.median(ms[name]), 2),
                                "speed_speedup": round(statistics.median(ms[name]) / speed, 3), "ran": ran,
                                **agreement[name].to_json()})
                        for name, (_, ran) in peers.items()}
    return row


def close_peers(peers: dict) -> None:
    """End the peers' own processes (PEERS: memory_bound_peers' name -> (generate, what it ran))."""
    for generate, _ in peers.values():
        getattr(generate, "close", lambda: None)()
    peers.clear()


def exit_rule_rows(engine, rules: list[dict], *, prompts: int, new_tokens: int, seed: int = 1,
                   progress=lambda message: None) -> list[dict]:
    """Each depth RULE (Engine.generate's loops / exit_at_step / exit_threshold / weighted_exit) decoded with SPEED
    (speculating at every step) and with plain decoding under the same rule, beside SPEED and plain decoding of
    the full depth without a rule, all in the same interleaved rounds on random prompts, greedy; each rule's ids
    must agree between its two modes. -> a row per rule: its ms/token, speedups, acceptance, exit histogram."""
    import numpy as np

    progress(f"decoding with the depth rules at P={engine.manifest.slots}")
    from speedc.bench.run import mode_order
    from speedc.errors import GenerationError
    from speedc.runtimes.decode import pooled_acceptance

    rng = np.random.default_rng(seed)
    vocab = engine.manifest.dims.vocab_size
    runs = {"full": {}, **{str(i): rule for i, rule in enumerate(rules)}}
    ms = {(name, mode): [] for name in runs for mode in ("speed-always", "autoregressive")}
    stats: dict = {name: [] for name in runs}
    for turn in range(prompts + 1):  # the first round warms every run up, untimed
        prompt = [int(i) for i in rng.integers(0, vocab, size=PROMPT_IDS)]
        for name in mode_order(tuple(runs), turn):
            results = {mode: engine.generate(prompt, max_new_tokens=new_tokens, mode=mode, stop_at_eos=False, **runs[name])
                       for mode in mode_order(("speed-always", "autoregressive"), turn)}
            if results["speed-always"].ids != results["autoregressive"].ids:
                raise GenerationError(f"depth rule {runs[name]}: SPEED and plain decoding gave different ids: not lossless")
            if turn:
                for mode, result in results.items():
                    ms[name, mode].append(1000 * result.stats.decode_seconds / max(1, result.stats.new_tokens - 1))
                stats[name].append(results["speed-always"].stats)
    median = {key: statistics.median(values) for key, values in ms.items()}
    rows = []
    for name, rule in runs.items():
        if name == "full":
            continue
        exits: dict = {}
        for run in stats[name]:
            for loop, count in run.exit_loops.items():
                exits[loop] = exits.get(loop, 0) + count
        speed, plain = median[name, "speed-always"], median[name, "autoregressive"]
        rows.append({"rule": stats[name][0].depth_rule, "settings": rule, "acceptance": round(pooled_acceptance(stats[name]), 3),
                     "exit_loops": dict(sorted(exits.items())), "speed_ms_per_token": round(speed, 2),
                     "autoregressive_ms_per_token": round(plain, 2), "speedup_decode": round(plain / speed, 3),
                     "full_speed_ms_per_token": round(median["full", "speed-always"], 2),
                     "full_acceptance": round(pooled_acceptance(stats["full"]), 3),
                     "vs_speed_full_depth": round(median["full", "speed-always"] / speed, 3),
                     "full_autoregressive_ms_per_token": round(median["full", "autoregressive"], 2),
                     "vs_plain_full_depth": round(median["full", "autoregressive"] / speed, 3), "ids_identical": True})
    return rows


def synthetic_step_costs(*, hidden: int = 1024, blocks: int = 4, passes: int = 4, context: int = 512,
                         threads: int | None = None, repeats: int = 100, backend: str = "onnx",
                         shape: Shape | None = None, layers: int | None = None, end_to_end: bool = False,
                         residual_scale: float | None = None, new_tokens: int = 64,
                         prompts: int = 6,  # each order of the three modes once (bench.run.mode_order)
                         weights: str | None = None, profile: bool = False, peers: bool | None = None,
                         exit_rules: list[dict] | None = None, progress=lambda message: None) -> dict:
    """c(P) rows for SHAPE (default: the zoo shape at HIDDEN) at every valid depth 2..MAX_DEPTH, each
    beside the weight floor's c(P) (speedc/bench/floor.py: the same weight products and nothing else),
    measured in the same run; WEIGHTS: the artifact's weight storage (the floor stays fp32); PROFILE:
    also the step's kernel time per op type beside the plain token's share. With END_TO_END also
    SPEED vs plain decoding per depth, on weights whose blocks' residual updates are scaled by
    RESIDUAL_SCALE so the early exit agrees often (the measured acceptance is reported); and, for a
    looped shape, PEERS (None: those installed): llama.cpp on a GGUF of the same checkpoint at the
    artifact's precision (Q4_0 for int4, Q8_0 for int8, else F16), timed beside the deepest pipeline. EXIT_RULES:
    depth rules (runtimes/exit_rule.py) decoded at the pipeline of one loop a slot (exit_rule_rows)."""
    from speedc.build import build
    from speedc.passes.base import BuildOptions
    from speedc.runtimes.engine import Engine

    shape = shape or zoo_shape(hidden, blocks, passes)
    if end_to_end:
        shape = end_to_end_shape(shape)
    used = layers_that_fit(shape, layers)
    scale = residual_scale if residual_scale is not None else (default_residual_scale(shape, used) if end_to_end else 1.0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"{shape.name}: writing random weights, {used} of {shape.layers} layers x {shape.loops} loops")
        checkpoint = synthetic_checkpoint(shape, used, Path(tmp) / "ckpt", scale)
        depths = pipeline_depths(shape, used)
        if not depths:
            raise SpeedcError(f"{shape.name}: {shape.loops} loop(s) leave no pipeline depth to measure")
        peer_fns, missing = (memory_bound_peers(shape, checkpoint, Path(tmp), weights, threads, new_tokens, peers, progress)
                             if end_to_end else ({}, {}))
        kernel = None
        if weights in ("int4", "int8"):
            progress(f"{shape.name}: measuring speedc's product kernel at 1-8 rows beside the memory floor")
            kernel = measure_kernel(shape, used, weights=weights, threads=threads, repeats=max(10, repeats // 10))
        for slots in depths:
            progress(f"{shape.name}: compiling P={slots}")
            art = build(checkpoint, Path(tmp) / f"p{slots}", BuildOptions(slots=slots, dtype=weights), force=True).out
            opened = time.perf_counter()
            engine = Engine.load(art, backend=backend, threads=threads, verify=False)
            row = _depth_row(engine, art, shape, used, slots, load_seconds=time.perf_counter() - opened, threads=threads,
                             context=context, repeats=repeats, weights=weights, profile=profile, progress=progress)
            if end_to_end:
                row.update(end_to_end_row(engine, prompts=prompts, new_tokens=new_tokens,
                                          peers=peer_fns if slots == depths[-1] else None))
            if exit_rules and slots == (depths[-1] if shape.recurrent else shape.loops):  # Ouro's: one loop a slot
                row["exit_rules"] = exit_rule_rows(engine, exit_rules, prompts=prompts, new_tokens=new_tokens, progress=progress)
            rows.append(row)
            manifest = engine.manifest
            del engine
            shutil.rmtree(art)  # one artifact on disk at a time
        close_peers(peer_fns)  # (llama.cpp's process ended before the temporary files go)
    report = {**_report_head(shape, used, scale, end_to_end, manifest), "backend": backend, "context": context,
              "rows": rows, **({"kernel": kernel} if kernel is not None else {})}
    if end_to_end:
        report["end_to_end"] = end_to_end_summary(rows[-1], missing)
    return report


def _report_head(shape: Shape, used: int, scale: float, end_to_end: bool, manifest) -> dict:
    """What a memory-bound report measured: the shape, the layers used, the weights (MANIFEST: an artifact's)."""
    note = "" if used == shape.layers else f"{used} of the real {shape.layers} layers (--layers)"
    label = ("SPEED vs plain decoding on random weights" + ("" if shape.published else ", LM head untied") + ", residual updates scaled by "
             f"{scale} (acceptance measured)" if end_to_end else "step cost only (random weights)")
    return {"label": label, "shape": shape.name, "weights": manifest.dtype, "hidden": shape.hidden,
            "blocks": used, "passes": shape.loops, "real_layers": shape.layers, "note": note, "residual_scale": scale,
            "unique_weight_mb": round(manifest.store.unique_bytes_fp32 / 1e6, 1),
            "stored_weight_mb": round(manifest.store.stored_bytes / 1e6, 1)}


def end_to_end_summary(deepest: dict, missing: dict) -> dict:
    """The deepest pipeline's end-to-end row under the names other tools read (MISSING: peers not installed)."""
    summary = {"slots": deepest["slots"], "speedup": deepest["speedup_decode"], "acceptance_rate": deepest["acceptance"],
               "identical_ids": deepest["ids_identical"], "speed_ms_per_token": deepest["speed_ms_per_token"],
               "autoregressive_ms_per_token": deepest["autoregressive_ms_per_token"], "peers": deepest.get("peers", {})}
    return {**summary, "peers_missing": missing} if missing else summary


def _depth_row(engine, art: Path, shape: Shape, used: int, slots: int, *, load_seconds: float, threads: int | None,
               context: int, repeats: int, weights: str | None, profile: bool, progress) -> dict:
    """The step cost row of ENGINE (the artifact ART at P = SLOTS) beside its weight floor's."""
    progress(f"{shape.name}: measuring P={slots} and its weight floor")
    step, token = measure_step_times(engine.backend, context, repeats)
    row = {"slots": slots, "step_cost": round(step / (token / slots), 3), "step_ms": round(1000 * step, 3),
           "token_ms": round(1000 * token, 3), "load_seconds": round(load_seconds, 2),
           "products": engine.backend.products,
           **measure_floor(shape, used, slots, weights=weights, threads=threads, repeats=max(20, repeats // 2),
                           step_passes=shape.loops // slots if shape.recurrent else 1)}
    if profile:
        from speedc.bench.op_profile import step_op_profile

        progress(f"{shape.name}: profiling P={slots} per op")
        row["profile"] = step_op_profile(art, engine.manifest, threads=threads, context=context)
    return row


def memory_bound_peers(shape: Shape, checkpoint: Path, workdir: Path, weights: str | None, threads: int | None,
                       new_tokens: int, wanted: bool | None, progress) -> tuple[dict, dict]:
    """({name: (generate, what it ran)}, {name: how to install it}) for --end-to-end: llama.cpp on a GGUF
    of CHECKPOINT (looped shapes). WANTED None: the peers installed; True: refuse when one is missing."""
    from speedc.bench.peers import LLAMA_CPP_INSTALL, llama_cpp_installed, llama_cpp_peer

    if wanted is False:
        return {}, {}
    if shape.recurrent:  # no CPU engine but speedc runs Huginn or Parcae (llama.cpp has neither architecture)
        if wanted:
            raise SpeedcError(f"{shape.name}: llama.cpp has no {shape.published_name} architecture; no peer to run")
        return {}, {"llama.cpp": f"no {shape.published_name} architecture in llama.cpp"}
    if not shape.looped:
        if wanted:
            raise SpeedcError("the llama.cpp peer runs the looped shapes' checkpoints (--shape ouro-1.4b, ouro-2.6b, nanbeige-3b)")
        return {}, {}
    if not llama_cpp_installed():
        if wanted:
            raise SpeedcError(f"the llama.cpp peer needs llama-cpp-python: {LLAMA_CPP_INSTALL}")
        return {}, {"llama.cpp": LLAMA_CPP_INSTALL}
    from speedc.bench.gguf_export import GGUF_TYPE_FOR_WEIGHTS, write_gguf

    gguf_type = GGUF_TYPE_FOR_WEIGHTS.get(weights or "", "f16")
    written = write_gguf(checkpoint, workdir / f"peer.{gguf_type}.gguf", gguf_type, progress=progress)
    generate = llama_cpp_peer(Path(written["path"]), threads, context=PROMPT_IDS + new_tokens + 8)
    return {"llama.cpp": (generate, f"{written['ran']}, {gguf_type.upper()} ({written['bytes'] / 1e6:.0f} MB)")}, {}
