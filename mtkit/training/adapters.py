"""train.lora in a training run: the base model the adapters adapt, the adapters put on it, and what a checkpoint
holds of them.

A LoRA run trains adapters (mtkit.model.lora) on the model train.init_from names, which stays as it is. Its
checkpoints hold the adapters alone, in an adapter file (mtkit.model.adapter_file) that also carries the run's
header; the header's record of train.init_from says where the base is. So a LoRA run, unlike another fine-tune,
reads its base model again each time it resumes, from that path, and its adapters' record of the base's weights
digest must still be the base's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mtkit.config import ConfigError, LoraConfig
from mtkit.model import checkpoint
from mtkit.model.adapter_file import adapter_header, read_adapter
from mtkit.model.loading import is_adapted
from mtkit.model.lora import add_adapters, load_adapter_weights
from mtkit.model.transformer import Transformer, count_parameters

log = logging.getLogger("mtkit")


@dataclass
class LoraBase:
    """The base model of a LoRA run: where it was read from and the digest of its weights."""

    path: Path
    sha256: str


def base_of(ckpt: checkpoint.Checkpoint) -> LoraBase:
    """``ckpt`` as the base of a LoRA run; ConfigError if it is itself a LoRA run's adapter."""
    if is_adapted(ckpt):
        raise ConfigError(
            f"train.lora adapts a model's own weights, and {ckpt.path} is a LoRA run's: start a LoRA run from the "
            "model that run adapts, or a run without train.lora from this one"
        )
    return LoraBase(ckpt.path, checkpoint.weights_digest(ckpt.weights))


def read_base(init: dict | None) -> tuple[LoraBase, dict[str, torch.Tensor]]:
    """The base a resumed LoRA run recorded (``init``, its checkpoints' record of train.init_from), read again from
    its path, and its weights."""
    if init is None:
        raise checkpoint.CheckpointError("this LoRA run's checkpoints record no base model (train.init_from)")
    path = Path(init["path"])
    if not path.is_file():
        raise checkpoint.CheckpointError(
            f"{path}: the base model this LoRA run adapts (train.init_from) is not there any more; put it back to "
            "resume the run"
        )
    ckpt = checkpoint.read_checkpoint(path, with_state=False)
    return base_of(ckpt), ckpt.weights


def adapt(model: Transformer, weights: dict[str, torch.Tensor], base: LoraBase, settings: LoraConfig) -> None:
    """Load the base's ``weights`` into ``model`` and put new adapters of ``settings`` on it."""
    checkpoint.load_weights(model, weights, base.path)
    held = count_parameters(model)
    added = add_adapters(model, settings)
    log.info(
        "train.lora: adapters of rank %d on %s train (%s parameters, %.2f%% of the %s of %s, which are held)",
        settings.rank, ", ".join(settings.targets), f"{added:,}", 100 * added / held, f"{held:,}", base.path,
    )  # fmt: skip


def header(base: LoraBase, settings: LoraConfig) -> dict[str, str]:
    """The adapter record a LoRA run's checkpoints carry in their header."""
    return adapter_header(settings, base.sha256)


def load_adapters(model: Transformer, path: Path, base: LoraBase, settings: LoraConfig) -> None:
    """The adapters of the checkpoint at ``path`` into ``model``, which carries adapters of ``settings``: checked
    against the base, and to be of those settings, first."""
    adapter = read_adapter(checkpoint.weights_file(path), model, base.sha256, base.path)
    if replace(adapter.settings, dropout=settings.dropout) != settings:
        raise checkpoint.CheckpointError(
            f"{path}: its adapters are of rank {adapter.settings.rank}, alpha {adapter.settings.alpha:g} on "
            f"{', '.join(adapter.settings.targets)}, not of this run's train.lora"
        )
    load_adapter_weights(model, adapter.tensors)
