"""The compiler/runtime contract: the graphs an artifact holds and the tensors each takes and returns.

The passes emit exactly these names, the backends bind exactly these names, and at load the runtime
checks each graph's I/O recorded in the manifest against `expected_io` (and ONNX Runtime's view of
each file against the manifest), so a change on one side is a one-line ArtifactError naming the graph
and tensor, not a failure deep inside a run.

    prefill        input_ids [B, L]  positions [B]  chunk_lengths [B]  cache.{key,value}.{l} [B, kvh, T, hd]  (l < N)
                   (a recurrent core's plan also readout_repeats [B]: the core repeats after which row b's final
                   readout reads, 1..R; the repeats beyond still run, their K/V unread by such a row's later tokens)
                   -> next_token [B]  logits [B, V]  new_{key,value} [N, B, kvh, L, hd]
                   (row b: its first chunk_lengths[b] tokens are real, the rest right padding; next_token and
                   logits are its last real token's. B sequences at once: first prompt chunks arriving
                   together, or batched plain decoding; a chunk with past context runs alone)
    batch_step     n sequences x P slots = R rows, row r = s*n + b (slot-major: the slots' rows are contiguous)
                   input_ids [n, 1] (slot 0 of each sequence)  positions [R]  hidden_in [(P-1)n, 1, H]
                   (H: the carried state's width, 2H = [state | e] for a plan with an injection)
                   final_rows [F]  exit_rows [E] (rows whose final / exit head is wanted)
                   check_rows [K']  check_candidates [K', K] (early-flush checks: the exit head scored over
                   K candidate ids only, K = candidate_count(V))
                   cache.{key,value}.{j}.{s} [n, kvh, T, hd]  (j < S, s < P: one slab per stage layer and slot)
                   -> final_token [F]  final_logits [F, V]  exit_tokens [E]  exit_candidates [E, K] (their top K)
                      check_tokens [K'] (each check's best candidate)  hidden_out [R, 1, H]
                      new_{key,value} [S, R, kvh, 1, hd]
    batch_step of a depth plan with a prelude / coda (speedc/format/cache_layout.py; standard graph only):
                   as batch_step, plus cache.{key,value}.prelude.{i} [n, kvh, T, hd] (i < Lp) and
                   cache.{key,value}.coda.{i}.{d} [n, kvh, T, hd] (i < Lc, readout depth d: 0 draft, 1 final)
                   (a recurrent core's plan also readout_repeats [n]: the core repeats after which sequence b's final
                   readout reads, 1..R: the end of repeat (r-1) % K of slot (r-1) // K, K = R/P, whose row the final
                   head reads; R unless a request runs fewer)
                   -> also new_{key,value}.prelude [Lp, n, kvh, 1, hd]  new_{key,value}.coda [Lc, 2, n, kvh, 1, hd];
                   its prefill reads the N logical layers' slabs and the draft readout's coda slabs but the last
                   (cache.{key,value}.{N+i}, i < Lc - 1: each coda layer attends over its own depth's past) and
                   returns E = N + Lc entries' new rows (the draft readout's coda last: its K/V of the chunk's rows,
                   computed from the draft tap)
    *.gqa          as the program it varies, new_{key,value} replaced by <cache input>.out (the cache
                   written in place: each output is bound to the buffer of its input)
    batch_step.gqa as batch_step, but its cache is the whole pool of each stage layer, one buffer
                   pool.{key,value}.{j} [P*W, kvh, T, hd] (row s*W + b; W pool rows >= n), and only
                   the rows in computed_rows [C] (slot-major row numbers, those holding a token) run:
                   final_rows / exit_rows / check_rows are positions among them, hidden_out is [C, 1, H]

The artifact holds the programs as ONE graph per variant, `engine` (standard) and `engine.gqa` (fused),
so a process that runs them opens one ONNX Runtime session and holds one copy of the weights:

    engine         P = 1: the prefill program itself
                   P > 1: run_step [] (bool) -> If(run_step: batch_step, else: prefill)
                   inputs: run_step, then the union of both programs' inputs (input_ids and positions are
                   shared; the program not run ignores its own, which are still fed: any small tensor);
                   outputs: the union of both programs' outputs (new_{key,value} shared; the other
                   program's come back empty); a name both use takes None where their shapes differ

A single sequence is a batch of one (n = 1): every decode, single-sequence or batched, runs these graphs.

Standard library only: every layer (passes, runtimes, bench) imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speedc.errors import ArtifactError

# ---- graphs --------------------------------------------------------------------------------------
PREFILL = "prefill"
BATCH_STEP = "batch_step"  # one step of n sequences' pipelines (runtimes/backends/onnx.py)
PROGRAMS = (PREFILL, BATCH_STEP)  # the model programs (a plain engine has only prefill); the passes build them
FUSED_SUFFIX = ".gqa"  # names of the ONNX Runtime variants with fused attention (programs and graphs)
ENGINE = "engine"  # the artifact's graph: the programs as the branches of one If (passes/merge_programs.py)
GRAPHS = (ENGINE, ENGINE + FUSED_SUFFIX)  # what an artifact holds, one file each
RUN_STEP = "run_step"  # the engine graph's branch: true runs the batch step, false the prefill (P > 1 only)


def fused(graph: str) -> str:
    return graph + FUSED_SUFFIX


def variant(graph: str) -> str:
    """The variant suffix of a program or graph name ("" or FUSED_SUFFIX)."""
    return FUSED_SUFFIX if graph.endswith(FUSED_SUFFIX) else ""


# ---- native products (passes/native_products.py writes them, runtimes/kernels/ort_op.py runs them) ----
# A block-quantized artifact's engine graphs each have a twin (the manifest's `native_file` of the graph)
# that takes and returns the same tensors (the fused graph's: less its caches, see NATIVE_ATTENTION below),
# its weight products run by speedc's kernel as this operator:
#   x [M, K] -> NATIVE_PRODUCT(artifact, codes, scales, n, k, bits, block_size) -> y [M, N]
# naming its codes and scales in the weight index of the artifact whose manifest records `artifact`.
NATIVE_DOMAIN = "ai.onnx.contrib"  # onnxruntime-extensions' domain of Python operators
NATIVE_PRODUCT = "SpeedcBlockProduct"
NATIVE_PRODUCT_ATTRIBUTES = {"artifact": str, "codes": str, "scales": str, "n": int, "k": int, "bits": int,
                             "block_size": int}
NATIVE_SUFFIX = ".native"  # a twin's file: the graph's file name with this before ".onnx"
# A 16-bit artifact's twin runs its products on 16-bit weights read in place (bf16 or fp16, [n, k]):
#   x [M, K] -> NATIVE_HALF_PRODUCT(artifact, weight, n, k, dtype) -> y [M, N]
NATIVE_HALF_PRODUCT = "SpeedcHalfProduct"
NATIVE_HALF_PRODUCT_ATTRIBUTES = {"artifact": str, "weight": str, "n": int, "k": int, "dtype": str}


# The fused engine graph's twin also runs each layer's attention on the kernel, over a KV pool the runtime
# holds outside ONNX Runtime at the precision the manifest records (the graph's NATIVE_CACHE, "float16"):
#   qkv [R, L, (h + 2 kvh) hd], positions [X], lengths [X], rows [R] int64
#       -> NATIVE_ATTENTION(artifact, key, value, slots, heads, kv_heads, head_dim, theta) -> [R, L, h hd]
# Row i is entry rows[i] of positions / lengths; its cache row is that entry's in the pool the runtime binds
# under the names KEY and VALUE (slots P > 1: entry s*n + b is pool row s*W + b of [P*W, kvh, T+1, hd]). So
# that twin takes and returns the fused graph's tensors less its caches (without_caches).
NATIVE_ATTENTION = "SpeedcAttention"
NATIVE_ATTENTION_ATTRIBUTES = {"artifact": str, "key": str, "value": str, "slots": int, "heads": int, "kv_heads": int,
                               "head_dim": int, "theta": str}
NATIVE_CACHE = "native_cache"  # a graph's manifest entry: its twin's KV pool dtype, where its twin attends natively


def rotary_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[hd/2] float32: Hugging Face's default rope frequencies theta^(-2i/hd) (models/row_layer.py rotary_inv_freq, in
    numpy): what the fused graphs' rotary tables and NATIVE_ATTENTION's `theta` rotate by."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)


def without_caches(specs: list) -> list:
    """SPECS (tensor specs, or dicts with a "name") less the cache inputs and their in-place outputs."""
    return [spec for spec in specs if not is_cache_input(spec["name"] if isinstance(spec, dict) else spec[0])]


def native_product_takes(bits: int, block_size: int) -> bool:
    """Whether the kernel runs weights of BITS in blocks of BLOCK_SIZE (activations go per 32 values)."""
    return bits in (4, 8) and block_size >= 32 and block_size % 32 == 0


# ---- tensors -------------------------------------------------------------------------------------
INPUT_IDS, POSITIONS = "input_ids", "positions"
HIDDEN_IN, HIDDEN_OUT = "hidden_in", "hidden_out"
FINAL_TOKEN, FINAL_LOGITS, EXIT_TOKENS = "final_token", "final_logits", "exit_tokens"
NEXT_TOKEN, LOGITS = "next_token", "logits"
FINAL_ROWS, EXIT_ROWS = "final_rows", "exit_rows"
COMPUTED_ROWS = "computed_rows"  # the fused batch step's rows that run (slot-major indices; bubbles do not)
# prefill: row b's real tokens are input_ids[b, :chunk_lengths[b]], the rest right padding (so prompts of
# different lengths prefill in one run; a padded token's K/V land past its row's end, its logits unread)
CHUNK_LENGTHS = "chunk_lengths"
# A recurrent core's start state per token row, where the plan draws it at random (Huginn's --state-init
# random): [rows, H], the prefill's token rows (B*L) or the batch step's entering rows (n); the runtime
# draws each from (seed, position) (speedc/format/initial_state.py), so plain decoding and SPEED agree.
INITIAL_STATE = "initial_state"
# A recurrent core's final readout per row (DepthPlan.recurrent: a request may run fewer core repeats than built):
# after READOUT_REPEATS[b] repeats, in the prefill's rows and the batch step's sequences alike.
READOUT_REPEATS = "readout_repeats"
# batch step: an early-flush check (a token's exit head again, one or more stages deeper) scores only the
# candidates its first exit gave (exit_candidates: that exit's top CHECK_CANDIDATES token ids), not the
# whole vocabulary; check_tokens is the best of them (runtimes/batch.py)
CHECK_ROWS, CHECK_CANDIDATES, CHECK_TOKENS = "check_rows", "check_candidates", "check_tokens"
EXIT_CANDIDATES = "exit_candidates"
CHECK_CANDIDATE_COUNT = 8  # zoo:small: a deeper exit's argmax lay in the first exit's top 8 in 1,024 of 1,024 checks


def candidate_count(vocab_size: int) -> int:
    """Token ids an early-flush check of the batch step scores (at most the vocabulary)."""
    return min(CHECK_CANDIDATE_COUNT, vocab_size)

KV_KINDS = ("key", "value")


def cache_input(kind: str, index: int) -> str:
    """The prefill program's cache slab of logical layer `index`."""
    return f"cache.{kind}.{index}"


