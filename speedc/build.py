"""The build driver: checkpoint -> passes -> artifact directory, atomically.

The pipeline is an explicit list grouped in phases (mlc-llm style); each name is a registered pass
in speedc.passes. `speedc build -v` prints one line per pass; `--dump-after NAME` writes the graphs
after that pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

from speedc import __version__
from speedc.artifact import (CONFIG, FORMAT_VERSION, GRAPH_FILES, MANIFEST, TOKENIZER, WEIGHT_ALIGN, WEIGHTS, Manifest,
                             is_weight_name, sha256_file)
from speedc.errors import BuildError, SpeedcError
from speedc.models.checkpoint import checkpoint_hash, load_checkpoint, read_tokenizer_json
from speedc.passes import (cache_writer, cleanup, exit_heads, fuse_projections, gqa_attention, kv_cache,  # noqa: F401
                           schedule, share, step_graph, trace, trt_lint)  # (importing registers the passes)
from speedc.passes.base import BuildOptions, CompileState, PassReport, require_facts, run_passes
from speedc.passes.trace import OPSET

PIPELINE: list[tuple[str, list[str]]] = [
    ("import", ["trace"]),
    ("analysis", ["share", "schedule"]),
    ("lowering", ["step_graph", "exit_heads", "kv_cache", "cache_writer", "gqa_attention", "fuse_projections"]),
    ("finalize", ["cleanup", "trt_lint"]),
]
PASS_ORDER = [name for _, names in PIPELINE for name in names]
# What the artifact writer needs the pipeline to have produced (passes/base.py FACTS).
ARTIFACT_REQUIRES = ("programs", "heads", "cache_io", "cache_writers", "clean")
EXTERNAL_MIN_BYTES = 1024


@dataclass
class BuildResult:
    out: Path
    manifest: Manifest
    reports: list[PassReport]
    notes: list[str]
    seconds: float


def _io_spec(values) -> list[dict]:
    spec = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        spec.append({"name": v.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name})
    return spec


def write_graphs(graphs: dict[str, gs.Graph], directory: Path, weight_names: set[str],
                 weight_parts: dict[str, list] | None = None) -> tuple[dict, dict]:
    """Export each graph to ONNX with its weights in ONE shared external-data file.

    Every checkpoint weight (and any other initializer of 1 KiB or more) goes to weights.bin; a
    weight used by several graphs (same name, same bytes) is written once and they all point at it.
    A stacked weight (fuse_projections) is one entry with "parts"; each checkpoint tensor in it gets
    its own entry "within" it: a byte range of the stacked data, never a copy.
    Returns (graph I/O specs, weight index).
    """
    weight_parts = weight_parts or {}
    index: dict[str, dict] = {}
    digests: dict[str, str] = {}
    specs: dict[str, dict] = {}
    with open(directory / WEIGHTS, "wb") as blob:
        for name, graph in graphs.items():
            model = gs.export_onnx(graph, do_type_check=True)
            model.ir_version = min(model.ir_version, 10)
            for init in model.graph.initializer:
                array = numpy_helper.to_array(init)
                if array.nbytes < EXTERNAL_MIN_BYTES and init.name not in weight_names:
                    continue
                data = np.ascontiguousarray(array).tobytes()
                digest = hashlib.sha256(data).hexdigest()
                entry = index.get(init.name)
                if entry is None:
                    offset = -(-blob.tell() // WEIGHT_ALIGN) * WEIGHT_ALIGN
                    blob.write(b"\0" * (offset - blob.tell()))
                    blob.write(data)
                    entry = index[init.name] = {"offset": offset, "length": len(data), "dtype": array.dtype.name,
                                                "shape": list(array.shape)}
                    digests[init.name] = digest
                    if init.name in weight_parts:
                        entry["parts"] = _index_parts(index, entry, init.name, weight_parts[init.name], array)
                elif digests[init.name] != digest:
                    raise BuildError(f"internal: weight {init.name} differs between graphs")
                init.ClearField("raw_data")
                del init.float_data[:]
                init.data_location = onnx.TensorProto.EXTERNAL
                del init.external_data[:]
                for key, value in (("location", WEIGHTS), ("offset", entry["offset"]), ("length", entry["length"])):
                    init.external_data.add(key=key, value=str(value))
            path = directory / GRAPH_FILES[name]
            onnx.save(model, str(path))
            specs[name] = {"file": GRAPH_FILES[name], "inputs": _io_spec(model.graph.input),
                           "outputs": _io_spec(model.graph.output)}
    for name in graphs:
        onnx.checker.check_model(str(directory / GRAPH_FILES[name]), full_check=False)
    return specs, index


def _index_parts(index: dict[str, dict], entry: dict, name: str, parts: list, array: np.ndarray) -> list[str]:
    """Index entries for the checkpoint tensors stacked (row blocks) in weight NAME."""
    row_bytes = array.itemsize * int(np.prod(array.shape[1:]))
    for part, first_row, rows in parts:
        index[part] = {"offset": entry["offset"] + first_row * row_bytes, "length": rows * row_bytes,
                       "dtype": array.dtype.name, "shape": [rows, *array.shape[1:]], "within": name}
    return [part for part, _, _ in parts]


def stored_entries(index: dict[str, dict]) -> dict[str, dict]:
    """The index entries that own bytes in weights.bin (not the views "within" a stacked weight)."""
    return {name: entry for name, entry in index.items() if "within" not in entry}


def weight_bytes(index: dict[str, dict], layer_map: list[int]) -> tuple[int, int]:
    """(fp32 bytes of the unique weights, fp32 bytes an unrolled export storing every layer would need).
    Other stored constants (tables a pass computed) are not weights."""
    sizes = {name: int(np.prod(entry["shape"])) * 4 for name, entry in stored_entries(index).items()
             if is_weight_name(name)}
    block_sizes = [0] * (max(layer_map) + 1)
    for name, size in sizes.items():
        if name.startswith("model.blocks."):
            block_sizes[int(name.split(".")[2])] += size
    unique = sum(sizes.values())
    return unique, unique - sum(block_sizes) + sum(block_sizes[b] for b in layer_map)


def acceptance_hint_from_training(checkpoint: Path) -> float | None:
    training = checkpoint / "training.json"
    try:
        history = json.loads(training.read_text())["history"]
        return float(history[-1]["agree_top1"])
    except (OSError, KeyError, IndexError, ValueError, TypeError):
        return None


def has_speedc_section(checkpoint: Path) -> bool:
    try:
        return "speedc" in json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return False


def build(checkpoint: str | Path, out: str | Path, options: BuildOptions | None = None, *, force: bool = False,
          allow_pickle: bool = False, dump_after: list[str] | None = None,
          on_pass: Callable[[PassReport], None] | None = None) -> BuildResult:
    options = options or BuildOptions()
    checkpoint, out = Path(checkpoint), Path(out)
    started = time.perf_counter()
    unknown = sorted(set(dump_after or []) - set(PASS_ORDER))
    if unknown:
        raise BuildError(f"--dump-after {unknown[0]}: no such pass (passes: {', '.join(PASS_ORDER)})")
    if out.exists() and not force:
        raise BuildError(f"{out} exists; pass --force to replace it")
    if out.resolve() == checkpoint.resolve():
        raise BuildError("the output directory must differ from the checkpoint directory")
    cfg, tensors = load_checkpoint(checkpoint, allow_pickle=allow_pickle)
    state = CompileState(cfg, tensors, options, has_speedc_section=has_speedc_section(checkpoint),
                         acceptance_hint=acceptance_hint_from_training(checkpoint))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        state, reports = run_passes(state, PASS_ORDER, dump_after=set(dump_after or []), dump_dir=out.parent / f"{out.name}.dumps",
                                    on_pass=on_pass)
        require_facts(state, ARTIFACT_REQUIRES, "the artifact writer")
        if options.target == "trt":
            raise BuildError("--target trt: TensorRT engine building is not available in this speedc build "
                             "(the TensorRT lint passed; build --target onnx to deploy with ONNX Runtime)")
        specs, index = write_graphs(state.graphs, tmp, set(tensors), state.weight_parts)
        cfg.save(tmp / CONFIG)
        tokenizer = read_tokenizer_json(checkpoint)
        if tokenizer is not None:
            (tmp / TOKENIZER).write_text(tokenizer)
        stored = sum(e["length"] for e in stored_entries(index).values())
        unique_bytes, unrolled_bytes = weight_bytes(index, state.layer_map)
        schedule = state.schedule.to_json()
        manifest = Manifest(
            format_version=FORMAT_VERSION, speedc_version=__version__, onnx_opset=OPSET,
            source_checkpoint_sha256=checkpoint_hash(checkpoint),
            model={"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
                   "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                   "max_context": cfg.max_position_embeddings, "eos_token_id": cfg.eos_token_id,
                   "num_unique_blocks": max(state.layer_map) + 1},
            layer_map=state.layer_map, exit_layer=state.exit_layer, schedule=schedule, dtype=options.dtype,
            target=options.target, graphs=specs,
            weights={"file": WEIGHTS, "unique_bytes_fp32": unique_bytes, "unrolled_bytes_fp32": unrolled_bytes,
                     "stored_bytes": stored, "index": index},
            build={"passes": [{"name": r.name, "phase": r.phase, "seconds": round(r.seconds, 3), "nodes": r.nodes,
                               "initializer_bytes": r.initializer_bytes} for r in reports],
                   "notes": state.notes},
        )
        manifest.files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        # The manifest goes last: a directory without one is never loadable.
        (tmp / MANIFEST).write_text(manifest.to_json())
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except SpeedcError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as bad:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"cannot write the artifact: {bad.strerror or bad}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out, manifest, reports, state.notes, time.perf_counter() - started)
