"""What carries a run from one process to the next: its progress and training state as a checkpoint holds
them, and the checks that a checkpoint fits the run about to go on from it.

A checkpoint is read from disk, so every part is checked before use: a malformed or mismatched one
is a CheckpointError that names the file, never a failure some updates later.
"""

from __future__ import annotations

import logging
import os
import typing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mtkit import untrusted
from mtkit.config import MAX_CORPORA, RunConfig
from mtkit.data.tokenizer import Tokenizer
from mtkit.model import checkpoint
from mtkit.training.distributed import Distributed
from mtkit.training.run_directory import read_validation

log = logging.getLogger("mtkit")


@dataclass
class Progress:
    """The resumable position of a run."""

    step: int = 0  # updates applied
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of this epoch already consumed, by all ranks together
    best: float | None = None  # best validation metric so far (higher is better)
    stale: int = 0  # validations since the best one
    seconds: float = 0.0  # training wall clock so far, across resumed runs
    lr_scale: float = 1.0  # lowered by each rollback after a non-finite loss
    rollbacks: int = 0
    oom_skips: int = 0  # updates skipped because a rank ran out of memory
    overflow_skips: int = 0  # fp16 updates the loss scaler skipped (gradient overflow)
    nonfinite_skips: int = 0  # fp32/bf16 updates skipped under train.nonfinite: skip
    validated: int = 0  # the update of the newest validation whose outcome best and stale hold
    # Sums over the updates since the last metrics line, so the first line after a resume is the same
    # mean an uninterrupted run logs.
    log_loss: float = 0.0
    log_nll: float = 0.0
    log_updates: int = 0
    # With data.corpora: batches drawn so far, then each corpus's epoch and batches of it given (CorpusMix)
    mix: list[int] = field(default_factory=list)

    def counters(self) -> dict:
        return {
            "oom_skips": self.oom_skips,
            "overflow_skips": self.overflow_skips,
            "nonfinite_skips": self.nonfinite_skips,
            "rollbacks": self.rollbacks,
        }


@dataclass
class TrainingState:
    """What a checkpoint holds beside the weights, so that training goes on as if it had never stopped."""

    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    rng: list[dict[str, Any]]  # each rank's random number generator states, in rank order
    progress: Progress

    def to_dict(self) -> dict[str, Any]:
        """The form a checkpoint stores."""
        return {"optimizer": self.optimizer, "scaler": self.scaler, "rng": self.rng, "progress": asdict(self.progress)}

    @classmethod
    def read(cls, path: Path, state: Any, step: int) -> TrainingState:
        """The training state of the checkpoint at ``path`` whose header says ``step``, its progress checked
        field by field, plus the outcome of a validation recorded after the checkpoint was saved."""
        hints = typing.get_type_hints(Progress)
        try:
            state = untrusted.mapping(state, "its training state", required=("optimizer", "scaler", "rng", "progress"))
            values = untrusted.mapping(state["progress"], "progress", optional=list(hints))
            for name, value in values.items():
                what = f"progress.{name}"
                if hints[name] is int:
                    untrusted.integer(value, what)
                elif name == "mix":
                    if not isinstance(value, list) or len(value) > 1 + 2 * MAX_CORPORA:
                        raise untrusted.Malformed(f"{what} must be a list of at most {1 + 2 * MAX_CORPORA} counts")
                    for i, count in enumerate(value):
                        untrusted.integer(count, f"{what}[{i}]")
                elif value is not None or hints[name] is float:
                    untrusted.number(value, what)
            if values.get("step", 0) != step:
                raise untrusted.Malformed(f"progress.step {values.get('step', 0)} is not the header's step {step}")
        except untrusted.Malformed as err:
            raise checkpoint.CheckpointError(f"{path}: malformed checkpoint: {err}") from None
        progress = Progress(**values)
        if "validated" not in values:  # saved before this field existed, and after its own validation
            progress.validated = progress.step
        outcome = read_validation(path)
        if outcome is not None:
            try:
                untrusted.mapping(outcome, "validation outcome", required=("best", "stale"), optional=())
                best = None if outcome["best"] is None else untrusted.number(outcome["best"], "best")
                stale = untrusted.integer(outcome["stale"], "stale")
            except untrusted.Malformed as err:
                log.warning("%s: %s; validating update %d again", path, err, step)
            else:
                progress.best, progress.stale, progress.validated = best, stale, step
        return cls(state["optimizer"], state["scaler"], state["rng"], progress)


