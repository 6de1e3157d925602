"""The weight-streaming floor of a step: the same weight products as the artifact's graphs, and
nothing else (no attention, norms, rotary, elementwise ops, cache), timed like the real step.

    floor step:   x [P, H] -> blocks once -> head on 2 rows    (a SPEED step: each weight read once)
    floor token:  x [1, H] -> blocks P times -> head on 1 row   (a plain token: each weight read P times)
    floor c(P) = floor step / (floor token / P)

A block is its four weight products as the compiled graphs run them (fused q/k/v and gate/up, weights
[out, in] under Gemm transB=1, fp32). Measured in the same run as the step's c(P), the gap between the
two is what the rest of the step costs: whatever the graphs do besides streaming weights.
"""

from __future__ import annotations

import numpy as np

from speedc.bench.run import interleaved_medians

WEIGHT_SCALE = 0.02


def block_products(shape) -> list[tuple[int, int, int]]:
    """(input width, output width, columns passed on) of one block's weight products, in order:
    q/k/v stacked, o, gate/up stacked, down. The next product reads the first `columns passed on`."""
    attention = shape.heads * shape.head_dim
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return [(shape.hidden, qkv, attention), (attention, shape.hidden, shape.hidden),
            (shape.hidden, 2 * shape.intermediate, shape.intermediate), (shape.intermediate, shape.hidden, shape.hidden)]


def floor_graph(shape, layers: int, passes: int, head_rows: int, seed: int = 0):
    """(ONNX model, {weight name: fp32 array}): x [rows, H] through LAYERS random blocks PASSES times,
    then the LM head on the first HEAD_ROWS rows. Passes share the blocks' weights, as the plain
    graph's loops do. The weights stay outside the model (declared external, handed to the session
    in memory): a real shape's fp32 weights exceed protobuf's 2 GB.

        x -> Gemm(qkv) -> Slice(:attn) -> Gemm(o) -> Gemm(gate_up) -> Slice(:I) -> Gemm(down) -> ... -> Slice(rows) -> Gemm(head)
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for index, (width_in, width_out, _) in enumerate(block_products(shape)):
            weights[f"w{layer}.{index}"] = rng.standard_normal((width_out, width_in), dtype=np.float32) * np.float32(WEIGHT_SCALE)
    weights["head"] = rng.standard_normal((shape.vocab, shape.hidden), dtype=np.float32) * np.float32(WEIGHT_SCALE)
    constants = {}

    def constant(value: int) -> str:
        return constants.setdefault(value, f"const.{value}")

    nodes, current = [], "x"
    for loop in range(passes):
        for layer in range(layers):
            for index, (_, _, passed_on) in enumerate(block_products(shape)):
                name = f"p{loop}.l{layer}.{index}"
                nodes.append(helper.make_node("Gemm", [current, f"w{layer}.{index}"], [name], transB=1))  # [rows, out]
                # the next product reads the first `passed_on` columns (q of q/k/v, gate of gate/up)
                nodes.append(helper.make_node("Slice", [name, constant(0), constant(passed_on), constant(1)], [f"{name}.cols"]))
                current = f"{name}.cols"  # [rows, passed_on]
    nodes.append(helper.make_node("Slice", [current, constant(0), constant(head_rows), constant(0)], ["head_in"]))
    nodes.append(helper.make_node("Gemm", ["head_in", "head"], ["logits"], transB=1))  # [head_rows, V]
    initializers = [numpy_helper.from_array(np.asarray([value], np.int64), name) for value, name in constants.items()]
    for name, array in weights.items():
        declared = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape, data_location=TensorProto.EXTERNAL)
        declared.external_data.add(key="location", value="in-memory")
        initializers.append(declared)
    graph = helper.make_graph(nodes, "weight_floor", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", shape.hidden])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def _session(model_and_weights, threads: int | None):
    import onnxruntime as ort

    from speedc.runtimes.backends.onnx_session import session_options

    model, weights = model_and_weights
    options = session_options(threads, spin_between_runs=False)  # the two floor sessions run in turns
    options.add_external_initializers(list(weights), [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measure_floor(shape, layers: int, slots: int, *, threads: int | None = None, repeats: int = 50) -> dict:
    """{floor_step_cost, floor_step_ms, floor_token_ms} for SLOTS = P: interleaved medians."""
    step_session = _session(floor_graph(shape, layers, 1, head_rows=min(2, slots)), threads)
    token_session = _session(floor_graph(shape, layers, slots, head_rows=1), threads)
    step_x = {"x": np.ones((slots, shape.hidden), np.float32)}
    token_x = {"x": np.ones((1, shape.hidden), np.float32)}
    step, token = interleaved_medians(lambda: step_session.run(None, step_x), lambda: token_session.run(None, token_x),
                                      repeats, warmup=3)
    return {"floor_step_cost": round(step / (token / slots), 3), "floor_step_ms": round(1000 * step, 3),
            "floor_token_ms": round(1000 * token, 3)}
