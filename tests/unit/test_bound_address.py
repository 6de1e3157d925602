"""Buffers bound to ONNX Runtime by raw pointer (IO binding with an address) are checked first: ONNX
Runtime reads and writes that memory as a dense tensor of the bound dtype, knowing nothing of the numpy
array behind it. A strided view or another dtype is refused naming the tensor, and the binding keeps
each bound array alive (a temporary bound as an output would otherwise be freed, then written into)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from speedc.errors import SpeedcError
from speedc.runtimes.backends.onnx import StepBinding, pool_binding
from speedc.runtimes.backends.onnx_session import bound_address, onnxruntime_module


@pytest.fixture(scope="module")
def session():
    """y = x + 1 over float32 [2, 3]: a real session whose binding takes addresses."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "add_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    ort = onnxruntime_module()
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _bind(session, x: np.ndarray, y: np.ndarray):
    binding = session.io_binding()
    binding.bind_input("x", "cpu", 0, np.float32, [2, 3], bound_address(binding, "x", x, np.float32))
    binding.bind_output("y", "cpu", 0, np.float32, [2, 3], bound_address(binding, "y", y, np.float32))
    return binding


def test_a_non_contiguous_view_is_refused_by_name(session):
    wide = np.zeros((2, 6), np.float32)
    with pytest.raises(SpeedcError, match=r"^internal: cache\.key\.0 is bound by address but is not a C-contiguous array$"):
        bound_address(session.io_binding(), "cache.key.0", wide[:, ::2], np.float32)
    with pytest.raises(SpeedcError, match="internal: x is bound by address but is not a C-contiguous"):
        bound_address(session.io_binding(), "x", np.zeros((3, 2), np.float32).T, np.float32)  # Fortran order


def test_another_dtype_is_refused_by_name(session):
    with pytest.raises(SpeedcError, match=r"^internal: next_token is bound as int64 but the array holds int32$"):
        bound_address(session.io_binding(), "next_token", np.zeros(4, np.int32), np.int64)


def test_the_binding_keeps_a_bound_temporary_alive(session):
    """Before: y's only reference could be the caller's; dropped, its memory was freed while ONNX Runtime
    still held its address. Now the binding holds it until the binding itself goes."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    binding = _bind(session, x, np.zeros((2, 3), np.float32))  # y: a temporary
    (y,) = [a for a in vars(binding)["speedc_bound_arrays"].values() if a is not x]
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is not None  # held by the binding
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(alive(), x + 1)  # ONNX Runtime wrote into the array that was kept
    del binding
    gc.collect()
    assert alive() is None  # released with the binding


def test_rebinding_a_name_releases_the_array_bound_before(session):
    x = np.zeros((2, 3), np.float32)
    first, second = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    binding = _bind(session, x, first)
    old = weakref.ref(first)
    del first
    binding.bind_output("y", "cpu", 0, np.float32, [2, 3], bound_address(binding, "y", second, np.float32))
    gc.collect()
    assert old() is None


def test_pool_and_step_bindings_check_what_they_bind(session):
    """Every raw-pointer bind site of the batch backend goes through the check: a slab or step buffer
    that is not what it is bound as is refused naming it."""
    pool = np.zeros((2, 6), np.float32)
    with pytest.raises(SpeedcError, match="internal: x is bound by address but is not a C-contiguous"):
        pool_binding(session, {"x": pool[:, 1::2]})
    with pytest.raises(SpeedcError, match="internal: y is bound as float32 but the array holds float64"):
        StepBinding(session, {}, {"x": (np.zeros((2, 3), np.float32), np.float32, False),
                                  "y": (np.zeros((2, 3), np.float64), np.float32, True)})
    step = StepBinding(session, {}, {"x": (np.ones((2, 3), np.float32), np.float32, False),
                                     "y": (np.zeros((2, 3), np.float32), np.float32, True)})
    np.testing.assert_array_equal(step.run()["y"], np.full((2, 3), 2.0, np.float32))
