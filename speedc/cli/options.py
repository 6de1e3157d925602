"""Click options several commands share, defined once."""

from __future__ import annotations

import math

import click


def given_options(*names: str) -> list[str]:
    """Of the current command's parameters NAMES, those the user set (on the command line or through the
    environment; not a default, a default_map or ctx.invoke), in order: a command that refuses options it
    would not use asks this."""
    source = click.get_current_context().get_parameter_source
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return [name for name in names if source(name) in given]


def flag(name: str) -> str:
    """A parameter's name as its option: max_batch -> --max-batch."""
    return "--" + name.replace("_", "-")


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


def backend_option(fn):
    """--backend: which runtime backend runs the artifact (choices from the runtime's registry)."""
    from speedc.runtimes.engine import BACKENDS, DEFAULT_BACKEND

    described = "; ".join(f"{name}: {entry.help}" for name, entry in BACKENDS.items())
    return click.option("--backend", type=click.Choice(list(BACKENDS)), default=DEFAULT_BACKEND, show_default=True,
                        help=described + ".")(fn)


def device_option(fn):
    return click.option("--device", default="cpu", show_default=True,
                        help="cpu, cuda or cuda:N (torch, or onnx with onnxruntime-gpu).")(fn)


def threads_option(fn):
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="Intra-op threads (default: one per physical core this process may use).")(fn)


def compile_option(fn):
    return click.option("--compile", "compile_step", is_flag=True,
                        help="--backend torch: run each step through torch.compile (one compile per step shape on "
                             "first use, seconds to minutes; the KV cache is allocated at its full length).")(fn)


def kv_cache_option(fn):
    from speedc.runtimes.kernels.native import KV_CACHES

    return click.option("--kv-cache", type=click.Choice(list(KV_CACHES)), default=None,
                        help="The KV cache's values where speedc's kernel attends (the fused graphs of int8, int4 and "
                             "16-bit artifacts): float16 (the default there), int8 (half its memory and reads, each 32 "
                             "values scaled together; the outputs move slightly, SPEED still equals plain decoding) or "
                             "float32. Elsewhere the cache is float32. Default: $SPEEDC_KV_CACHE, else float16 where "
                             "the kernel attends.")(fn)


def backend_options(fn):
    """--backend, --device, --threads, --kv-cache: how an artifact is run."""
    return backend_option(device_option(threads_option(kv_cache_option(fn))))
