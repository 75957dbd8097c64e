"""What every command shares: its errors as one line, logging on stderr, --help examples, common options."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console

from mtkit.config import Engine, InferencePrecision
from mtkit.errors import MtkitError

stderr = Console(stderr=True)
log = logging.getLogger("mtkit")

LogLevel = Literal["debug", "info", "warning", "error"]
_log_level = logging.INFO  # set by the global options (set_log_level)

# Options several commands take, spelled and explained once.
ModelPath = Annotated[Path, typer.Argument(help="Run directory (uses best/), checkpoint directory or .safetensors.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
WeightPrecision = Annotated[
    InferencePrecision,
    typer.Option(
        "--precision",
        help="Number format of the weights; auto: bf16 where the device computes it natively, else fp32 "
        "(`mtkit doctor` says which); fp16 on GPU only; int8 (CPU): int8 weights and activations in the "
        "linear layers.",
    ),
]
EngineChoice = Annotated[
    Engine,
    typer.Option(
        "--engine",
        help="mtkit, or ctranslate2 for a model made by `mtkit export` (MODEL is its folder; "
        "fp32 keeps the export's own weight type, e.g. int8).",
    ),
]
Beam = Annotated[int | None, typer.Option(min=1, help="Beam size; 1 is greedy. [default: the model's]")]
CpuThreads = Annotated[
    int,
    typer.Option(
        "--threads",
        min=0,
        help="CPU threads to translate on; 0: OMP_NUM_THREADS where set, else one per core (CTranslate2: 4). "
        "Processes sharing a machine each take a share of its cores.",
    ),
]
Overrides = Annotated[list[str], typer.Option("--set", help="Override a config key: --set train.lr=0.001, repeatable.")]


def user_errors(command):
    """Turn mtkit's errors (``MtkitError``: input, settings, machine) and the file system's (a full disk, a
    denied permission) into one line and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
            with contextlib.suppress(AttributeError, OSError, ValueError):  # a stand-in stdout has no descriptor
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
            raise typer.Exit(1) from None
        except OSError as err:
            from mtkit.files import os_error_line

            error_line(os_error_line(err))
        except MtkitError as err:
            error_line(str(err))

    return wrapper


MAX_ERROR_CHARS = 2_000  # an error quoting an untrusted value never floods the terminal


def error_line(message: str) -> None:
    """Print ``error: MESSAGE`` as one line, cut short if it is huge, and exit with status 1.

    Under torchrun only rank 0 prints: the ranks read the same inputs, so they fail alike.
    """
    if os.environ.get("RANK", "0") != "0":
        raise typer.Exit(1)
    line = " ".join(message.splitlines())  # \r, U+2028 and the like too: one line, whatever it quotes
    if len(line) > MAX_ERROR_CHARS:
        line = line[:MAX_ERROR_CHARS] + f"... ({len(line) - MAX_ERROR_CHARS:,} more characters)"
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(1) from None


def set_log_level(level: int) -> None:
    """The level the global options ask for; every command's logging set-up reads it."""
    global _log_level
    _log_level = level


class JsonLines(logging.Formatter):
    """Each record as one JSON object: time, level, message and the fields a record carries (a server's request
    line: its number, method, path, sentences, milliseconds and status), for log collectors to parse."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(quiet: bool = False, json_lines: bool = False) -> None:
    """One handler on the current stderr (an earlier in-process call may have left one on a closed stream);
    ``json_lines``: each line a JSON object (``JsonLines``)."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
    if json_lines:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLines())
    elif stderr.is_terminal:
        from rich.logging import RichHandler

        handler = RichHandler(console=stderr, show_path=False, show_time=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(max(_log_level, logging.WARNING) if quiet else _log_level)
    log.propagate = False


def examples(*lines: str) -> str:
    """A command's --help epilog: one example command per line."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in lines)


def given(**options) -> dict:
    """The options the user gave (not None): the others fall back on the model's saved settings."""
    return {name: value for name, value in options.items() if value is not None}