def pool_input(kind: str, stage_layer: int) -> str:
    """The fused batch step's whole pool of one stage layer (every pipeline slot's sequence rows)."""
    return f"pool.{kind}.{stage_layer}"


def batch_cache_input(kind: str, stage_layer: int, slot: int) -> str:
    """The batch step's cache slab of stage layer j and pipeline slot s over the n sequences."""
    return f"cache.{kind}.{stage_layer}.{slot}"


def phase_cache_input(kind: str, phase: str, layer: int, depth: int | None = None) -> str:
    """The batch step's slab of a prelude layer (depth None) or of coda layer i at readout depth d."""
    return f"cache.{kind}.{phase}.{layer}" + ("" if depth is None else f".{depth}")


def phase_new_rows(kind: str, phase: str) -> str:
    """The batch step's stacked new K or V rows of a prelude or coda phase."""
    return f"new_{kind}.{phase}"


def in_place_output(cache: str) -> str:
    """A fused graph's output that is its cache input CACHE written in place (bound to the same buffer)."""
    return cache + ".out"


def is_cache_input(name: str) -> bool:
    return name.startswith(("cache.", "pool."))


def new_rows(kind: str) -> str:
    """The stacked new K or V rows a standard program returns."""
    return f"new_{kind}"


# ---- expected I/O --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    """The sizes the contract's shapes are made of (from the manifest)."""
    slots: int  # P
    stage_layers: int  # S
    num_layers: int  # N
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    prelude_layers: int = 0  # Lp of a pipelined depth plan (0: a cycle, or the plain engine)
    coda_layers: int = 0  # Lc of a pipelined depth plan: two readout depths own its K/V
    state_width: int = 0  # floats a slot carries per token (hidden_in / hidden_out): H, or 2H = [state | e] (0: H)
    random_state: bool = False  # the programs take INITIAL_STATE (a recurrent core started from a random draw)
    recurrent: bool = False  # the programs take READOUT_REPEATS (DepthPlan.recurrent)

    @property
    def carried(self) -> int:
        return self.state_width or self.hidden_size

    @property
    def candidates(self) -> int:
        return candidate_count(self.vocab_size)

    @property
    def cache_entries(self) -> int:
        """The prefill graph's cache entries: every logical layer, then the draft readout's coda."""
        return self.num_layers + self.coda_layers

    @classmethod
    def from_manifest(cls, manifest) -> "Dims":
        model = manifest.dims
        plan = manifest.depth_plan if manifest.slots > 1 else None
        phases = (len(plan.prelude), len(plan.coda)) if plan else (0, 0)
        return cls(manifest.slots, manifest.stage_layers, model.num_layers, model.kv_heads, model.head_dim,
                   model.hidden_size, model.vocab_size, *phases, model.state_width, model.initial_state is not None,
                   manifest.depth_plan.recurrent)


