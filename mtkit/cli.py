"""The ``mtkit`` command line: the application, its global options and its one-line usage errors.

The commands live in ``mtkit.commands``, one module per job; each parses its options, calls one library
function and renders. Data goes to stdout, chatter to stderr. A problem with the user's input (file,
config, checkpoint) is one line on stderr and exit status 1; anything else is a bug and keeps its
traceback. Torch is imported inside commands so that ``mtkit --help`` stays instant.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from mtkit.commands import data, doctor, evaluate, models, score, serve, train, translate
from mtkit.commands.common import LogLevel, set_log_level
from mtkit.version import __version__

# The base class of Click's usage errors: typer's own copy of Click, or Click itself for older typer.
_CLICK_ERROR = getattr(typer, "TyperException", None) or __import__("click").ClickException


class _OneLineErrors(TyperGroup):
    """Usage errors (``--beam abc``, a missing option) as one ``error:`` line, as every other error is."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _CLICK_ERROR as err:
            message = err.format_message()
            if "\n" in message.strip():  # the help text a bare command prints (no_args_is_help)
                err.show()
            else:
                ctx = getattr(err, "ctx", None)
                where = f"{ctx.command_path}: " if ctx is not None else ""
                hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
                typer.echo(f"error: {where}{message}{hint}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:  # an EOFError no command turned into an error of its own
            typer.echo("error: input ended unexpectedly", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    help="mtkit: train, run and score Transformer machine-translation models.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=True,
)
app.add_typer(data.tokenizer_commands, name="tokenizer")
app.add_typer(models.import_commands, name="import")
for module in (data, train, translate, score, models, evaluate, serve, doctor):
    app.add_typer(module.commands)  # unnamed: its commands join mtkit's own


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtkit {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only warnings and errors on stderr.")] = False,
    log_level: Annotated[LogLevel, typer.Option(help="How much to log on stderr.")] = "info",
) -> None:
    """mtkit: train, run and score Transformer machine-translation models."""
    set_log_level(logging.WARNING if quiet else getattr(logging, log_level.upper()))


def main() -> None:
    app(prog_name="mtkit")


if __name__ == "__main__":
    main()
