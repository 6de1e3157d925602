"""The artifact format: file layout and manifest, read by the build driver and every runtime.

    OUT/
      manifest.json     format version, versions, source hash, model dims, schedule, graph I/O,
                        weight index, file hashes
      engine.onnx       the engine graph: an If over the prefill (plain N-layer program, B rows: prompt
                        chunks and plain decoding) and the batch step (one SPEED step of n sequences'
                        P-slot pipelines; a single sequence runs it with n = 1); a plain engine: the prefill
      engine.gqa.onnx   its ONNX Runtime variant: fused GroupQueryAttention writes the cache in place
      weights.bin       every unique weight once, shared by both graphs as ONNX external data
      config.json       the model config (for the PyTorch backend and inspection)
      tokenizer.json    (when the checkpoint has one)
      tokenizer_config.json, chat_template.jinja
                        copied from the checkpoint when present: the chat template (`speedc serve`)

The weight index (manifest.weights.index) names every stored tensor: {offset, length, dtype, shape};
a stacked weight (fuse_projections) also lists its "parts", and each checkpoint tensor inside it has
its own entry "within" it: a byte range of the stack, never a copy. With --weights int8/int4 a weight
is stored as block-quantized codes and scales (passes/block_quant.py), each entry saying so under
"quantized" (of, role, bits, block_size, the fp shape); a tensor that re-reads another's bytes in
another shape is an entry "within" it too.

This module owns reading and writing the format. Reading imports only the standard library and
numpy (the runtime path stays light); writing graphs imports onnx and onnx-graphsurgeon inside
write_graphs, which only the build driver calls.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

from speedc.format import contract
from speedc.format.depth_plan import DepthPlan
from speedc.format.manifest_view import ModelDims, WeightStore
from speedc.errors import ArtifactError, BuildError, CheckpointError

FORMAT_VERSION = 5  # 2: the single-sequence step, step_flush and cache-writer graphs are gone; 3: one engine graph per
# variant; 4: the schedule's depth plan names its loop-boundary norm loop_norm (was repeat_norm); 5: the layer map
# is the depth plan's (schedule.depth_plan, always present), not a field beside it
WEIGHT_PREFIXES = ("model.", "lm_head.")  # checkpoint tensor names (native or Hugging Face layout)
MANIFEST = "manifest.json"
# The ONNX IR version graphs are written at: every ONNX Runtime speedc supports reads it (a newer onnx's
# default may be past what an older ONNX Runtime reads).
IR_VERSION = 10

GRAPH_FILES = {name: f"{name}.onnx" for name in contract.GRAPHS}  # graph name -> file
WEIGHTS = "weights.bin"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # its chat_template (and the special tokens it names)
CHAT_TEMPLATE = "chat_template.jinja"  # newer checkpoints keep the template in its own file
WEIGHT_ALIGN = 64
EXTERNAL_MIN_BYTES = 1024  # initializers this large (and every weight) go to weights.bin


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Manifest:
    format_version: int
    speedc_version: str
    onnx_opset: int
    source_checkpoint_sha256: str
    model: dict[str, Any]  # vocab_size, hidden_size, num_layers, num_kv_heads, head_dim, max_context, eos_token_id
    exit_layer: int
    schedule: dict[str, Any]  # passes.schedule.Schedule as JSON
    dtype: str
    target: str
    graphs: dict[str, dict[str, Any]]  # name -> {file, inputs: [{name, shape, dtype}], outputs: [...]}
    weights: dict[str, Any]  # {file, unique_bytes, stored_bytes, index: {name: {offset, length, dtype, shape}}}
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    file_bytes: dict[str, int] = field(default_factory=dict)  # file name -> size (the cheap check at every load)
    build: dict[str, Any] = field(default_factory=dict)  # timings, notes

    @property
    def slots(self) -> int:
        """P: the slots of the batch step's pipeline (serialised as schedule.slots)."""
        return int(self.schedule["slots"])

    @property
    def valid_slots(self) -> list[int]:
        """The pipeline depths the build's plan allowed (serialised as schedule.valid_slots)."""
        return [int(p) for p in self.schedule["valid_slots"]]

    @property
    def stage_layers(self) -> int:
        return int(self.schedule["stage_layers"])

    @cached_property
    def depth_plan(self) -> DepthPlan:
        """The phases of a token's trip the graphs were built for (the schedule's)."""
        try:
            return DepthPlan.from_json(self.schedule["depth_plan"])
        except (CheckpointError, KeyError, TypeError) as bad:
            raise ArtifactError(f"manifest: the schedule's depth plan is missing or malformed ({bad}); rebuild the "
                                "artifact") from None

    @property
    def layer_map(self) -> list[int]:
        """Logical layer -> its block: the depth plan's."""
        return self.depth_plan.layer_map

    @cached_property
    def dims(self) -> ModelDims:
        """The model section, typed (built once: read_manifest builds it to check it)."""
        return ModelDims.of(self.model, self.weights["index"])

    @cached_property
    def store(self) -> WeightStore:
        """The weights section, typed (built once: read_manifest builds it to check it)."""
        return WeightStore.of(self.weights)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, indent=2) + "\n"


