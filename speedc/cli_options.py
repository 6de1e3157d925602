"""Click options several commands share, defined once."""

from __future__ import annotations

import click


def backend_options(fn):
    """--backend, --device, --threads: how an artifact is run (choices from the runtime's registry)."""
    from speedc.runtimes.engine import BACKENDS, DEFAULT_BACKEND

    described = "; ".join(f"{name}: {entry.help}" for name, entry in BACKENDS.items())
    options = [
        click.option("--backend", type=click.Choice(list(BACKENDS)), default=DEFAULT_BACKEND, show_default=True,
                     help=described + "."),
        click.option("--device", default="cpu", show_default=True,
                     help="cpu, cuda or cuda:N (torch, or onnx with onnxruntime-gpu)."),
        click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn
