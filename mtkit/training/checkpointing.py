"""What the trainer writes into a checkpoint beside the weights, and how it takes a checkpoint's training
state back: optimizer, loss scaler, every rank's random draws and the run's progress.

A state that does not fit the model and optimizer it is loaded into is a CheckpointError naming the
file, never a failure some updates later.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtkit.config import RunConfig
from mtkit.data.tokenizer import Tokenizer
from mtkit.model import checkpoint
from mtkit.training.distributed import Distributed
from mtkit.training.resume import Progress, TrainingState, check_optimizer_state, restore_rng_state


def checkpoint_meta(
    cfg: RunConfig,
    tokenizers: tuple[Tokenizer, Tokenizer],
    step: int,
    data_sha256: dict[str, str],
    init: dict | None,
) -> dict:
    """A checkpoint's header: the config, the tokenizers' files and SHA-256, the update, the data files' SHA-256,
    and ``init``, the record of the model the run started from (train.init_from), if any."""
    names = checkpoint.tokenizer_files(cfg)
    src_tok, tgt_tok = tokenizers
    tokenizer = {
        "src": {"file": names["src"], "sha256": src_tok.sha256},
        "tgt": {"file": names["tgt"], "sha256": tgt_tok.sha256},
    }
    meta = {"config": cfg.to_dict(), "tokenizer": tokenizer, "step": step}
    return {**meta, "data_sha256": data_sha256, **({"init": init} if init else {})}


def restore_training_state(
    path: Path,
    saved: checkpoint.Checkpoint,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    seed: int,
    dist: Distributed,
    device: torch.device,
) -> Progress:
    """Load the training state of the checkpoint ``saved`` (read from ``path``) into ``optimizer``, ``scaler`` and
    this rank's random number generators; its progress. Resumed on another number of ranks, dropout is reseeded
    from train.seed ``seed``, the rank and the update."""
    state = TrainingState.read(path, saved.state, saved.meta["step"])
    try:
        optimizer.load_state_dict(state.optimizer)
        check_optimizer_state(optimizer)
        scaler.load_state_dict(state.scaler)
        restore_rng_state(state.rng, dist, device, seed + 1_000_003 * dist.rank + state.progress.step)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
        raise checkpoint.CheckpointError(
            f"{path}: its training state does not fit this model and optimizer "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
        ) from None
    return state.progress


def unreadable_error(
    err: checkpoint.UnreadableCheckpoint, latest: Path, checkpoints: list[Path]
) -> checkpoint.CheckpointError:
    """The error for a run's newest checkpoint ``latest`` that cannot be read, given all of the run's
    ``checkpoints``: deleting it resumes from the one before, if any."""
    older = checkpoints[:-1]
    if not older:
        return err
    return checkpoint.CheckpointError(f"{err}; delete {latest} to resume from {older[-1]}")
