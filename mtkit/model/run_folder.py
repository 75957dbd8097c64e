"""A run directory's layout, named once: training writes it (training/run_directory.py), finding a model reads
it (loading.py), so the two can never disagree on a name.

Its layout::

    RUN/config.yaml                              resolved config
    RUN/spm.model (+ .vocab)                     joint tokenizer, or spm.src.model and spm.tgt.model
    RUN/checkpoints/update-00001000/             one directory per save, the newest train.keep_last kept
        model.safetensors                        weights + metadata (checkpoint.py's format)
        state.pt                                 training state, for resuming
        validation.json                          what the validation of that update changed, once done
    RUN/best/model.safetensors                   weights of the best validation result, what translating uses
    RUN/metrics.jsonl                            one JSON object per log or validation event
    RUN/tensorboard/                             the same numbers for tensorboard, when train.tensorboard is set
    RUN/imported/                                the model train.init_from: hf:SOURCE names, imported anew
                                                 by each start before the run's first checkpoint
    RUN/.lock                                    held while a training process writes here
"""

from __future__ import annotations

import re
from pathlib import Path

from mtkit.model.checkpoint import WEIGHTS_FILE

CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR = "config.yaml", "metrics.jsonl", "tensorboard"
CHECKPOINTS_DIR, BEST_DIR = "checkpoints", "best"
IMPORTED_DIR = "imported"
VALIDATION_FILE = "validation.json"  # added to a checkpoint once the validation of its update is done
LOCK_FILE = ".lock"
UPDATE_PREFIX = "update-"  # a checkpoint's folder in CHECKPOINTS_DIR: the prefix, then its update zero-padded
UPDATE_DIR = re.compile(rf"{UPDATE_PREFIX}(\d+)")


def update_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of update ``step`` of a run is saved."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"{UPDATE_PREFIX}{step:08d}"


def run_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first; temporary and partial ones are skipped."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(match[1]), path)
        for path in root.iterdir()
        if (match := UPDATE_DIR.fullmatch(path.name)) and (path / WEIGHTS_FILE).is_file()
    ]
    return [path for _, path in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    """Where training resumes from: the newest checkpoint, if any."""
    found = run_checkpoints(run_dir)
    return found[-1] if found else None