def read_manifest(directory: str | Path, *, verify_hashes: bool = False) -> Manifest:
    """Load and check an artifact's manifest: format version, the graphs' I/O against the contract, and
    every listed file present at its recorded size, every one but weights.bin also by sha256 (graphs,
    tokenizer, config: kilobytes to megabytes). VERIFY_HASHES: weights.bin by sha256 too (gigabytes at
    real size, a full read, which is why a load does not do it; `speedc inspect --verify` does)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: not an artifact directory")
    if not path.exists():
        raise ArtifactError(f"{directory}: no {MANIFEST} (not a speedc artifact, or an unfinished build)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise ArtifactError(f"{path}: unreadable ({bad})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: malformed manifest (not a JSON object); rebuild the artifact")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format version {version} but this speedc reads version {FORMAT_VERSION}; "
                            "rebuild it with `speedc build`")
    try:
        manifest = Manifest(**data)
    except TypeError as bad:
        raise ArtifactError(f"{path}: malformed manifest ({bad})") from None
    model = manifest.model if isinstance(manifest.model, dict) else {}
    for key in ("vocab_size", "max_context"):  # every runtime reads them at once (a bare KeyError before)
        if not (isinstance(model.get(key), int) and model[key] > 0):
            raise ArtifactError(f"{path}: malformed manifest (model.{key} missing or not a positive integer); "
                                "rebuild the artifact")
    try:
        manifest.dims, manifest.store  # the typed views, built once here (a malformed section fails at load)
        dims = contract.Dims.from_manifest(manifest)
        for name, spec in manifest.graphs.items():
            contract.check_graph_io(name, spec, dims)
    except ArtifactError as mismatch:
        raise ArtifactError(f"{directory}: {mismatch} (built by speedc {manifest.speedc_version}); rebuild it with "
                            "this speedc: speedc build CHECKPOINT -o OUT --force") from None
    except (KeyError, TypeError, ValueError, AttributeError) as bad:
        raise ArtifactError(f"{path}: malformed manifest ({bad!r}); rebuild the artifact") from None
    check_files(directory, manifest, every_hash=verify_hashes)
    return manifest


def check_files(directory: Path, manifest: Manifest, *, every_hash: bool) -> None:
    """ArtifactError naming the first listed file that is missing, unreadable, of another size than
    recorded, or of another sha256 (weights.bin only with EVERY_HASH)."""
    for name, expected in manifest.files.items():
        file = directory / name
        if not file.exists():
            raise ArtifactError(f"{file}: listed in the manifest but missing; rebuild the artifact")
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in the manifest but not a file; rebuild the artifact")
        try:
            size = file.stat().st_size
            recorded = manifest.file_bytes.get(name)
            if recorded is not None and size != recorded:
                raise ArtifactError(f"{file}: {size} bytes, the manifest records {recorded} (truncated or replaced); "
                                    "rebuild the artifact")
            hashed = every_hash or name != WEIGHTS or recorded is None
            if hashed and sha256_file(file) != expected:
                raise ArtifactError(f"{file}: sha256 does not match the manifest (corrupt or modified); rebuild the artifact")
        except OSError as bad:  # a folder in its place, no permission
            raise ArtifactError(f"{file}: unreadable ({bad.strerror or bad}); rebuild the artifact") from None


def is_weight_name(name: str) -> bool:
    """A model weight (a checkpoint tensor, or a stack of them), not a table a compiler pass computed."""
    return name.startswith(WEIGHT_PREFIXES)


def stored_entries(index: dict[str, dict]) -> dict[str, dict]:
    """The index entries that own bytes in weights.bin (not the views "within" a stacked weight)."""
    return {name: entry for name, entry in index.items() if "within" not in entry}


def weight_bytes(index: dict[str, dict], layer_map: list[int]) -> tuple[int, int]:
    """(fp32 bytes of the unique weights, fp32 bytes an unrolled export storing every layer would need).
    Other stored constants (tables a pass computed) are not weights; a quantized weight counts as the fp32
    weight it stands for (its codes' "quantized" shape), its scales not again."""
    sizes = {name: int(np.prod(entry.get("quantized", entry)["shape"])) * 4 for name, entry in stored_entries(index).items()
             if is_weight_name(name) and entry.get("quantized", {}).get("role", "codes") == "codes"}
    block_sizes = [0] * (max(layer_map) + 1)
    for name, size in sizes.items():
        if name.startswith("model.blocks."):
            block_sizes[int(name.split(".")[2])] += size
    unique = sum(sizes.values())
    return unique, unique - sum(block_sizes) + sum(block_sizes[b] for b in layer_map)


def checkpoint_tensor_names(manifest: "Manifest") -> list[str]:
    """The checkpoint tensors the artifact stores (each once; a stacked weight's parts, not the stack) in a
    float precision (a block-quantized artifact stores codes and scales instead: see is_quantized)."""
    index = manifest.store.index

    def quantized(entry: dict) -> bool:
        return "quantized" in entry or "quantized" in index.get(entry.get("within"), {})

    return [name for name, entry in index.items() if is_weight_name(name) and "parts" not in entry and not quantized(entry)]


QUANTIZED_DTYPES = ("int8", "int4")  # manifest.dtype of artifacts with block-quantized weights (passes/block_quant.py)


def is_quantized(manifest: "Manifest") -> bool:
    return manifest.dtype in QUANTIZED_DTYPES


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """What MatMulNBits / GatherBlockQuantized compute with: codes [N, n_blocks, block_size * bits / 8]
    (4 bits: the lower K index in the low nibble) and scales [N, n_blocks] -> values [N, K], with the
    default zero point 2^(bits-1)."""
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:2], -1)  # [N, nb, bs]
    values = (codes.astype(np.float32) - (1 << (bits - 1))) * scales.reshape(*codes.shape[:2], 1)  # [N, nb, bs]
    return values.reshape(codes.shape[0], -1)[:, :k]