Shape = tuple  # ints for fixed sizes, None where the size is dynamic
TensorSpec = tuple[str, str, Shape]  # (name, numpy dtype name, shape)


def _prefill_io(d: Dims) -> tuple[list[TensorSpec], list[TensorSpec]]:
    i64, f32 = "int64", "float32"
    inputs = [(INPUT_IDS, i64, (None, None)), (POSITIONS, i64, (None,)), (CHUNK_LENGTHS, i64, (None,))]
    inputs += [(INITIAL_STATE, f32, (None, d.hidden_size))] if d.random_state else []
    inputs += [(READOUT_REPEATS, i64, (None,))] if d.recurrent else []
    reads = d.num_layers + max(d.coda_layers - 1, 0)  # a draft readout's coda but its last layer (CacheLayout.prefill_reads)
    inputs += [(cache_input(kind, layer), f32, (None, d.kv_heads, None, d.head_dim))
               for layer in range(reads) for kind in KV_KINDS]
    outputs = [(NEXT_TOKEN, i64, (None,)), (LOGITS, f32, (None, d.vocab_size))]
    rows = (d.cache_entries, None, d.kv_heads, None, d.head_dim)  # it writes every entry (a depth plan's draft coda too)
    return inputs, outputs + [(new_rows(kind), f32, rows) for kind in KV_KINDS]


