"""The learning rate as a pure function of the update, so a resumed run picks it up from a step count alone."""

from __future__ import annotations

import math

from mtkit.config import RunConfig


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` updates, then inverse square-root decay (step >= 1)."""
    if warmup == 0:
        return peak
    return peak * min(step / warmup, math.sqrt(warmup / step))


def schedule_preview(cfg: RunConfig) -> list[tuple[int, float]]:
    """(update, learning rate) at a few telling points, for ``--dry-run``."""
    tc = cfg.train
    steps = sorted({1, max(tc.warmup // 2, 1), max(tc.warmup, 1), 2 * max(tc.warmup, 1), tc.max_steps})
    return [(s, lr_at(s, tc.lr, tc.warmup)) for s in steps if s <= tc.max_steps]
