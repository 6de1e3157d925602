"""The quantize_weights pass and its packing, checked against ONNX Runtime itself.

    before:  x ── Gemm(W, transB=1) ── y          ids ── Gather(E) ── rows        (E = W: a tied head)
    after:   x ── [Concat 0-row] ── MatMulNBits(W.q4, W.q4_scales) ── [Slice] ── y
             ids ── GatherBlockQuantized(W.q4, W.q4_scales.rows) ── Reshape ── rows
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from speedc.format.artifact import dequantize_blocks
from speedc.passes.base import BuildOptions, CompileState
from speedc.passes.block_quant import quantize_rows
from speedc.passes.quantize_weights import quantize_graph, Quantizer

ORT_QUANTIZERS = {4: quantize_matmul_4bits, 8: quantize_matmul_8bits}
SHAPES = [(40, 64, 32), (33, 48, 32), (64, 384, 32), (16, 100, 16), (8, 256, 128)]  # (N, K, block): some K padded


def _session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)
    w[0, :16] = 0  # an all-zero block: scale 0, codes at the zero point
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,block", SHAPES)
def test_packing_is_onnxruntime_quantizers_byte_for_byte(bits, n, k, block):
    """Our codes and scales equal ONNX Runtime's own symmetric quantizer's (the layout MatMulNBits
    reads: [N, n_blocks, blob], low nibble first). Where K is padded, ORT leaves the padding bytes
    unwritten; we fill them with the zero point, so only real K positions are compared."""
    w = _weight(n, k, seed=n + k)
    n_blocks = -(-k // block)
    theirs = np.zeros((n, n_blocks, block * bits // 8), np.uint8)
    their_scales = np.zeros((n, n_blocks), np.float32)
    ORT_QUANTIZERS[bits](theirs, np.ascontiguousarray(w.T), their_scales, np.zeros((n, n_blocks), np.uint8), block, n, k, True)
    ours, our_scales = quantize_rows(w, bits, block)
    assert ours.shape == theirs.shape and our_scales.shape == their_scales.shape
    np.testing.assert_array_equal(our_scales, their_scales)
    unpack = (lambda c: np.stack([c & 15, c >> 4], -1).reshape(n, -1)) if bits == 4 else (lambda c: c.reshape(n, -1))
    np.testing.assert_array_equal(unpack(ours)[:, :k], unpack(theirs)[:, :k])
    # Dequantized error: half a step, or one step where the block's largest value of the other sign clips at the top code.
    step = np.repeat(np.abs(our_scales), block, axis=1)[:, :k]
    assert np.all(np.abs(dequantize_blocks(ours, our_scales, bits, k) - w) <= step * 1.0001 + 1e-12)


def _matmul_nbits(n: int, k: int, bits: int, block: int, codes, scales, level: int) -> onnx.ModelProto:
    node = onnx.helper.make_node("MatMulNBits", ["x", "B", "scales"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                 block_size=block, accuracy_level=level)
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", n])],
                                   [onnx.numpy_helper.from_array(codes, "B"), onnx.numpy_helper.from_array(scales, "scales")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,block", [(64, 384, 32), (33, 48, 32), (16, 100, 16)])
def test_matmul_nbits_computes_the_dequantized_product(bits, n, k, block):
    """ORT's MatMulNBits over our tensors vs numpy x @ dequant(W).T: at accuracy level 0 (fp32 compute)
    to float rounding (rtol 1e-5 of the output scale); at level 4 (int8 activations, what we build) within
    the bound activation rounding allows: per block, half an int8 step of the row's block maximum times
    the block's sum of |w|."""
    w = _weight(n, k, seed=7)
    codes, scales = quantize_rows(w, bits, block)
    deq = dequantize_blocks(codes, scales, bits, k)  # [N, K]
    x = np.random.default_rng(8).standard_normal((5, k)).astype(np.float32)
    reference = x.astype(np.float64) @ deq.T.astype(np.float64)  # [5, N]
    exact = _session(_matmul_nbits(n, k, bits, block, codes, scales, level=0)).run(None, {"x": x})[0]
    np.testing.assert_allclose(exact, reference, rtol=0, atol=1e-5 * np.abs(reference).max())
    int8 = _session(_matmul_nbits(n, k, bits, block, codes, scales, level=4)).run(None, {"x": x})[0]
    n_blocks = -(-k // block)
    xb = np.zeros((5, n_blocks * block)); xb[:, :k] = np.abs(x)
    wb = np.zeros((n, n_blocks * block)); wb[:, :k] = np.abs(deq)
    half_step = xb.reshape(5, n_blocks, block).max(-1) / 127 / 2  # [5, nb]
    bound = half_step @ wb.reshape(n, n_blocks, block).sum(-1).T  # [5, N]
    assert np.all(np.abs(int8 - reference) <= bound * 1.001 + 1e-5), np.abs(int8 - reference).max()
    assert not np.array_equal(int8, exact)  # level 4 really quantizes the activations


def _tied_graph(v: int, h: int) -> tuple[gs.Graph, np.ndarray]:
    """ids [1, L] -> Gather(E) -> rows [1, L, H] -> Reshape [L, H] -> Gemm(E, transB=1) -> logits [L, V]."""
    e = np.random.default_rng(3).standard_normal((v, h)).astype(np.float32)
    ids = gs.Variable("ids", dtype=np.int64, shape=[1, "L"])
    table = gs.Constant("model.embed_tokens.weight", e)
    rows, flat, logits = gs.Variable("rows", dtype=np.float32), gs.Variable("flat", dtype=np.float32), \
        gs.Variable("logits", dtype=np.float32, shape=["L", v])
    nodes = [gs.Node("Gather", "embed", inputs=[table, ids], outputs=[rows]),
             gs.Node("Reshape", "flat", inputs=[rows, gs.Constant("shape", np.array([-1, h], np.int64))], outputs=[flat]),
             gs.Node("Gemm", "head", attrs={"transB": 1}, inputs=[flat, table], outputs=[logits])]
    return gs.Graph(nodes=nodes, inputs=[ids], outputs=[logits, rows], opset=17), e


@pytest.mark.parametrize("dtype,head,h", [("int4", None, 64), ("int4", None, 48), ("int8", None, 64), ("int4", "int8", 64)])
def test_pass_rewrites_gemm_and_gather_over_one_quantized_copy(dtype, head, h):
    graph, e = _tied_graph(v=50, h=h)
    before = sorted(node.op for node in graph.nodes)
    state = CompileState(cfg=None, weights={}, options=BuildOptions(dtype=dtype, head_dtype=head))
    quantize_graph(graph, Quantizer(state))
    after = sorted(node.op for node in graph.nodes)
    assert before == ["Gather", "Gemm", "Reshape"]
    dtype = head or dtype  # the only weight here is the embedding / LM head
    expected = ["GatherBlockQuantized", "MatMulNBits", "Reshape", "Reshape"] + (["Concat", "Slice"] if dtype == "int4" else [])
    expected += ["Slice"] if h % 32 else []  # rows padded to whole blocks are cut back to H
    assert after == sorted(expected)
    constants = {t.name for t in graph.tensors().values() if isinstance(t, gs.Constant) and t.name.startswith("model.")}
    suffix = ".q4" if dtype == "int4" else ".q8"
    assert constants == {f"model.embed_tokens.weight{suffix}", f"model.embed_tokens.weight{suffix}_scales",
                         f"model.embed_tokens.weight{suffix}_scales.rows"}  # one codes tensor for embedding and head
    session = _session(gs.export_onnx(graph))
    ids = np.array([[3, 0, 49, 7]], np.int64)
    logits, rows = session.run(None, {"ids": ids})
    bits = 4 if dtype == "int4" else 8
    deq = dequantize_blocks(*quantize_rows(e, bits, 32), bits, h)
    np.testing.assert_array_equal(rows[0], deq[ids[0]])  # GatherBlockQuantized: the dequantized rows, exactly
    reference = deq[ids[0]].astype(np.float64) @ deq.T
    np.testing.assert_allclose(logits, reference, rtol=0, atol=0.02 * np.abs(reference).max())  # int8 activations
    assert np.abs(logits - e[ids[0]] @ e.T).max() > 0  # the quantized model, not the float one


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_quantized_products_are_row_invariant(dtype):
    """What SPEED's losslessness needs: a row computed among M rows (a step) is bitwise the row computed
    alone (plain decoding), for M = 1..9 and 1 or 2 threads. At int4 the pass's zero row provides it."""
    graph, _ = _tied_graph(v=300, h=128)
    quantize_graph(graph, Quantizer(CompileState(cfg=None, weights={}, options=BuildOptions(dtype=dtype))))
    model = gs.export_onnx(graph)
    ids = np.random.default_rng(0).integers(0, 300, (1, 9))
    for threads in (1, 2):
        session = _session(model, threads)
        together = session.run(["logits"], {"ids": ids})[0]
        for m in range(1, 10):
            np.testing.assert_array_equal(session.run(["logits"], {"ids": ids[:, :m]})[0], together[:m])