def _batch_step_io(d: Dims) -> tuple[list[TensorSpec], list[TensorSpec]]:
    i64, f32 = "int64", "float32"
    inputs = [(INPUT_IDS, i64, (None, 1)), (POSITIONS, i64, (None,)), (HIDDEN_IN, f32, (None, 1, d.carried)),
              (FINAL_ROWS, i64, (None,)), (EXIT_ROWS, i64, (None,)), (CHECK_ROWS, i64, (None,)),
              (CHECK_CANDIDATES, i64, (None, d.candidates))]
    inputs += [(INITIAL_STATE, f32, (None, d.hidden_size))] if d.random_state else []
    inputs += [(READOUT_REPEATS, i64, (None,))] if d.recurrent else []
    inputs += [(batch_cache_input(kind, j, s), f32, (None, d.kv_heads, None, d.head_dim))
               for j in range(d.stage_layers) for s in range(d.slots) for kind in KV_KINDS]
    outputs = [(FINAL_TOKEN, i64, (None,)), (FINAL_LOGITS, f32, (None, d.vocab_size)), (EXIT_TOKENS, i64, (None,)),
               (EXIT_CANDIDATES, i64, (None, d.candidates)), (CHECK_TOKENS, i64, (None,)),
               (HIDDEN_OUT, f32, (None, 1, d.carried))]
    rows = (d.stage_layers, None, d.kv_heads, 1, d.head_dim)
    slab = (None, d.kv_heads, None, d.head_dim)
    if d.prelude_layers or d.coda_layers:  # a depth plan's phases beside the slots
        inputs += [(phase_cache_input(kind, "prelude", i), f32, slab) for i in range(d.prelude_layers) for kind in KV_KINDS]
        inputs += [(phase_cache_input(kind, "coda", i, depth), f32, slab) for i in range(d.coda_layers)
                   for depth in range(2) for kind in KV_KINDS]
        outputs += [(phase_new_rows(kind, "prelude"), f32, (d.prelude_layers, None, d.kv_heads, 1, d.head_dim))
                    for kind in KV_KINDS]
        outputs += [(phase_new_rows(kind, "coda"), f32, (d.coda_layers, 2, None, d.kv_heads, 1, d.head_dim))
                    for kind in KV_KINDS]
    return inputs, outputs + [(new_rows(kind), f32, rows) for kind in KV_KINDS]


