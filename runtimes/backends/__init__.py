"""speedc.runtimes.backends: the batch backends the scheduler drives: the protocol every backend
implements (protocol.py), ONNX Runtime (onnx.py, with its session plumbing in onnx_session.py) and
PyTorch (torch_backend.py). Importing the package imports no backend."""
