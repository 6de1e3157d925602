"""The speedc command line. Each command is a thin shell over a function that does the work;
user errors (SpeedcError) and missing optional dependencies print one line and exit 1, never a
traceback."""

from __future__ import annotations

import functools
import sys

import click

from speedc import __version__
from speedc.errors import SpeedcError


# Import name -> the pyproject.toml extra that installs it. A runtime-only install (`pip install
# speedc`) lacks these, so a command that imports one fails with a ModuleNotFoundError; this table
# turns that into "install this extra". tests/e2e/test_runtime_only_install.py checks it against the
# extras in pyproject.toml, so the two cannot drift apart.
EXTRA_FOR_MODULE = {
    "torch": "compiler", "onnx": "compiler", "onnx_graphsurgeon": "compiler", "safetensors": "compiler",
    "onnxruntime_genai": "bench", "onnx_ir": "bench", "matplotlib": "bench",
    "tensorrt": "trt",
    "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "jinja2": "serve", "llguidance": "serve",
    "ray": "ray",
    "llama_cpp": "peers", "gguf": "peers",
    "onnxruntime_extensions": "native",
    "transformers": "dev", "pytest": "dev", "xdist": "dev", "hypothesis": "dev", "openai": "dev", "httpx": "dev",
    "jsonschema": "dev", "lm_eval": "dev", "accelerate": "dev",
}


def missing_module_message(command: str, err: ModuleNotFoundError) -> str:
    """One line for a module that is not installed: which extra brings it, when we know."""
    if not err.name:  # raised by hand, without a module name: its message is all we have
        return f"{command}: {err}"
    top = err.name.split(".")[0]
    extra = EXTRA_FOR_MODULE.get(top)
    if extra is None:
        return f"{command} needs the Python module {err.name}, which is not installed"
    return f"{command} needs the {extra} extra ({top} is not installed): pip install 'speedc[{extra}]'"


def user_errors(fn):
    """Turn SpeedcError into `error: ...` + exit 1, a missing optional dependency into the extra
    to install + exit 1; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpeedcError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(1)
        except ModuleNotFoundError as err:
            # Commands import their heavy dependencies lazily, so this is where an absent extra shows.
            click.echo(f"error: {missing_module_message(click.get_current_context().command_path, err)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted (work done so far is saved where the command saves it)", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="speedc")
def main() -> None:
    """speedc: compile shared-weight decoders into SPEED pipelined speculative engines."""


def _register_commands() -> None:
    # Each command lives in its own module under speedc/cli/*; importing them here keeps
    # `speedc --help` fast (heavy imports happen inside the commands).
    from speedc.cli import bench, build, generate, model, quality, serve

    for command in (model.train, build.build, build.inspect, generate.generate,
                    bench.bench, quality.quality, serve.serve):
        for runs in (command, *getattr(command, "commands", {}).values()):  # a group's subcommands too
            runs.callback = user_errors(runs.callback)
        main.add_command(command)


_register_commands()