def program_io(program: str, d: Dims) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of one program (PROGRAMS, or its fused variant)."""
    base = program.removesuffix(FUSED_SUFFIX)
    if base not in PROGRAMS:
        raise ArtifactError(f"program {program!r} is not part of the artifact contract (known: {', '.join(PROGRAMS)})")
    inputs, outputs = _prefill_io(d) if base == PREFILL else _batch_step_io(d)
    if base == program:
        return inputs, outputs
    if base == BATCH_STEP:  # one pool buffer per stage layer instead of P slabs; bubbles skipped
        inputs = [spec for spec in inputs if not is_cache_input(spec[0])] + [(COMPUTED_ROWS, "int64", (None,))]
        inputs += [(pool_input(kind, j), "float32", (None, d.kv_heads, None, d.head_dim))
                   for j in range(d.stage_layers) for kind in KV_KINDS]
    caches = [spec for spec in inputs if is_cache_input(spec[0])]
    outputs = [spec for spec in outputs if not spec[0].startswith("new_")]
    return inputs, outputs + [(in_place_output(name), dtype, shape) for name, dtype, shape in caches]


def engine_programs(graph: str, slots: int) -> tuple[str, ...]:
    """The programs engine graph GRAPH holds, in branch order (else, then): prefill, and the batch step when P > 1."""
    names = PROGRAMS if slots > 1 else PROGRAMS[:1]
    return tuple(name + variant(graph) for name in names)


def merged_shape(known, other) -> tuple:
    """Where two programs' shapes of one tensor (same rank) differ, the merged one is dynamic (None)."""
    return tuple(a if a == b else None for a, b in zip(known, other))


def merged_specs(sides: list[list[TensorSpec]]) -> list[TensorSpec]:
    """The union of several programs' tensors by name, in first-seen order: a name they share keeps its
    dtype and rank (ArtifactError otherwise) and takes None where their sizes differ."""
    merged: dict[str, TensorSpec] = {}
    for side in sides:
        for name, dtype, shape in side:
            if name not in merged:
                merged[name] = (name, dtype, tuple(shape))
                continue
            _, known_dtype, known_shape = merged[name]
            if known_dtype != dtype or len(known_shape) != len(shape):
                raise ArtifactError(f"tensor {name} is {known_dtype} {list(known_shape)} in one program and {dtype} "
                                    f"{list(shape)} in another")
            merged[name] = (name, dtype, merged_shape(known_shape, shape))
    return list(merged.values())


def expected_io(graph: str, d: Dims) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) the runtime expects of GRAPH (an engine graph of GRAPHS)."""
    if graph not in GRAPHS:
        raise ArtifactError(f"graph {graph!r} is not part of the artifact contract (known: {', '.join(GRAPHS)})")
    ios = [program_io(program, d) for program in engine_programs(graph, d.slots)]
    selector = [(RUN_STEP, "bool", ())] if len(ios) > 1 else []
    return selector + merged_specs([i for i, _ in ios]), merged_specs([o for _, o in ios])


def _check_side(graph: str, side: str, expected: list[TensorSpec], recorded: list[dict]) -> None:
    found = {t["name"]: t for t in recorded}
    for name, dtype, shape in expected:
        tensor = found.pop(name, None)
        if tensor is None:
            raise ArtifactError(f"graph {graph}: {side} {name} is missing")
        if tensor["dtype"] != dtype:
            raise ArtifactError(f"graph {graph}: {side} {name} is {tensor['dtype']}, expected {dtype}")
        dims = tensor["shape"]
        if len(dims) != len(shape) or any(w is not None and isinstance(g, int) and g != w for g, w in zip(dims, shape)):
            wanted = ["*" if w is None else w for w in shape]
            raise ArtifactError(f"graph {graph}: {side} {name} has shape {dims}, expected {wanted}")
    if found:
        raise ArtifactError(f"graph {graph}: unexpected {side} {next(iter(found))}")


def check_graph_io(graph: str, spec: dict, dims: Dims) -> None:
    """One-line ArtifactError unless SPEC (a manifest's `graphs` entry) matches the contract."""
    inputs, outputs = expected_io(graph, dims)
    _check_side(graph, "input", inputs, spec.get("inputs", []))
    _check_side(graph, "output", outputs, spec.get("outputs", []))
