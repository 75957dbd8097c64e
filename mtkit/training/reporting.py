"""What training tells as it goes: metrics.jsonl lines, written by rank 0, and the progress a reporter shows.

A ``Reporter`` is where progress goes: ``TrainingProgress`` draws it with Rich for the command line,
``LogReporter`` only logs the start, for the API, scripts and ranks other than 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from rich import progress as bars

from mtkit.progress import STDERR, shows_bar
from mtkit.runtime import PrecisionChoice
from mtkit.training.resume import Progress
from mtkit.training.run_directory import RunDirectory

log = logging.getLogger("mtkit")


class Reporter(Protocol):
    """Where progress goes; the CLI draws it with Rich, tests and scripts can log it."""

    def start(self, total_steps: int, done_steps: int) -> None: ...
    def update(self, step: int, stats: dict) -> None: ...
    def finish(self) -> None: ...


class LogReporter:
    """A log line at the start and nothing after: for the API, scripts and ranks other than 0."""

    def start(self, total_steps: int, done_steps: int) -> None:
        log.info("training from update %d to %d", done_steps, total_steps)

    def update(self, step: int, stats: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class TrainingProgress:
    """Training's progress: a live bar on a terminal, a plain log line every ``every`` updates otherwise;
    nothing when INFO is not logged."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.progress = None

    def start(self, total_steps: int, done_steps: int) -> None:
        self.total = total_steps
        if shows_bar():
            self.progress = bars.Progress(
                bars.TextColumn("update"),
                bars.MofNCompleteColumn(),
                bars.BarColumn(),
                bars.TextColumn("{task.fields[stats]}"),
                bars.TimeElapsedColumn(),
                bars.TextColumn("ETA"),
                bars.TimeRemainingColumn(),
                console=STDERR,
                redirect_stdout=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=done_steps, stats="")
            self.progress.start()

    def update(self, step: int, stats: dict) -> None:
        text = f"loss {stats['loss']:.3f} lr {stats['lr']:.2e} {stats['tok_s']:,.0f} tok/s {stats['epoch']}"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=text)
        elif step % self.every == 0:
            log.info("update %d/%d %s", step, self.total, text)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()


@dataclass
class LogWindow:
    """Target tokens since a clock start, for throughput; the loss sums live in Progress, to survive a resume."""

    tokens: int = 0
    updates: int = 0
    start: float = field(default_factory=time.perf_counter)

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)

    def seconds_per_update(self) -> float:
        return (time.perf_counter() - self.start) / max(self.updates, 1)


def epochs(p: Progress) -> dict:
    """The epoch a run is in; with several corpora (data.corpora) each walks its own epochs, in config order."""
    return {"epochs": p.mix[1::2]} if p.mix else {"epoch": p.epoch}


def epoch_text(p: Progress) -> str:
    """``epoch 3``, or with several corpora ``epochs 3,2,4`` (data.corpora's order)."""
    return f"epochs {','.join(map(str, p.mix[1::2]))}" if p.mix else f"epoch {p.epoch}"


class TrainingReport:
    """One rank's report of a run: metrics.jsonl lines (rank 0 alone writes them) and the reporter's display
    (on ranks other than 0, a ``LogReporter``)."""

    def __init__(
        self, run_dir: RunDirectory, reporter: Reporter | None, is_main: bool, device: torch.device, log_every: int
    ) -> None:
        self.run_dir, self.is_main, self.device, self.log_every = run_dir, is_main, device, log_every
        self.reporter = (reporter if is_main else None) or LogReporter()
        self.window = LogWindow()

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl."""
        if self.is_main:
            self.run_dir.log(record)

    def write_start(self, step: int, hardware: str, precision: PrecisionChoice, init: dict | None = None) -> None:
        """What metrics.jsonl says of each start: the update it starts from, the machine, the precision (``auto``
        resolved), which report.md shows, and for a run started from a model (train.init_from), which one."""
        record = {"event": "start", "step": step, "device": str(self.device), "hardware": hardware}
        self.write({**record, **precision.to_dict(), **({"init": init} if init else {})})

    def show_start(self, total_steps: int, done_steps: int) -> None:
        self.reporter.start(total_steps, done_steps)

    def finish(self) -> None:
        self.reporter.finish()

    def restart_window(self) -> None:
        """Measure throughput from now on: it counts training time only, not validations."""
        self.window = LogWindow()

    def update(self, p: Progress, stats: dict) -> None:
        """Show the update ``p.step`` just applied, and write a metrics line every ``log_every`` updates."""
        p.log_loss, p.log_nll, p.log_updates = p.log_loss + stats["loss"], p.log_nll + stats["nll"], p.log_updates + 1
        self.window.tokens += stats["tokens"]
        self.window.updates += 1
        # The mean loss since the last line, as in metrics.jsonl: one update's loss swings with its batch's lengths.
        loss, tok_s = p.log_loss / p.log_updates, self.window.tokens_per_s()
        shown = {**stats, "loss": loss, "tok_s": tok_s, "epoch": epoch_text(p)}
        self.reporter.update(p.step, shown)
        if p.step % self.log_every:
            return
        record = {
            "event": "train",
            "step": p.step,
            **epochs(p),
            "lr": stats["lr"],
            "loss": loss,
            "nll": p.log_nll / p.log_updates,
            "grad_norm": float(stats["grad_norm"]),  # under torchrun, read from the device only now
            "tgt_tokens_per_s": tok_s,
            "seconds_per_update": self.window.seconds_per_update(),
            **p.counters(),
        }
        if self.device.type == "cuda":
            record["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.write(record)
        p.log_loss, p.log_nll, p.log_updates = 0.0, 0.0, 0
        self.window = LogWindow()

    def validation(self, p: Progress, result: dict) -> None:
        """The metrics line and the log line of the validation at update ``p.step``."""
        self.write({"event": "valid", "step": p.step, "epoch": p.epoch, **result})
        log.info("validation at update %d: %s", p.step, _describe(result))


def _describe(result: dict) -> str:
    parts = [f"loss {result['valid_loss']:.3f}", f"ppl {result['valid_ppl']:.2f}"]
    if "valid_bleu_by_direction" in result:
        each = ", ".join(f"{d} {b:.2f}" for d, b in result["valid_bleu_by_direction"].items())
        parts.append(f"BLEU {result['valid_bleu']:.2f} (mean of {each})")
    elif "valid_bleu" in result:
        parts.append(f"BLEU {result['valid_bleu']:.2f}")
    if "valid_comet_by_direction" in result:
        each = ", ".join(f"{d} {c:.4f}" for d, c in result["valid_comet_by_direction"].items())
        parts.append(f"COMET {result['valid_comet']:.4f} (mean of {each})")
    elif "valid_comet" in result:
        parts.append(f"COMET {result['valid_comet']:.4f}")
    if result.get("new_best"):
        parts.append("(new best)")
    return ", ".join(parts)
