"""Progress on stderr: a live Rich display on a terminal; plain log lines (or nothing) when stderr is
a file or a pipe, so logs stay readable."""

from __future__ import annotations

import logging
import time

from rich.console import Console

log = logging.getLogger("mtkit")


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
