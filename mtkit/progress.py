"""Progress on stderr: a live Rich display on a terminal; plain log lines (or nothing) when stderr is
a file or a pipe, so logs stay readable. Nothing is shown when INFO is not logged (``--quiet``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

log = logging.getLogger("mtkit")

STDERR = Console(stderr=True)  # one console for every display, so a stage inside another renders beneath it
PLAIN_EVERY_S = 30.0  # off a terminal, a long stage logs a line this often, so a log shows it is alive
REFRESH_S = 0.1  # a count reaches the display at most this often, so advancing it once per line costs little
KEEP_AFTER_S = 1.0  # a bar stays on the terminal once its stage ends only if the stage took this long

T = TypeVar("T")


def shows_bar() -> bool:
    """Whether a stage starting now draws a Rich display; work done only for the display (counting a
    file's lines for its total) is worth doing only then."""
    return STDERR.is_terminal and log.isEnabledFor(logging.INFO)


class StageProgress:
    """One long stage (a download, encoding a corpus, decoding a validation set): a Rich bar with the total
    and an ETA on a terminal, a spinner where the total is unknown, left in place when the stage ends unless
    it was quick (a dozen small files copied leave no dozen bars); off a terminal, a plain log line when it
    starts, every PLAIN_EVERY_S seconds, and when it ends.

    ``with StageProgress("encoding train.en", total=lines, unit="lines") as bar: bar.advance(n)``

    ``unit`` None is a stage with nothing to count (only its time is shown); ``done`` is what an earlier
    run did already (a resumed download). ``log_ends`` False leaves the start and end lines to a caller
    that logs its own; ``bar`` False keeps a terminal free for other output, as plain lines do.
    """

    def __init__(
        self,
        description: str,
        total: float | None = None,
        unit: str | None = "lines",
        done: float = 0,
        log_ends: bool = True,
        bar: bool = True,
    ) -> None:
        self.description, self.total, self.unit, self.log_ends = description, total, unit, log_ends
        self.completed = done
        self.progress = _rich_progress(STDERR, total is not None, unit) if bar and shows_bar() else None

    def __enter__(self) -> StageProgress:
        self.start = time.monotonic()
        if self.progress is not None:
            self.task = self.progress.add_task(self.description, total=self.total, completed=self.completed)
            self.progress.start()
            self.due = self.start + REFRESH_S
        else:
            self.due = self.start + PLAIN_EVERY_S
            if self.log_ends:
                log.info("%s%s", self.description, f" ({_amount(self.total, self.unit)})" if self.total else "")
        return self

    def advance(self, amount: float = 1) -> None:
        self.completed += amount
        if time.monotonic() >= self.due:
            self._show()

    def update(self, completed: float, total: float | None = None) -> None:
        """Set what is done (and the total, when it becomes known)."""
        self.completed = completed
        if total is not None:
            self.total = total
        if time.monotonic() >= self.due:
            self._show()

    def each(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each counted as one done when it is taken."""
        for item in items:
            self.advance()
            yield item

    def _show(self) -> None:
        if self.progress is not None:
            self.due = time.monotonic() + REFRESH_S
            self.progress.update(self.task, completed=self.completed, total=self.total)
        else:
            self.due = time.monotonic() + PLAIN_EVERY_S
            share = f" of {_amount(self.total, self.unit)}" if self.total else ""
            log.info("%s: %s%s", self.description, _amount(self.completed, self.unit), share)

    def __exit__(self, exc_type, *exc) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=self.completed, total=self.total)
            self.progress.stop()
            if time.monotonic() - self.start >= KEEP_AFTER_S:
                STDERR.print(self.progress)
        elif exc_type is None and self.log_ends:
            done = f"{_amount(self.completed, self.unit)} in" if self.unit else "done in"
            log.info("%s: %s %.1f s", self.description, done, time.monotonic() - self.start)


def _amount(value: float | None, unit: str | None) -> str:
    if unit == "bytes":
        return f"{(value or 0) / 2**20:,.1f} MiB"
    return f"{value or 0:,.0f} {unit}"


def _rich_progress(console: Console, known_total: bool, unit: str | None) -> Progress:
    """A transient display (``StageProgress`` prints what stays), narrow enough for 80 columns: the bar
    takes what the other columns leave."""
    if unit == "bytes":
        done = [DownloadColumn(binary_units=True), TransferSpeedColumn()]
    elif unit is None:
        done = []
    elif known_total:
        done = [MofNCompleteColumn(), TextColumn(unit)]
    else:
        done = [TextColumn(f"{{task.completed:,.0f}} {unit}")]
    # stdout stays the program's: a display on stderr must not take over what is printed there
    options = {"console": console, "transient": True, "redirect_stdout": False}
    if not known_total:
        return Progress(SpinnerColumn(), TextColumn("{task.description}"), *done, TimeElapsedColumn(), **options)
    columns = [TextColumn("{task.description}"), BarColumn(bar_width=None), TaskProgressColumn(), *done]
    return Progress(*columns, _TimeColumn(), **options)


class _TimeColumn(TimeRemainingColumn):
    """The ETA while a stage runs; once it is done, how long it took (an ETA of 0:00:00 says nothing)."""

    def __init__(self) -> None:
        super().__init__(elapsed_when_finished=True)

    def render(self, task: Task) -> Text:
        return Text("in " if task.finished else "ETA ") + super().render(task)
