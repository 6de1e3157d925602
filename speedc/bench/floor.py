"""The weight-streaming floor of a step: the same weight products as the artifact's graphs, and
nothing else (no attention, norms, rotary, elementwise ops, cache), timed like the real step.

    floor step:   x [P, H] -> blocks once -> head on 2 rows    (a SPEED step: each weight read once)
    floor token:  x [1, H] -> blocks P times -> head on 1 row   (a plain token: each weight read P times)
    (a recurrent core of R repeats: the step passes R / P times over the core, the token R times)
    floor c(P) = floor step / (floor token / P)

A block is its four weight products as the compiled graphs run them (fused q/k/v and gate/up, weights
[out, in]): Gemm transB=1 in fp32 for a float artifact (ONNX Runtime widens 16-bit weights to fp32 at
load), MatMulNBits at the artifact's bits (block 32, accuracy level 4) for a quantized one, int4 with
the zero row the artifact's graphs append (passes/quantize_weights.py). Measured in the same run as
the step's c(P), the gap between the two is what the rest of the step costs: whatever the graphs do
besides streaming weights. The two floor sessions share one copy of the weights.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from speedc.step_timer import interleaved_medians

WEIGHT_SCALE = 0.02
QUANTIZED_BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE, ACCURACY_LEVEL = 32, 4  # what `speedc build --weights int4|int8` writes (passes/block_quant.py)
PAD_ROW_BITS = (4,)  # the artifact's int4 products run one extra zero row (passes/quantize_weights.py ROW_PAD_BITS)


@dataclass
class FloorWeights:
    """The random weights of a floor: name -> fp32 [out, in], or codes and scales at BITS."""
    bits: int | None  # None: fp32 Gemm
    arrays: dict[str, np.ndarray]  # every initializer, by name
    products: dict[str, tuple[int, int]]  # weight name -> (out, in)

    @property
    def pad_rows(self) -> int:
        return 1 if self.bits in PAD_ROW_BITS else 0


def block_products(shape) -> list[tuple[int, int, int]]:
    """(input width, output width, columns passed on) of one block's weight products, in order:
    q/k/v stacked, o, gate/up stacked, down. The next product reads the first `columns passed on`."""
    attention = shape.heads * shape.head_dim
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return [(shape.hidden, qkv, attention), (attention, shape.hidden, shape.hidden),
            (shape.hidden, (2 if shape.gated_mlp else 1) * shape.intermediate, shape.intermediate),
            (shape.intermediate, shape.hidden, shape.hidden)]


def floor_weights(shape, layers: int, weights: str | None = None, seed: int = 0) -> FloorWeights:
    """Random N(0, WEIGHT_SCALE) weights for LAYERS blocks and the LM head, fp32 or quantized as WEIGHTS
    (the artifact's storage: "int4" / "int8" quantized, anything else fp32), a matrix at a time."""
    from speedc.passes.block_quant import quantize_rows

    bits = QUANTIZED_BITS.get(weights or "")
    rng = np.random.default_rng(seed)
    arrays, products = {}, {}
    names = [(f"w{layer}.{index}", width_out, width_in) for layer in range(layers)
             for index, (width_in, width_out, _) in enumerate(block_products(shape))]
    for name, rows, columns in [*names, ("head", shape.vocab, shape.hidden)]:
        matrix = rng.standard_normal((rows, columns), dtype=np.float32) * np.float32(WEIGHT_SCALE)
        products[name] = (rows, columns)
        if bits is None:
            arrays[name] = matrix
        else:
            arrays[f"{name}.codes"], arrays[f"{name}.scales"] = quantize_rows(matrix, bits, BLOCK_SIZE)
    return FloorWeights(bits, arrays, products)


def floor_graph(shape, layers: int, passes: int, head_rows: int, weights: FloorWeights):
    """The ONNX model: x [rows, H] through LAYERS blocks PASSES times, then the LM head on the first
    HEAD_ROWS rows (0: no head, the blocks' products alone, no zero row). Passes share the blocks' weights, as the plain graph's loops do. The weights stay
    outside the model (declared external, handed to the session in memory): a real shape's fp32
    weights exceed protobuf's 2 GB.

        x -> W(qkv) -> Slice(:attn) -> W(o) -> W(gate_up) -> Slice(:I) -> W(down) -> ... -> Slice(rows) -> W(head)
        W: Gemm(transB=1) over [out, in] fp32, or MatMulNBits over its codes and scales
    """
    from onnx import TensorProto, helper, numpy_helper

    constants = {}

    def constant(value: int) -> str:
        return constants.setdefault(value, f"const.{value}")

    def product(source: str, weight: str, out: str):
        if weights.bits is None:
            return helper.make_node("Gemm", [source, weight], [out], transB=1)  # [rows, out]
        rows, columns = weights.products[weight]
        return helper.make_node("MatMulNBits", [source, f"{weight}.codes", f"{weight}.scales"], [out], domain="com.microsoft",
                                K=columns, N=rows, bits=weights.bits, block_size=BLOCK_SIZE, accuracy_level=ACCURACY_LEVEL)

    nodes, current = [], "x"
    for loop in range(passes):
        for layer in range(layers):
            for index, (_, _, passed_on) in enumerate(block_products(shape)):
                name = f"p{loop}.l{layer}.{index}"
                nodes.append(product(current, f"w{layer}.{index}", name))
                # the next product reads the first `passed_on` columns (q of q/k/v, gate of gate/up)
                nodes.append(helper.make_node("Slice", [name, constant(0), constant(passed_on), constant(1)], [f"{name}.cols"]))
                current = f"{name}.cols"  # [rows, passed_on]
    if head_rows:
        nodes.append(helper.make_node("Slice", [current, constant(0), constant(head_rows + weights.pad_rows), constant(0)],
                                      ["head_in"]))
        nodes.append(product("head_in", "head", "logits"))  # [head_rows (+ pad), V]
    else:
        nodes.append(helper.make_node("Identity", [current], ["logits"]))
    initializers = [numpy_helper.from_array(np.asarray([value], np.int64), name) for value, name in constants.items()]
    for name, array in weights.arrays.items():
        declared = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape,
                               data_location=TensorProto.EXTERNAL)
        declared.external_data.add(key="location", value="in-memory")
        initializers.append(declared)
    graph = helper.make_graph(nodes, "weight_floor", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", shape.hidden])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializers)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if weights.bits else [])
    return helper.make_model(graph, opset_imports=opsets)


def _session(model, weights: FloorWeights, threads: int | None):
    import onnxruntime as ort

    from speedc.format.artifact import IR_VERSION
    from speedc.runtimes.backends.onnx_session import session_options

    model.ir_version = min(model.ir_version, IR_VERSION)
    options = session_options(threads, spin_between_runs=False)  # the two floor sessions run in turns
    options.add_external_initializers(list(weights.arrays),
                                      [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.arrays.values()])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measure_floor(shape, layers: int, slots: int, *, weights: str | None = None, threads: int | None = None,
                  repeats: int = 50, step_passes: int = 1) -> dict:
    """{floor_step_cost, floor_step_ms, floor_token_ms} for SLOTS = P at the artifact's WEIGHTS storage:
    interleaved medians. STEP_PASSES: passes over the LAYERS blocks a step makes (a recurrent core's
    R / P repeats per slot; a token then makes P times as many)."""
    floor = floor_weights(shape, layers, weights)
    step_session = _session(floor_graph(shape, layers, step_passes, head_rows=min(2, slots), weights=floor), floor, threads)
    token_session = _session(floor_graph(shape, layers, slots * step_passes, head_rows=1, weights=floor), floor, threads)
    step_x = {"x": np.ones((slots + floor.pad_rows, shape.hidden), np.float32)}
    token_x = {"x": np.ones((1 + floor.pad_rows, shape.hidden), np.float32)}
    step, token = interleaved_medians(lambda: step_session.run(None, step_x), lambda: token_session.run(None, token_x),
                                      repeats=repeats, warmup=3)
    return {"floor_step_cost": round(step / (token / slots), 3), "floor_step_ms": round(1000 * step, 3),
            "floor_token_ms": round(1000 * token, 3), "floor_weights": "fp32" if floor.bits is None else f"int{floor.bits}"}


KERNEL_ROWS = (1, 2, 4, 8)


@contextlib.contextmanager
def byte_stream(arrays: list[np.ndarray], threads: int = 1):
    """A function reading every 8-byte word of ARRAYS (C-contiguous) once on THREADS threads, each array
    split in THREADS parts as the kernel splits a product's work (the caller's thread one of them), and
    returning their sum modulo 2^64, a checksum so no read is skipped: the time the weights take to
    stream from memory, the floor a product's 1-row time is measured against. numpy's sums release the
    GIL, so the parts run in parallel; the worker threads live as long as the context."""
    words = [np.frombuffer(a, np.uint64, count=a.nbytes // 8) for a in arrays]  # views: nothing copied
    parts = [[w[len(w) * part // threads:len(w) * (part + 1) // threads] for w in words] for part in range(threads)]

    def read(part: list[np.ndarray]) -> int:
        return sum(int(np.add.reduce(view)) for view in part)  # an array's sum wraps at 2^64 silently

    with ThreadPoolExecutor(max(1, threads - 1)) as pool:
        def stream() -> int:
            others = [pool.submit(read, part) for part in parts[1:]]
            return (read(parts[0]) + sum(other.result() for other in others)) % 2 ** 64

        yield stream


def measure_kernel(shape, layers: int, *, weights: str, threads: int | None = None, repeats: int = 20) -> dict:
    """speedc's own product kernel (runtimes/kernels/) over the floor's block products at WEIGHTS (int4 /
    int8): ms for 1, 2, 4 and 8 rows, c(rows) against one row, on each vector path this CPU runs
    (`paths`; the top-level fields are the path the runtime takes, `kernel`), beside the same products
    on ONNX Runtime's MatMulNBits (no zero row: its own 1-row kernel) and the memory floor, the time to
    read the same weight bytes once (`stream_ms`, byte_stream); interleaved medians, all in one run. {"kernel": None,
    "why": ...} where the kernel is not available here."""
    from speedc.runtimes.backends.protocol import resolve_threads
    from speedc.runtimes.kernels import native

    kernel = native.load()
    if kernel is None:
        return {"kernel": None, "why": native.unavailable_reason()}
    floor = floor_weights(shape, layers, weights)
    threads = resolve_threads(threads)
    chain = [(floor.arrays[f"{name}.codes"], floor.arrays[f"{name}.scales"], n, k)
             for name, (n, k) in floor.products.items() if name != "head"]
    rng = np.random.default_rng(1)
    inputs = {(rows, k): rng.standard_normal((rows, k), dtype=np.float32) for rows in KERNEL_ROWS for _, _, _, k in chain}
    outputs = {(rows, n): np.empty((rows, n), np.float32) for rows in KERNEL_ROWS for _, _, n, _ in chain}

    # the paths a CPU would run: the portable one only where it has no other, never the AVX2 stand-in
    paths = [p for p in kernel.paths if p not in ("portable", *native.STAND_INS)] or ["portable"]
    bound = {path: [(kernel.bound(codes, scales, n=n, k=k, bits=floor.bits, block_size=BLOCK_SIZE, threads=threads,
                                  path=path), n, k) for codes, scales, n, k in chain]
             for path in paths}  # each weight prepared once, as a session's operator does

    def products(path: str, rows: int):
        for product, n, k in bound[path]:
            product(inputs[rows, k], outputs[rows, n])

    arrays = [a for codes, scales, _, _ in chain for a in (codes, scales)]
    blocks = FloorWeights(floor.bits, {name: array for name, array in floor.arrays.items() if not name.startswith("head.")},
                          floor.products)
    ort_chain = _session(floor_graph(shape, layers, 1, 0, blocks), blocks, threads)
    ort_inputs = {rows: {"x": inputs[rows, shape.hidden]} for rows in KERNEL_ROWS}
    runs = {(path, rows): (lambda path=path, rows=rows: products(path, rows)) for path in paths for rows in KERNEL_ROWS}
    runs.update({("MatMulNBits", rows): (lambda rows=rows: ort_chain.run(None, ort_inputs[rows])) for rows in KERNEL_ROWS})
    with byte_stream(arrays, threads) as stream:
        runs["stream"] = stream
        times = interleaved_medians(*runs.values(), repeats=repeats, warmup=2)
    ms = dict(zip(runs, (1000 * t for t in times)))
    by_path = {path: {"rows_ms": {str(rows): round(ms[path, rows], 3) for rows in KERNEL_ROWS},
                      "cost": {str(rows): round(ms[path, rows] / ms[path, 1], 3) for rows in KERNEL_ROWS[1:]},
                      "one_row_vs_stream": round(ms["stream"] / ms[path, 1], 3)} for path in paths}
    return {"kernel": kernel.path, "threads": threads, "weight_mb": round(sum(a.nbytes for a in arrays) / 1e6, 1),
            "stream_ms": round(ms["stream"], 3), **by_path[kernel.path], "paths": by_path,
            "matmulnbits_rows_ms": {str(rows): round(ms["MatMulNBits", rows], 3) for rows in KERNEL_ROWS},
            "matmulnbits_cost": {str(rows): round(ms["MatMulNBits", rows] / ms["MatMulNBits", 1], 3) for rows in KERNEL_ROWS[1:]}}
