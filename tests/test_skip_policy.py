"""SkipPolicy's decisions on skipped updates, without a model: what is counted, what rolls back, what ends training."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtkit.config import TrainConfig
from mtkit.errors import TrainingFailed
from mtkit.training.resume import Progress
from mtkit.training.skip_policy import MAX_CONSECUTIVE_OOMS, MAX_CONSECUTIVE_SKIPS, SkipPolicy

OOM, OVERFLOW, NONFINITE = {"skipped": "oom", "oom_ranks": 1}, {"skipped": "overflow"}, {"skipped": "nonfinite"}


def test_out_of_memory_skips_are_counted_until_too_many_in_a_row():
    policy, progress = SkipPolicy(TrainConfig()), Progress(step=7)
    for _ in range(MAX_CONSECUTIVE_OOMS - 1):
        assert policy.skipped(OOM, progress) is False
    policy.reset()  # an update went through
    for _ in range(MAX_CONSECUTIVE_OOMS - 1):
        policy.skipped(OOM, progress)
    with pytest.raises(TrainingFailed, match=f"out of memory in {MAX_CONSECUTIVE_OOMS} updates in a row"):
        policy.skipped(OOM, progress)
    assert progress.oom_skips == 2 * MAX_CONSECUTIVE_OOMS - 1


def test_a_long_run_of_skips_of_any_kind_means_divergence():
    policy, progress = SkipPolicy(TrainConfig(nonfinite="skip")), Progress(step=3)
    for i in range(MAX_CONSECUTIVE_SKIPS - 1):
        assert policy.skipped(OVERFLOW if i % 2 else NONFINITE, progress) is False
    with pytest.raises(TrainingFailed, match=f"{MAX_CONSECUTIVE_SKIPS} updates in a row skipped .* at update 4"):
        policy.skipped(OVERFLOW, progress)
    assert progress.overflow_skips + progress.nonfinite_skips == MAX_CONSECUTIVE_SKIPS


def test_a_nonfinite_loss_calls_for_a_rollback_unless_it_is_skipped():
    progress = Progress()
    assert SkipPolicy(TrainConfig(nonfinite="rollback")).skipped(NONFINITE, progress) is True
    assert SkipPolicy(TrainConfig(nonfinite="stop")).skipped(NONFINITE, progress) is True  # refused by rollback_target
    assert progress.nonfinite_skips == 0  # a rollback repeats the update rather than skipping it


def test_rollback_target_is_the_newest_checkpoint_while_rollbacks_are_allowed():
    latest = Path("RUN/checkpoints/update-00000004")
    policy = SkipPolicy(TrainConfig(max_rollbacks=2))
    assert policy.rollback_target(Progress(step=5, rollbacks=1), latest) == latest
    with pytest.raises(TrainingFailed, match=r"update 6 .*already rolled back 2 times .*last good checkpoint: RUN"):
        policy.rollback_target(Progress(step=5, rollbacks=2), latest)
    with pytest.raises(TrainingFailed, match="no checkpoint to roll back to yet"):
        policy.rollback_target(Progress(step=1), None)
    with pytest.raises(TrainingFailed, match="train.nonfinite is stop"):
        SkipPolicy(TrainConfig(nonfinite="stop")).rollback_target(Progress(step=5), latest)
