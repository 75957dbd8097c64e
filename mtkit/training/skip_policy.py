"""What a skipped update leads to: counted while training goes on, a rollback to the newest checkpoint with a
lower learning rate, or TrainingFailed with advice.

An update is skipped when a rank ran out of memory, when the fp16 loss scaler found a gradient overflow,
or when the loss or gradient is not finite. The policy only decides; the trainer carries out a rollback.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from mtkit.config import TrainConfig
from mtkit.errors import TrainingFailed
from mtkit.training.resume import Progress

log = logging.getLogger("mtkit")

MAX_CONSECUTIVE_OOMS = 5  # out-of-memory skips in a row before training stops with advice
MAX_CONSECUTIVE_SKIPS = 25  # skipped updates of any kind in a row that mean training has diverged


class SkipPolicy:
    """What a skipped update leads to: counted while training goes on, a rollback, or TrainingFailed.

    Runs of skips end training: MAX_CONSECUTIVE_OOMS out-of-memory skips in a row (the batches are
    too big for the device) or MAX_CONSECUTIVE_SKIPS skips of any kind (training has diverged). A
    non-finite loss is skipped, rolled back or fatal as train.nonfinite says.
    """

    def __init__(self, tc: TrainConfig) -> None:
        self.tc = tc
        self.in_a_row = 0  # updates skipped since the last applied update or rollback

    def reset(self) -> None:
        """An update went through, or training rolled back: a run of skips is over."""
        self.in_a_row = 0

    def skipped(self, stats: dict, progress: Progress) -> bool:
        """Count the update ``stats`` says was skipped in ``progress``; whether it calls for a rollback."""
        kind, p, tc = stats["skipped"], progress, self.tc
        self.in_a_row += 1
        if kind == "oom":
            p.oom_skips += 1
            log.warning(
                "update %d: out of memory on %d rank(s); its batches are skipped (%d so far)",
                p.step + 1,
                stats["oom_ranks"],
                p.oom_skips,
            )
            if self.in_a_row >= MAX_CONSECUTIVE_OOMS:
                raise TrainingFailed(
                    f"out of memory in {self.in_a_row} updates in a row: lower train.batch_tokens "
                    f"(now {tc.batch_tokens}) and raise train.accum to keep the effective batch"
                )
        elif kind == "overflow":
            p.overflow_skips += 1
        elif tc.nonfinite == "skip":
            p.nonfinite_skips += 1
            log.warning("update %d: non-finite loss or gradient; update skipped (train.nonfinite: skip)", p.step + 1)
        else:
            return True
        if self.in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise TrainingFailed(
                f"{self.in_a_row} updates in a row skipped ({kind}) at update {p.step + 1}: "
                "training has diverged; lower train.lr or use precision fp32"
            )
        return False

    def rollback_target(self, progress: Progress, latest: Path | None) -> Path:
        """The checkpoint to roll back to from a non-finite loss; TrainingFailed where no rollback is allowed."""
        tc, p = self.tc, progress
        if tc.nonfinite == "stop" or latest is None or p.rollbacks >= tc.max_rollbacks:
            if tc.nonfinite == "stop":
                why = "train.nonfinite is stop"
            elif latest is None:
                why = "no checkpoint to roll back to yet"
            else:
                why = f"already rolled back {p.rollbacks} times (train.max_rollbacks)"
            kept = f"; last good checkpoint: {latest}" if latest is not None else ""
            raise TrainingFailed(
                f"{_nonfinite_at(p.step + 1, tc.precision)}; {why}{kept}; lower train.lr or use precision fp32"
            )
        return latest

    def rolled_back(self, before: Progress, restored: Progress) -> Progress:
        """The progress to go on from after a rollback: ``restored``, the checkpoint's, with the skip counters
        and the clock of ``before`` carried over, one more rollback and a lower learning rate."""
        tc = self.tc
        lr_scale = before.lr_scale * tc.rollback_lr_factor
        carried = {**before.counters(), "seconds": before.seconds, "rollbacks": before.rollbacks + 1}
        progress = replace(restored, **carried, lr_scale=lr_scale)
        self.reset()
        log.warning(
            "%s: rolled back to update %d, learning rate x%g (rollback %d of %d)",
            _nonfinite_at(before.step + 1, tc.precision),
            progress.step,
            lr_scale,
            progress.rollbacks,
            tc.max_rollbacks,
        )
        return progress


def _nonfinite_at(step: int, precision: str) -> str:
    return f"non-finite loss or gradient at update {step} (precision {precision})"
