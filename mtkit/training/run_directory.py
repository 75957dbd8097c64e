"""The run directory as training owns it: one writer at a time, tidy after a crash, every write accounted for.

Rank 0 claims the directory (its lock, ``--restart``, tidying what a crash left) and is the one that
writes to it: config.yaml, metrics.jsonl (and the tensorboard folder), checkpoints and best/; the
tokenizers are put there by ``tokenizers.prepare_tokenizers``. Every rank reads its checkpoints. The
directory's layout and the names in it are model/run_folder.py's; the checkpoint format, model/checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
import torch

from mtkit import files
from mtkit.config import RunConfig, config_yaml
from mtkit.errors import TrainingFailed
from mtkit.model import checkpoint, run_folder
from mtkit.model.checkpoint import CheckpointError
from mtkit.model.run_folder import (
    BEST_DIR,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    IMPORTED_DIR,
    LOCK_FILE,
    METRICS_FILE,
    TENSORBOARD_DIR,
    UPDATE_DIR,
    UPDATE_PREFIX,
    VALIDATION_FILE,
)


class RunDirectory:
    """``RUN/`` for one training run: claimed by rank 0, which alone writes; read by every rank."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock: RunLock | None = None
        self._tensorboard = None

    def claim(self, restart: bool) -> None:
        """Become its one writer: take the lock, remove earlier outputs for ``restart``, tidy after a crash."""
        self._lock = RunLock(self.path)
        if restart:
            remove_run_outputs(self.path)
        recover(self.path)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
        if self._tensorboard is not None:
            self._tensorboard.close()

    # -- reading ----------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        return run_folder.run_checkpoints(self.path)

    def latest(self) -> Path | None:
        return run_folder.latest(self.path)

    # -- writing ----------------------------------------------------------------------------

    def start_log(self, cfg: RunConfig, step: int, validated: int) -> None:
        """Write the config training runs with, and trim the metrics to the update it starts from."""
        with self.writing(CONFIG_FILE):
            files.atomic_write_text(self.path / CONFIG_FILE, config_yaml(cfg))
        with self.writing(METRICS_FILE):
            trim_metrics(self.path / METRICS_FILE, step, validated)

    def open_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # check_trainable made sure it is there

        self._tensorboard = SummaryWriter(str(self.path / TENSORBOARD_DIR))

    def log(self, record: dict) -> None:
        """Append ``record`` to metrics.jsonl, and its numbers to tensorboard when it is open."""
        with self.writing(METRICS_FILE), open(self.path / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "epoch"):
                    self._tensorboard.add_scalar(f"{record['event']}/{key}", value, record["step"])
            self._tensorboard.flush()

    def save_checkpoint(
        self,
        step: int,
        weights: dict[str, torch.Tensor],
        meta: dict[str, Any],
        state: dict,
        keep_last: int,
        header: dict[str, str] | None = None,
    ) -> None:
        with self.writing(f"the checkpoint of update {step}"):
            save_in_run(self.path, step, weights, meta, state, keep_last, header)

    def save_best(
        self, weights: dict[str, torch.Tensor], meta: dict[str, Any], header: dict[str, str] | None = None
    ) -> None:
        with self.writing("the best checkpoint"):
            save_best(self.path, weights, meta, header)

    def record_validation(self, step: int, outcome: dict[str, Any]) -> None:
        with self.writing(f"the validation outcome of update {step}"):
            record_validation(self.path, step, outcome)

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """A failed write (a full disk, say) stops training, naming what stays good."""
        try:
            yield
        except OSError as err:
            latest = self.latest()
            kept = f"{latest} is intact" if latest is not None else "no checkpoint was saved before"
            raise TrainingFailed(
                f"cannot write {what} in {self.path} ({files.os_error_line(err)}); {kept}: fix the cause, "
                "then run the same command to resume"
            ) from None


# -- checkpoints ----------------------------------------------------------------------------


def save_in_run(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    meta: dict[str, Any],
    state: dict[str, Any] | None,
    keep_last: int,
    header: dict[str, str] | None = None,
) -> Path:
    """Save ``RUN/checkpoints/update-STEP/``, then delete all but the newest ``keep_last`` (0 keeps all); ``header``:
    entries of its weights file's header beside mtkit's (a LoRA run's adapter record)."""
    directory = run_folder.update_dir(run_dir, step)
    checkpoint.save(directory, weights, {**meta, "step": step}, state, header=header)
    if keep_last > 0:
        for old in run_folder.run_checkpoints(run_dir)[:-keep_last]:
            if old != directory:  # never the one just written, even if stale later ones exist
                _delete(old)
    return directory


