"""The build driver: checkpoint -> passes -> artifact directory, atomically.

The pipeline is an explicit list grouped in phases (mlc-llm style); each name is a registered pass
in speedc.passes. `speedc build -v` prints one line per pass; `--dump-after NAME` writes the graphs
after that pass.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from speedc import __version__
from speedc.format.artifact import (CHAT_TEMPLATE, CONFIG, FORMAT_VERSION, TOKENIZER, TOKENIZER_CONFIG, WEIGHTS, Manifest,
                             stored_entries, weight_bytes, write_graphs, write_manifest)
from speedc.build_output import check_output, install
from speedc.errors import BuildError, SpeedcError
from speedc.models.checkpoint.torch_io import checkpoint_hash, open_checkpoint, read_exit_gate, read_tokenizer_json
from speedc.models.checkpoint.files import acceptance_hint_from_training, declared_tensor_bytes, has_speedc_section
from speedc.models import zoo
from speedc.passes import (batch_step_graph, cleanup, exit_heads, fuse_projections, fuse_skip_norm,  # noqa: F401
                           gqa_attention, kv_cache,
                           merge_programs, native_attention, native_products, quantize_weights, schedule, share, trace,
                           trt_lint,
                           untie_head)  # (importing registers the passes)
from speedc.passes.base import BuildOptions, CompileState, PassReport, require_facts, run_passes
from speedc.passes.block_quant import ACCURACY_LEVEL, BITS, BLOCK_SIZES, quantized_bytes_per_element
from speedc.passes.trace import OPSET
from speedc.passes.schedule import found_plan_checkpoint, plan_in_weights

PIPELINE: list[tuple[str, list[str]]] = [
    ("import", ["trace"]),
    ("analysis", ["share", "schedule"]),
    ("lowering", ["batch_step_graph", "exit_heads", "kv_cache", "gqa_attention", "fuse_projections"]),
    ("finalize", ["cleanup", "fuse_skip_norm", "quantize_weights", "untie_head", "trt_lint", "merge_programs",
                  "native_products", "native_attention"]),
]
PASS_ORDER = [name for _, names in PIPELINE for name in names]
# What the artifact writer needs the pipeline to have produced (passes/base.py FACTS).
ARTIFACT_REQUIRES = ("engine_graph", "heads", "cache_io", "clean")


@dataclass
class BuildResult:
    out: Path
    manifest: Manifest
    reports: list[PassReport]
    notes: list[str]
    seconds: float


STORAGE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes per weight element stored in the artifact (int8/int4: block_quant)


def storage_bytes(options: BuildOptions) -> float:
    if options.dtype in BITS:
        return quantized_bytes_per_element(BITS[options.dtype], options.block_size)
    return STORAGE_BYTES.get(options.dtype, 4)


def check_options(options: BuildOptions) -> None:
    """One-line errors for option combinations no pass can honour, before any work."""
    if options.dtype in BITS and options.block_size not in BLOCK_SIZES:
        raise BuildError(f"--block-size {options.block_size}: MatMulNBits takes {', '.join(map(str, BLOCK_SIZES))}")
    if options.head_dtype is not None and (options.dtype not in BITS or options.head_dtype not in BITS):
        raise BuildError("--head-weights int8|int4 goes with --weights int8|int4")
    if options.dtype in BITS and options.target == "trt":
        raise BuildError(f"--weights {options.dtype} --target trt: TensorRT cannot run ONNX Runtime's MatMulNBits / "
                         "GatherBlockQuantized; build --target onnx, or --weights fp16 for TensorRT")
SAFETENSORS_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def default_storage(declared: dict[str, tuple[int, str]], ignored: tuple[str, ...] = ()) -> str:
    """A checkpoint whose weights are stored in 16 bits keeps that precision (an exact copy, half the bytes
    of fp32); anything else is stored as fp32. The weights are the floating-point tensors the 16-bit
    storage would convert (cleanup's FP16_MIN_ELEMENTS and up) that the family reads: a small fp32 norm,
    or a buffer the family drops (IGNORED prefixes: Parcae's and Huginn's fp32 freqs_cis), does not
    make a bf16 checkpoint fp32."""
    floating = {dtype for name, (size, dtype) in declared.items()
                if dtype in ("F32", "F16", "BF16", "F64") and size // SAFETENSORS_ITEMSIZE[dtype] >= cleanup.FP16_MIN_ELEMENTS
                and not name.startswith(ignored)}
    return {frozenset({"BF16"}): "bf16", frozenset({"F16"}): "fp16"}.get(frozenset(floating), "fp32")


def family_ignored_tensors(checkpoint: Path) -> tuple[str, ...]:
    """The tensor-name prefixes CHECKPOINT's family reads and drops (none where its config is unreadable:
    reading the checkpoint then says why)."""
    import json

    from speedc.models.families import family_of

    try:
        return family_of(json.loads((checkpoint / "config.json").read_text())).ignored_tensors
    except (OSError, ValueError, AttributeError, SpeedcError):
        return ()


def declared_elements(declared: dict[str, tuple[int, str]]) -> int:
    """Weight elements the safetensors headers declare (pickled checkpoints are not sized: 0)."""
    return sum(size // SAFETENSORS_ITEMSIZE.get(dtype, 4) for size, dtype in declared.values())


def check_disk_space(elements: int, out: Path, options: BuildOptions) -> None:
    """Refuse, before reading any weight, a build whose artifact cannot fit on OUT's disk."""
    needed = int(elements * storage_bytes(options)) + (16 << 20)  # + graphs, tokenizer, manifest
    folder = next((p for p in (Path(out).absolute().parent, *Path(out).absolute().parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise BuildError(f"the artifact needs about {needed / 1e9:.1f} GB ({options.dtype} weights) but only "
                         f"{free / 1e9:.1f} GB are free on {folder}")


def build(checkpoint: str | Path, out: str | Path, options: BuildOptions | None = None, *, force: bool = False,
          allow_pickle: bool = False, dump_after: list[str] | None = None,
          on_pass: Callable[[PassReport], None] | None = None, measure_step_cost: bool = False,
          passes: list[str] | None = None,
          progress: Callable[[str], None] = lambda message: None,
          on_weight_bytes: Callable[[int, int], None] | None = None) -> BuildResult:
    """Compile CHECKPOINT into the artifact directory OUT (atomically: OUT appears complete or not at all).

    MEASURE_STEP_COST: time the step graph against plain decoding on this machine (a few seconds) and
    store c(P) in the manifest, so `speedc inspect` predicts from a measurement. PASSES: run this list
    instead of PASS_ORDER (experiments; the runner refuses an order whose passes' needs are unmet).
    ON_WEIGHT_BYTES(done, total): progress while weights stream into weights.bin.

    Memory: weights are never loaded whole. The passes see where each checkpoint tensor's bytes are
    (passes/source_weights.py) and the writer copies them, a row block at a time."""
    options = options or BuildOptions()
    check_options(options)
    checkpoint, out = Path(checkpoint), Path(out)
    started = time.perf_counter()
    passes = list(PASS_ORDER if passes is None else passes)
    check_dump_after(dump_after or [], passes)
    check_output(out, checkpoint, force)
    options = storage_options(checkpoint, out, options)
    cfg, weights, tokenizer = read_checkpoint(checkpoint, options, allow_pickle)
    state = CompileState(cfg, weights, options, has_speedc_section=has_speedc_section(checkpoint),
                         acceptance_hint=acceptance_hint_from_training(checkpoint))
    found = plan_in_weights(state)  # a prelude / core / coda in the stored layers: traced as phases, once
    if found is not None:
        state = found_plan_state(state, *found)
    tmp = staging_dir(out)
    try:
        state, reports = run_passes(state, passes, dump_after=set(dump_after or []), dump_dir=out.parent / f"{out.name}.dumps",
                                    on_pass=on_pass)
        found = found_plan_checkpoint(state)
        if found is not None:  # share's exact analysis of the graph saw another plan than the weights' digests: again
            state, reports = run_passes(found_plan_state(state, *found), passes, dump_after=set(dump_after or []),
                                        dump_dir=out.parent / f"{out.name}.dumps", on_pass=on_pass)
        check_writable(state, options)
        progress("writing the graphs and streaming the weights into the artifact")
        specs, index = write_files(state, checkpoint, tokenizer, tmp, on_weight_bytes)
        manifest = artifact_manifest(state, checkpoint, specs, index, reports)
        gate = read_exit_gate(checkpoint, cfg, allow_pickle=allow_pickle)
        if gate is not None and manifest.depth_plan.loop_exits:  # a request's exit rule reads it (runtimes/exit_rule.py)
            manifest.model["exit_gate"] = gate
        write_manifest(tmp, manifest)
        notes, state = state.notes, None  # the graphs go before the measurement opens the artifact beside them
        if measure_step_cost and options.target == "onnx" and manifest.slots > 1:
            progress("measuring the step cost c(P) on this machine")
            measure_into_manifest(tmp, manifest)
        tmp.chmod(0o755)
        install(tmp, out, force)
    except SpeedcError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as bad:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"cannot write the artifact {out}: {bad.strerror or bad}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out, manifest, reports, notes, time.perf_counter() - started)


# The stages of build(), in its order.

def check_dump_after(dump_after: list[str], passes: list[str]) -> None:
    unknown = sorted(set(dump_after) - set(passes))
    if unknown:
        raise BuildError(f"--dump-after {unknown[0]}: no such pass (passes: {', '.join(passes)})")


def storage_options(checkpoint: Path, out: Path, options: BuildOptions) -> BuildOptions:
    """OPTIONS with the storage dtype settled (the checkpoint's own when unset), after checking the disk holds it."""
    declared = declared_tensor_bytes(checkpoint) if checkpoint.is_dir() else {}
    if options.dtype is None:
        options = dataclasses.replace(options, dtype=default_storage(declared, family_ignored_tensors(checkpoint)))
    check_disk_space(declared_elements(declared), out, options)
    return options


def read_checkpoint(checkpoint: Path, options: BuildOptions, allow_pickle: bool):
    """(config with the options' overrides, lazy weights, tokenizer.json text or None), all checked before compiling."""
    cfg, weights = open_checkpoint(checkpoint, allow_pickle=allow_pickle)
    if options.eos_token_id is not None:
        if not 0 <= options.eos_token_id < cfg.vocab_size:
            raise BuildError(f"--eos-token-id {options.eos_token_id} is outside the vocabulary (0..{cfg.vocab_size - 1})")
        cfg = dataclasses.replace(cfg, eos_token_id=options.eos_token_id, eos_token_ids=(options.eos_token_id,))
    if options.recurrence is not None:
        cfg = cfg.with_recurrence(options.recurrence)
    if options.state_init is not None:
        cfg = cfg.with_state_init(options.state_init, options.state_seed)
    tokenizer = read_tokenizer_json(checkpoint, cfg.vocab_size) if checkpoint.is_dir() else None
    return cfg, weights, tokenizer


def staging_dir(out: Path) -> Path:
    """A fresh folder beside OUT that install() renames into place once the artifact is complete."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as bad:
        raise BuildError(f"cannot write into {out.parent}: {bad.strerror or bad}") from None


def found_plan_state(state: CompileState, cfg, weights) -> CompileState:
    """A fresh compile state of CFG / WEIGHTS (the checkpoint as the plan found in its weights) for the trace."""
    notes = [f"build: traced with the depth plan found in the weights ({cfg.depth_plan.describe()})"]
    return CompileState(cfg, weights, state.options, has_speedc_section=state.has_speedc_section,
                        acceptance_hint=state.acceptance_hint, notes=notes)


def check_writable(state: CompileState, options: BuildOptions) -> None:
    require_facts(state, ARTIFACT_REQUIRES + (("quantized_weights",) if options.dtype in BITS else ()),
                  "the artifact writer")
    if options.target == "trt":
        raise BuildError("--target trt: TensorRT engine building is not available in this speedc build "
                         "(the TensorRT lint passed; build --target onnx to deploy with ONNX Runtime)")


def write_files(state: CompileState, checkpoint: Path, tokenizer: str | None, tmp: Path,
                on_weight_bytes: Callable[[int, int], None] | None):
    """(graph specs, weight index): graphs, weights, config, tokenizer and chat template written into TMP."""
    specs, index = write_graphs(state.graphs, tmp, set(state.weights), state.weight_parts, on_bytes=on_weight_bytes,
                                aliases=state.weight_aliases, native=state.native_graphs,
                                native_cache=state.native_cache)
    state.cfg.save(tmp / CONFIG)
    if tokenizer is not None:
        (tmp / TOKENIZER).write_text(tokenizer)
    for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE):  # the chat template travels with the artifact
        if checkpoint.is_dir() and (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, tmp / name)
    bundled = zoo.tokenizer_config_text(checkpoint)  # the bundled models' chat template (models/zoo.py)
    if bundled is not None:
        (tmp / TOKENIZER_CONFIG).write_text(bundled)
    return specs, index


def artifact_manifest(state: CompileState, checkpoint: Path, specs, index, reports: list[PassReport]) -> Manifest:
    cfg, options = state.cfg, state.options
    unique_bytes, unrolled_bytes = weight_bytes(index, state.layer_map)
    return Manifest(
        format_version=FORMAT_VERSION, speedc_version=__version__, onnx_opset=OPSET,
        source_checkpoint_sha256=checkpoint_hash(checkpoint),
        model={"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "state_width": cfg.state_width,
               **({"initial_state": {"seed": cfg.depth_plan.state_seed, "std": cfg.depth_plan.state_std}}
                  if cfg.depth_plan.state_init == "random" else {}),
               "num_layers": cfg.num_hidden_layers,
               "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
               "max_context": cfg.max_position_embeddings, "eos_token_id": cfg.eos_token_id,
               "eos_token_ids": list(cfg.eos_token_ids),
               "num_unique_blocks": max(state.layer_map) + 1, "exit_norm": state.exit_norm,
               "bos_token_id": cfg.bos_token_id, "architecture": cfg.architecture},
        exit_layer=state.exit_layer, schedule=state.schedule.to_json(), dtype=options.dtype,
        target=options.target, graphs=specs,
        weights={"file": WEIGHTS, "unique_bytes_fp32": unique_bytes, "unrolled_bytes_fp32": unrolled_bytes,
                 "stored_bytes": sum(e["length"] for e in stored_entries(index).values()), "index": index,
                 **({"native_artifact": state.native_artifact_id} if state.native_graphs else {}),
                 **({"quantization": {"bits": BITS[options.dtype], "block_size": options.block_size,
                                      "head_bits": BITS[options.head_dtype or options.dtype],
                                      "accuracy_level": ACCURACY_LEVEL, "symmetric": True,
                                      "ops": ["com.microsoft.MatMulNBits", "com.microsoft.GatherBlockQuantized"]}}
                    if options.dtype in BITS else {})},
        build={"passes": [{"name": r.name, "phase": r.phase, "seconds": round(r.seconds, 3), "nodes": r.nodes,
                           "initializer_bytes": r.initializer_bytes} for r in reports],
               "notes": state.notes},
    )


def measure_into_manifest(tmp: Path, manifest: Manifest) -> None:
    """c(P) of the artifact staged in TMP, measured here and written into its manifest."""
    from speedc.step_timer import measure_artifact

    try:
        manifest.build["step_cost_measured"] = measure_artifact(tmp)
    except SpeedcError:
        raise
    except Exception as bad:  # ONNX Runtime's own exception types: the graphs do not run here
        raise BuildError(f"the built graphs failed to run while measuring c(P) ({str(bad).splitlines()[0]}); "
                         "nothing was written. Please report it; --no-measure skips the measurement") from None
    write_manifest(tmp, manifest)