def dequantized_weights(directory: str | Path, manifest: "Manifest") -> dict[str, np.ndarray]:
    """Checkpoint tensor name -> the values a block-quantized artifact computes with (float32), from its
    codes and scales; a stacked weight is split back into its parts."""
    index = manifest.store.index
    weights = {}
    for name, entry in stored_entries(index).items():
        info = entry.get("quantized")
        if not info or info["role"] != "codes":
            continue
        scales = name + "_scales" if name + "_scales" in index else name + "_scales.rows"  # [N, nb] or, embedding only, [N, nb, 1]
        values = dequantize_blocks(read_weight(directory, manifest, name), read_weight(directory, manifest, scales),
                                   info["bits"], info["shape"][1])  # [N, K]
        row_bytes = entry["length"] // entry["shape"][0]
        suffix = name[len(info["of"]):]  # ".q4" / ".q8"
        for part in entry.get("parts", [name]):
            first = (index[part]["offset"] - entry["offset"]) // row_bytes
            weights[part[:-len(suffix)]] = values[first:first + index[part]["shape"][0]]
    return weights


def read_weight(directory: str | Path, manifest: Manifest, name: str) -> np.ndarray:
    """One stored weight as a numpy array (memory-mapped from weights.bin; bfloat16 needs ml_dtypes,
    which the compiler extra brings)."""
    entry = manifest.store.index[name]
    if entry["dtype"] == "bfloat16":
        import ml_dtypes  # noqa: F401  (registers the numpy dtype)
    data = np.memmap(Path(directory) / manifest.store.file, dtype=np.uint8, mode="r",
                     offset=entry["offset"], shape=(entry["length"],))
    return np.frombuffer(data, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])


