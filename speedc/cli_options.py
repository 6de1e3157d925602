"""Click options several commands share, defined once."""

from __future__ import annotations

import math

import click


# Where an option's value counts as the user's (ctx.get_parameter_source): a command that refuses an option it
# would ignore asks this, not "not the default" (ctx.invoke passes None, a default_map sets values).
GIVEN = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)


class FiniteFloat(click.FloatRange):
    """A float option that refuses nan and inf (click's float and FloatRange take them: nan passes
    every range check, and a nan timeout or pool size failed far from the command line)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number

    def _describe_range(self) -> str:  # the help's range note (click's own says "x<=None" for no bounds)
        return "finite" if self.min is None and self.max is None else super()._describe_range()


def backend_options(fn):
    """--backend, --device, --threads: how an artifact is run (choices from the runtime's registry)."""
    from speedc.runtimes.engine import BACKENDS, DEFAULT_BACKEND

    described = "; ".join(f"{name}: {entry.help}" for name, entry in BACKENDS.items())
    options = [
        click.option("--backend", type=click.Choice(list(BACKENDS)), default=DEFAULT_BACKEND, show_default=True,
                     help=described + "."),
        click.option("--device", default="cpu", show_default=True,
                     help="cpu, cuda or cuda:N (torch, or onnx with onnxruntime-gpu)."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="Intra-op threads (default: all cores)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn
