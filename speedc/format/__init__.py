"""speedc.format: what the compiler and the runtimes both read: the artifact format (artifact.py),
the compiler/runtime contract (contract.py) and the K/V cache layout (cache_layout.py).

Standard library and numpy only at import: no torch, no onnx."""