# ---- writing (the build driver) ------------------------------------------------------------------
def _io_spec(values) -> list[dict]:
    import onnx

    spec = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        spec.append({"name": v.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name})
    return spec


def _index_parts(index: dict[str, dict], entry: dict, name: str, parts: list) -> list[str]:
    """Index entries for the checkpoint tensors stacked (row blocks) in weight NAME."""
    row_bytes = entry["length"] // entry["shape"][0]
    for part, first_row, rows in parts:
        index[part] = {"offset": entry["offset"] + first_row * row_bytes, "length": rows * row_bytes,
                       "dtype": entry["dtype"], "shape": [rows, *entry["shape"][1:]], "within": name}
    return [part for part, _, _ in parts]


def _stored_constants(graphs: dict, ordered: list[str], weight_names: set[str]) -> dict[str, list]:
    """name -> every graph Constant of that name that goes to weights.bin (first use first)."""
    import onnx_graphsurgeon as gs

    from speedc.format.graph_values import constant_nbytes

    stored: dict[str, list] = {}
    for graph_name in ordered:
        top = graphs[graph_name]
        tensors = [t for part in (top, *top.subgraphs(recursive=True)) for t in part.tensors().values()]
        for tensor in tensors:
            if not isinstance(tensor, gs.Constant):
                continue
            if (constant_nbytes(tensor) >= EXTERNAL_MIN_BYTES or tensor.name in weight_names or is_weight_name(tensor.name)
                    or _view_of(tensor) is not None):
                stored.setdefault(tensor.name, []).append(tensor)
    return stored


def _chunks(constant):
    """A constant's values as byte-ready arrays: streamed row blocks for a weight still in the checkpoint
    (any object with `chunks()`, see passes/source_weights.py), the array itself otherwise (a weight
    held in memory is checked for nan/inf here; computed tables may hold -inf on purpose)."""
    values = constant._values  # graphsurgeon's storage: .values would load a lazy weight whole
    if hasattr(values, "chunks"):
        return values.chunks()
    array = np.ascontiguousarray(constant.values)
    if is_weight_name(constant.name) and array.dtype.kind == "f":
        from speedc.format.graph_values import non_finite_count

        bad = non_finite_count(array)
        if bad:
            raise CheckpointError(f"{bad} nan/inf values")
    return iter([array])


def _identity(constant) -> tuple:
    values = constant._values
    if hasattr(values, "identity"):
        return values.identity()
    return "array", hashlib.sha256(np.ascontiguousarray(constant.values).tobytes()).hexdigest()


def _view_of(constant) -> str | None:
    """The stored tensor whose bytes this constant's values are, in another shape or under another name
    (passes/block_quant.py, passes/untie_head.py)."""
    return getattr(constant._values, "view_of", None)


def _within(index: dict[str, dict], name: str, target: str) -> dict:
    """NAME's index entry over TARGET's bytes (written once), returned for its dtype and shape."""
    base = index[target]
    index[name] = {"offset": base["offset"], "length": base["length"], "within": target}
    return index[name]