def _delete(directory: Path) -> None:
    """Remove a checkpoint in one step as far as readers can tell: renamed out of sight, then deleted.

    A crash in the middle of deleting the files could otherwise leave a folder holding the weights
    without the training state, which would pass for a checkpoint to resume from.
    """
    doomed = directory.with_name(f".{directory.name}.pruned")
    os.rename(directory, doomed)
    shutil.rmtree(doomed)


def save_best(
    run_dir: Path, weights: dict[str, torch.Tensor], meta: dict[str, Any], header: dict[str, str] | None = None
) -> None:
    checkpoint.save(Path(run_dir) / BEST_DIR, weights, meta, header=header)


def record_validation(run_dir: Path, step: int, outcome: dict[str, Any]) -> None:
    """Add to the checkpoint of ``step``, saved before its validation, what that validation changed."""
    files.atomic_write_text(run_folder.update_dir(run_dir, step) / VALIDATION_FILE, json.dumps(outcome))


def read_validation(checkpoint_dir: Path) -> Any:
    """The outcome ``record_validation`` added to a checkpoint (unchecked JSON), or None if there is none."""
    try:
        return json.loads((Path(checkpoint_dir) / VALIDATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none (or not a directory), or torn: the validation is done again
        return None


# -- one writer, tidy after a crash ---------------------------------------------------------


class RunLock:
    """An exclusive lock on a run directory, so two trainings never write checkpoints over each other.

    The operating system releases it when the process ends, however it ends; ``RUN/.lock`` names the
    process holding it.
    """

    def __init__(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        self._lock = filelock.FileLock(path, timeout=0)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            holder = path.read_text(errors="replace").strip()[:20] or "unknown"
            raise CheckpointError(
                f"{run_dir}: in use by another training process (pid {holder}); stop it or choose another --out"
            ) from None
        path.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        self._lock.release()


# What training writes, by folder; a leftover of an interrupted write is .NAME.*.tmp, .NAME.old or .NAME.pruned.
_TRAINING_NAMES = {
    "": "|".join(map(re.escape, (CONFIG_FILE, METRICS_FILE, BEST_DIR))) + r"|spm(?:\.src|\.tgt)?(?:\.model|\.vocab)?",
    CHECKPOINTS_DIR: UPDATE_DIR.pattern,
    f"{CHECKPOINTS_DIR}/{UPDATE_PREFIX}*": re.escape(VALIDATION_FILE),  # added to a checkpoint after its save
}


def recover(run_dir: Path) -> None:
    """Tidy a run directory after a crash: put back what was set aside, delete what was half made.

    A checkpoint set aside while its replacement moved in is put back if the replacement never
    arrived. Then the temporary files and folders of interrupted writes (``.NAME.*.tmp``), set-aside
    copies no longer needed and checkpoints caught being pruned are deleted, for the names training
    writes only: another program's temporary file in the run directory (``translate -o RUN/x``
    writing ``.x.*.tmp``) is left alone.
    """
    for pattern, names in _TRAINING_NAMES.items():
        leftover = re.compile(rf"\.(?:{names})\.(?:.+\.tmp|old|pruned)")
        for parent in Path(run_dir).glob(pattern) if pattern else [Path(run_dir)]:
            if not parent.is_dir():
                continue
            for old in parent.glob(".*.old"):
                if leftover.fullmatch(old.name):
                    files.restore_set_aside(old.with_name(old.name[1 : -len(".old")]))
            for path in parent.glob(".*"):
                if not leftover.fullmatch(path.name):
                    continue
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()


def remove_run_outputs(out_dir: Path) -> None:
    """Delete what training wrote into ``out_dir`` (for ``--restart``), leaving anything else alone."""
    for name in (CHECKPOINTS_DIR, BEST_DIR, TENSORBOARD_DIR, IMPORTED_DIR):  # not .lock: it is held
        shutil.rmtree(out_dir / name, ignore_errors=True)
    names = [METRICS_FILE, CONFIG_FILE]
    for path in [*(out_dir / name for name in names), *out_dir.glob("spm*.model"), *out_dir.glob("spm*.vocab")]:
        path.unlink(missing_ok=True)


def trim_metrics(path: Path, step: int, validated: int | None = None) -> None:
    """Keep the records of updates up to ``step``, where training resumes; drop a line torn by a crash.

    The updates after the checkpoint are done again, and logged again, so the file keeps one record
    each. So are validations after ``validated`` (the checkpoint's own, when it was cut short).
    """
    if not path.is_file():
        return
    validated = step if validated is None else validated
    kept, changed = [], False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            at = record.get("step", 0) if isinstance(record, dict) else None
            keep = isinstance(at, int) and at <= (validated if record.get("event") == "valid" else step)
        except json.JSONDecodeError:
            keep = False
        if keep:
            kept.append(line)
        else:
            changed = True
    if changed:
        files.atomic_write_text(path, "".join(line + "\n" for line in kept))