class ResumeRefused(checkpoint.CheckpointError):
    """A run directory whose training cannot go on with this config, since what it trained on or with differs:
    ``problem`` says what; the message adds ``advice``, the way on (a caller that offers another way, as a chain's
    stage does, says its own from ``problem``)."""

    def __init__(self, problem: str, advice: str) -> None:
        super().__init__(f"{problem}; {advice}")
        self.problem = problem


def check_resumable(
    path: Path,
    saved: checkpoint.Checkpoint,
    cfg: RunConfig,
    tokenizers: tuple[Tokenizer, Tokenizer],
    data_sha256: dict[str, str],
    run_dir: Path,
) -> None:
    """CheckpointError unless ``saved``, read from ``path``, can go on training ``cfg`` with these source and
    target tokenizers (those of ``run_dir``) on the data files whose SHA-256 ``data_sha256`` holds.

    A checkpoint saved before data digests were recorded is resumed without comparing them.
    """
    if not _same_start(saved.cfg.train.init_from, cfg.train.init_from):
        raise ResumeRefused(
            f"{path}: this run started from {_started_from(saved.cfg.train.init_from)}, this config from "
            f"{_started_from(cfg.train.init_from)}",
            "to start from that, use another --out or start over (--restart)",
        )
    if saved.cfg.model != cfg.model:
        raise ResumeRefused(f"{path}: model settings differ from this config", "use a new --out or --restart")
    if saved.state is None:
        raise checkpoint.CheckpointError(f"{path}: holds weights only, not the training state to resume from")
    mine, theirs = replace(cfg.train.lora, dropout=0.0), replace(saved.cfg.train.lora, dropout=0.0)
    if (mine.rank or theirs.rank) and mine != theirs:
        raise ResumeRefused(
            f"{path}: trained with train.lora rank {theirs.rank}, alpha {theirs.alpha:g} on {list(theirs.targets)}, "
            f"not rank {mine.rank}, alpha {mine.alpha:g} on {list(mine.targets)}",
            "to change them, use another --out or start over (--restart)",
        )
    if saved.cfg.train.freeze != cfg.train.freeze:
        raise ResumeRefused(
            f"{path}: trained with train.freeze {list(saved.cfg.train.freeze)}, not {list(cfg.train.freeze)}",
            f"to change it, {_new_run(run_dir)}",
        )
    for side, tok in zip(("src", "tgt"), tokenizers):
        if saved.meta["tokenizer"][side]["sha256"] != tok.sha256:
            raise ResumeRefused(
                f"{path}: trained with another tokenizer than {tok.path}", "use a new --out or --restart"
            )
    recorded = saved.meta.get("data_sha256")
    for name in sorted(set(recorded) | set(data_sha256)) if recorded is not None else ():
        if recorded.get(name) != data_sha256.get(name):
            now = (
                getattr(cfg.data, name, None) if "." not in name else ("this config's" if name in data_sha256 else None)
            )
            what = f"another data.{name} than {now}" if now else f"a data.{name}, which this config leaves out"
            raise ResumeRefused(f"{path}: trained on {what}", f"to go on with the data as it is, {_new_run(run_dir)}")


def _same_start(saved: str, given: str) -> bool:
    """Whether two train.init_from values name the same model: the same string, or the same path written another
    way (``runs/base/``, ``./runs/base``)."""
    if saved == given:
        return True
    paths = saved and given and not saved.startswith("hf:") and not given.startswith("hf:")
    return bool(paths) and os.path.normpath(saved) == os.path.normpath(given)


def _started_from(init_from: str) -> str:
    """Where a run's weights came from, as its train.init_from says."""
    return f"train.init_from {untrusted.shown_path(init_from)}" if init_from else "random weights (no train.init_from)"


def _new_run(run_dir: Path) -> str:
    """What a run refused to resume can do: start a new run from its weights, or start over."""
    return (
        f"start a new run from this one's weights (--set train.init_from={run_dir} and another --out) "
        "or start over (--restart)"
    )


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's optimizer state has the parameter's shape (a misfit would fail only at the next step)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                    raise ValueError(f"optimizer {name} is {tuple(value.shape)}, its parameter {tuple(param.shape)}")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generator states, which dropout draws from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def restore_rng_state(per_rank: list[dict[str, Any]], dist: Distributed, device: torch.device, seed: int) -> None:
    """Continue this rank's random draws where the checkpoint left them; under another number of ranks
    than saved it, reseed from ``seed`` instead (the run is then no longer the uninterrupted one)."""
    if len(per_rank) != dist.world_size:
        log.warning(
            "checkpoint saved by %d rank(s), resuming on %d: dropout draws differ from an uninterrupted run",
            len(per_rank),
            dist.world_size,
        )
        torch.manual_seed(seed)
        return
    state = per_rank[dist.rank]
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