def _reference(index: dict[str, dict], name: str, uses: list, weight_parts: dict[str, list]) -> None:
    """Complete NAME's index entry (its byte range is set) and point every graph's constant at those bytes."""
    import onnx

    from speedc.format.graph_values import WrittenWeight

    dtype = np.dtype(uses[0].dtype)
    entry = index[name]
    entry.update(dtype=dtype.name, shape=list(uses[0].shape))
    info = getattr(uses[0]._values, "index_info", None)
    if info is not None:
        entry["quantized"] = info()
    if name in weight_parts:
        entry["parts"] = _index_parts(index, entry, name, weight_parts[name])
    proto = onnx.TensorProto(name=name, dims=entry["shape"], data_type=onnx.helper.np_dtype_to_tensor_dtype(dtype),
                             data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", WEIGHTS), ("offset", entry["offset"]), ("length", entry["length"])):
        proto.external_data.add(key=key, value=str(value))
    for constant in uses:
        constant.values = WrittenWeight(proto, entry["shape"], dtype)


def lift_stored_initializers(graph) -> None:
    """Move the weights.bin initializers of GRAPH's subgraphs (an engine graph's If branches; an
    exporter writes a constant into the graph whose node reads it) up to GRAPH itself, one per name: the
    branches then read one outer-scope tensor, loaded once, instead of one copy each."""
    lifted = {t.name for t in graph.initializer}
    stack = list(graph.node)
    while stack:
        node = stack.pop()
        for attribute in node.attribute:
            for branch in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                kept = []
                for tensor in branch.initializer:
                    if tensor.data_location != tensor.EXTERNAL:
                        kept.append(tensor)
                    elif tensor.name not in lifted:
                        lifted.add(tensor.name)
                        graph.initializer.append(tensor)
                del branch.initializer[:]
                branch.initializer.extend(kept)
                stack.extend(branch.node)


def write_graphs(graphs: dict, directory: Path, weight_names: set[str], weight_parts: dict[str, list] | None = None,
                 on_bytes: Callable[[int, int], None] | None = None, aliases: dict[str, str] | None = None,
                 native: dict | None = None, native_cache: dict | None = None) -> tuple[dict, dict]:
    """Write every graph as ONNX with its weights in ONE shared external-data file, weights.bin.

    Weights are streamed: each is copied from where it is (checkpoint bytes, converted to its storage
    dtype a row block at a time) into weights.bin once, whatever number of graphs use it, and each
    graph's initializer becomes an external-data reference (location, offset, length); no graph proto
    ever holds weight bytes. Graphs are written in the contract's order, so the same pipeline result
    always gives the same bytes. A stacked weight (fuse_projections) is one entry with "parts"; each
    checkpoint tensor in it gets its own entry "within" it. ALIASES (model tensor -> stored tensor with
    the same values, merged by the share pass) become entries "within" their target. ON_BYTES(done, total)
    reports progress.
    Returns (graph I/O specs, weight index).
    """
    unknown = sorted(set(graphs) - set(contract.GRAPHS))
    if unknown:
        raise BuildError(f"internal: graph {unknown[0]!r} is not part of the artifact contract")
    weight_parts = weight_parts or {}
    ordered = [name for name in contract.GRAPHS if name in graphs]
    native = {name: twin for name, twin in (native or {}).items() if name in graphs}
    twins = {name + contract.NATIVE_SUFFIX: twin for name, twin in native.items()}
    stored = _stored_constants({**graphs, **twins}, ordered + list(twins), weight_names)
    for name, uses in stored.items():
        if len({_identity(c) for c in uses}) > 1:
            raise BuildError(f"internal: weight {name} differs between graphs")
    views = {name: uses for name, uses in stored.items() if _view_of(uses[0]) in stored}
    owners = {name: uses for name, uses in stored.items() if name not in views}
    index = _write_weights(directory / WEIGHTS, owners, weight_parts, on_bytes)
    for name, uses in views.items():  # the same bytes in another shape: referenced, not written again
        _within(index, name, _view_of(uses[0]))
        _reference(index, name, uses, {})
    for alias, target in (aliases or {}).items():  # model tensors no graph reads under their own name
        if alias not in index and target in index:
            _within(index, alias, target).update(dtype=index[target]["dtype"], shape=index[target]["shape"])
    return _write_graph_files(graphs, native, native_cache or {}, ordered, directory), index


def _write_weights(path: Path, owners: dict[str, list], weight_parts: dict[str, list],
                   on_bytes: Callable[[int, int], None] | None) -> dict[str, dict]:
    """Each of OWNERS' weights streamed into PATH (weights.bin) once, aligned -> the weight index."""
    from speedc.format.graph_values import constant_nbytes

    total = sum(constant_nbytes(uses[0]) for uses in owners.values())
    index: dict[str, dict] = {}
    done = 0
    with open(path, "wb") as blob:
        for name, uses in owners.items():
            offset = -(-blob.tell() // WEIGHT_ALIGN) * WEIGHT_ALIGN
            blob.write(b"\0" * (offset - blob.tell()))
            try:
                for chunk in _chunks(uses[0]):
                    blob.write(chunk.reshape(-1).view(np.uint8).data)  # no copy
                    done += chunk.nbytes
                    if on_bytes:
                        on_bytes(done, total)
            except CheckpointError as bad:
                raise CheckpointError(f"weight {name}: {bad}") from None
            index[name] = {"offset": offset, "length": blob.tell() - offset}
            _reference(index, name, uses, weight_parts)
    return index


def _write_graph_files(graphs: dict, native: dict, native_cache: dict, ordered: list[str], directory: Path) -> dict[str, dict]:
    """Each graph (and its native twin) as an ONNX file whose initializers reference weights.bin, checked
    -> the graph I/O specs (a twin must take and return what its graph does; one that attends over the
    runtime's own pool, NATIVE_CACHE (graph -> that pool's dtype), what its graph does less the caches)."""
    import onnx
    import onnx_graphsurgeon as gs

    specs: dict[str, dict] = {}
    written = []
    for name in ordered:
        for graph, file in [(graphs[name], GRAPH_FILES[name])] + ([(native[name], native_file(name))] if name in native else []):
            model = gs.export_onnx(graph, do_type_check=True)
            lift_stored_initializers(model.graph)
            model.ir_version = min(model.ir_version, IR_VERSION)
            onnx.save(model, str(directory / file))
            written.append(file)
            io = {"inputs": _io_spec(model.graph.input), "outputs": _io_spec(model.graph.output)}
            if name not in specs:
                specs[name] = {"file": file, **io}
                continue
            own = native_io(specs[name], native_cache.get(name))
            if io != own:
                raise BuildError(f"internal: the native twin of {name} does not take and return what {name} does"
                                 + (" less its caches" if name in native_cache else ""))
            specs[name]["native_file"] = file
            if name in native_cache:
                specs[name][contract.NATIVE_CACHE] = native_cache[name]
    for file in written:
        onnx.checker.check_model(str(directory / file), full_check=False)
    return specs


def native_io(spec: dict, native_cache: str | None) -> dict:
    """{inputs, outputs} a graph's native twin takes and returns (SPEC: the graph's manifest entry; NATIVE_CACHE:
    its twin's KV pool dtype, where the twin attends over the runtime's own pool: then less the caches)."""
    io = {"inputs": spec["inputs"], "outputs": spec["outputs"]}
    if native_cache is None:
        return io
    return {side: contract.without_caches(tensors) for side, tensors in io.items()}


def native_file(graph: str) -> str:
    """The file of GRAPH's native twin (its products on speedc's kernel)."""
    return GRAPH_FILES[graph].removesuffix(".onnx") + contract.NATIVE_SUFFIX + ".onnx"


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Hash every file, then write the manifest LAST: a directory without one is never loadable."""
    files = [p for p in sorted(Path(directory).iterdir()) if p.name != MANIFEST]
    manifest.files = {p.name: sha256_file(p) for p in files}
    manifest.file_bytes = {p.name: p.stat().st_size for p in files}
    (Path(directory) / MANIFEST).write_text(manifest.to_json())
