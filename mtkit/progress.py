"""Progress on stderr: a live Rich display on a terminal; plain log lines (or nothing) when stderr is
a file or a pipe, so logs stay readable."""

from __future__ import annotations

import logging
import time

from rich.console import Console

log = logging.getLogger("mtkit")

PLAIN_EVERY_S = 30.0  # off a terminal, a long stage logs a line this often, so a log shows it is alive


class StageProgress:
    """One long stage (a download, encoding a corpus, decoding a validation set): a Rich bar with the total
    and an ETA on a terminal, a spinner where the total is unknown; off a terminal, a plain log line when it
    starts, every PLAIN_EVERY_S seconds, and when it ends.

    ``with StageProgress("encoding train.en", total=lines, unit="lines") as bar: bar.advance(n)``
    """

    def __init__(self, description: str, total: float | None = None, unit: str = "lines") -> None:
        self.description, self.total, self.unit = description, total, unit
        self.completed = 0.0
        self.progress = None
        stderr = Console(stderr=True)
        if stderr.is_terminal and log.isEnabledFor(logging.INFO):
            self.progress = _rich_progress(stderr, known_total=total is not None, unit=unit)

    def __enter__(self) -> StageProgress:
        self.start = self.last_line = time.monotonic()
        if self.progress is not None:
            self.task = self.progress.add_task(self.description, total=self.total)
            self.progress.start()
        else:
            log.info("%s%s", self.description, f" ({_amount(self.total, self.unit)})" if self.total else "")
        return self

    def advance(self, amount: float = 1) -> None:
        self.update(self.completed + amount)

    def update(self, completed: float, total: float | None = None) -> None:
        """Set what is done (and the total, when it becomes known)."""
        self.completed = completed
        if total is not None:
            self.total = total
        if self.progress is not None:
            self.progress.update(self.task, completed=completed, total=self.total)
        elif time.monotonic() - self.last_line >= PLAIN_EVERY_S:
            self.last_line = time.monotonic()
            share = f" of {_amount(self.total, self.unit)}" if self.total else ""
            log.info("%s: %s%s", self.description, _amount(self.completed, self.unit), share)

    def __exit__(self, exc_type, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
        elif exc_type is None:
            elapsed = time.monotonic() - self.start
            log.info("%s: %s in %.1f s", self.description, _amount(self.completed, self.unit), elapsed)


def _amount(value: float | None, unit: str) -> str:
    if unit == "bytes":
        return f"{(value or 0) / 2**20:,.1f} MiB"
    return f"{value or 0:,.0f} {unit}"


def _rich_progress(console: Console, known_total: bool, unit: str):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    done = [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn(), TextColumn(unit)]
    if not known_total:
        return Progress(SpinnerColumn(), TextColumn("{task.description}"), *done, TimeElapsedColumn(), console=console)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        *done,
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


class TrainingProgress:
    """Training's progress: a live bar on a terminal, a plain log line every ``every`` updates otherwise."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.progress = None

    def start(self, total_steps: int, done_steps: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.total = total_steps
        stderr = Console(stderr=True)
        if stderr.is_terminal:
            self.progress = Progress(
                TextColumn("update"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=stderr,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=done_steps, stats="")
            self.progress.start()

    def update(self, step: int, stats: dict) -> None:
        text = f"loss {stats['loss']:.3f} lr {stats['lr']:.2e} {stats['tok_s']:,.0f} tok/s epoch {stats['epoch']}"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=text)
        elif step % self.every == 0:
            log.info("update %d/%d %s", step, self.total, text)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class LineProgress:
    """Lines done and lines/s on a terminal's stderr; nothing when stderr is a file or pipe."""

    def __init__(self) -> None:
        self.progress = None
        stderr = Console(stderr=True)
        if stderr.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.completed:,} lines  {task.fields[rate]}"),
                TimeElapsedColumn(),
                console=stderr,
                transient=True,
            )
            self.task = self.progress.add_task("translate", total=None, rate="")
            self.start = time.perf_counter()

    def __enter__(self) -> LineProgress:
        if self.progress is not None:
            self.progress.start()
        return self

    def advance(self) -> None:
        if self.progress is not None:
            done = self.progress.tasks[0].completed + 1
            rate = f"{done / max(time.perf_counter() - self.start, 1e-9):,.1f} lines/s"
            self.progress.update(self.task, completed=done, rate=rate)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
