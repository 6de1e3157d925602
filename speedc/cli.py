"""The speedc command line. Each command is a thin shell over a function that does the work;
user errors (SpeedcError) print one line and exit 1, never a traceback."""

from __future__ import annotations

import functools
import sys

import click

from speedc import __version__
from speedc.errors import SpeedcError


def user_errors(fn):
    """Turn SpeedcError into `error: ...` + exit 1; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpeedcError as err:
            click.echo(f"error: {err}", err=True)
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
    # Each command lives in its own module under speedc/commands_*; importing them here keeps
    # `speedc --help` fast (heavy imports happen inside the commands).
    from speedc import commands_bench, commands_build, commands_generate, commands_model

    for command in (commands_model.train, commands_build.build, commands_build.inspect, commands_generate.generate,
                    commands_bench.bench):
        command.callback = user_errors(command.callback)
        main.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
