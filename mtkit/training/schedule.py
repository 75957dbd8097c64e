"""The learning rate as a pure function of the update, so a resumed run picks it up from a step count alone."""

from __future__ import annotations

import math

from mtkit.config import RunConfig, TrainConfig


def lr_at(step: int, tc: TrainConfig) -> float:
    """The learning rate of update ``step`` (>= 1): linear warm-up to train.lr over train.warmup updates, then
    train.schedule's course: inverse square-root decay, constant, or linear decay to 0 at train.max_steps."""
    peak, warmup = tc.lr, tc.warmup
    if tc.schedule == "inverse_sqrt":
        if warmup == 0:
            return peak
        return peak * min(step / warmup, math.sqrt(warmup / step))
    if step < warmup:
        return peak * step / warmup
    if tc.schedule == "constant":
        return peak
    return peak * max(tc.max_steps - step, 0) / max(tc.max_steps - warmup, 1)


def schedule_preview(cfg: RunConfig) -> list[tuple[int, float]]:
    """(update, learning rate) at a few telling points, for ``--dry-run``."""
    tc = cfg.train
    warmup = max(tc.warmup, 1)
    steps = {1, max(tc.warmup // 2, 1), warmup, 2 * warmup, tc.max_steps}
    if tc.schedule == "linear":
        steps.add((warmup + tc.max_steps) // 2)  # halfway down
    return [(s, lr_at(s, tc)) for s in sorted(steps) if s <= tc.max_steps]
