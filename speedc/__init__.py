"""speedc: compile shared-weight transformer decoders into SPEED pipelined speculative engines.

`from speedc import Engine` is the runtime entry point; it is imported lazily so that importing
speedc costs nothing and never pulls in torch or the compiler.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from speedc.runtimes.engine import Engine

        return Engine
    raise AttributeError(f"module 'speedc' has no attribute {name!r}")
