"""Pass `trt_lint` (phase finalize): fail a `--target trt` build on ops TensorRT cannot parse.

The table is the ONNX-TensorRT parser's operator support matrix (onnx-tensorrt docs/operators.md,
TensorRT 8.4 edition: the oldest parser we target, so a graph that passes here parses on newer ones).
It runs on CPU, so CI catches a graph change TensorRT would reject without needing a GPU.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.errors import BuildError
from speedc.passes.base import CompileState, register_pass

TRT_SUPPORTED_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil Celu
Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div
Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gemm
GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GRU HardSigmoid Identity If ImageScaler
InstanceNormalization IsNaN LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool
MatMul Max MaxPool Mean Min Mul Neg NonMaxSuppression Not Or Pad ParametricSoftplus Pow PRelu QuantizeLinear
RandomUniform RandomUniformLike Range ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN Round ScaledTanh Scan
Scatter ScatterElements ScatterND Selu Shape Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign
SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Unsqueeze Upsample
Where Xor
""".split())

# Inputs the parser needs as initializers / constants (op -> input index).
TRT_CONSTANT_INPUTS = {"Slice": [3], "Squeeze": [1], "Unsqueeze": [1], "TopK": [1], "ReduceSum": [1]}


def lint_graph(graph: gs.Graph) -> list[str]:
    problems = []
    for node in graph.nodes:
        if node.op not in TRT_SUPPORTED_OPS:
            problems.append(f"{node.op} ({node.name}) is not supported by the TensorRT ONNX parser")
            continue
        for index in TRT_CONSTANT_INPUTS.get(node.op, []):
            if index < len(node.inputs) and not isinstance(node.inputs[index], gs.Constant):
                problems.append(f"{node.op} ({node.name}) input {index} must be a constant for TensorRT")
    return problems


@register_pass("trt_lint", phase="finalize", requires=("programs",))
def trt_lint(state: CompileState) -> CompileState:
    """Check every graph against TensorRT's ONNX operator matrix; fatal only for --target trt."""
    problems = [f"{name}: {p}" for name, graph in state.graphs.items() if not name.endswith(contract.FUSED_SUFFIX)  # ORT-only
                for p in lint_graph(graph)]
    if problems and state.options.target == "trt":
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BuildError(f"TensorRT lint: {problems[0]}{more}")
    state.notes.append(f"trt_lint: {len(problems)} problems" + (f" (first: {problems[0]})" if problems else ""))
    return state
