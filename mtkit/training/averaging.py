"""Checkpoint averaging (``mtkit average``, and ``mtkit run``'s average stage): the element-wise mean of the
weights of checkpoints of one model, which often scores better than the last checkpoint alone.

A LoRA run's checkpoints hold adapters, and the mean of adapters is not the mean of the models they make (B A is
not linear in A and B): each is averaged as the model it makes, its adapter merged into its base, and the
average is a model of its own weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtkit.config import RecipeConfig
from mtkit.model.checkpoint import (
    WEIGHTS_FILE,
    Checkpoint,
    CheckpointError,
    check_weights,
    tied_aliases,
    write_model_file,
)
from mtkit.model.loading import model_checkpoint
from mtkit.model.run_folder import CHECKPOINTS_DIR, run_checkpoints


def average_checkpoints(paths: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Element-wise mean of the weights of checkpoints of one model and tokenizer.

    Sums are kept in float64, one checkpoint in memory at a time. The metadata is the newest checkpoint's,
    less its validation result (which does not describe the average), plus the list of ``averaged`` paths.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    first = model_checkpoint(paths[0])
    aliases = tied_aliases(first.weights)
    layout = {k: t.to("meta") for k, t in first.weights.items()}  # names, shapes and dtypes, without the data
    sums = {k: t.double() if t.is_floating_point() else t for k, t in first.weights.items() if k not in aliases}
    newest = first.meta
    for path in paths[1:]:
        ckpt = model_checkpoint(path)
        _check_compatible(ckpt, first, layout)
        for key, total in sums.items():
            if total.is_floating_point():
                total.add_(ckpt.weights[key])
            elif not torch.equal(total, ckpt.weights[key]):
                raise CheckpointError(f"{path}: {key} differs from {paths[0]}, and integer tensors cannot be averaged")
        if ckpt.meta["step"] > newest["step"]:
            newest = ckpt.meta
    weights = {k: (t / len(paths)).to(layout[k].dtype) if t.is_floating_point() else t for k, t in sums.items()}
    weights.update({alias: weights[key] for alias, key in aliases.items()})
    meta = {k: v for k, v in newest.items() if k != "validation"}
    return weights, {**meta, "averaged": [str(p) for p in paths]}


def checkpoints_to_average(inputs: list[Path], last: int | None = None) -> list[Path]:
    """What ``mtkit average`` averages: the newest ``last`` checkpoints of one run directory (by default as many
    as a recipe averages), or two or more checkpoints given one by one."""
    if len(inputs) == 1 and inputs[0].is_dir() and not (inputs[0] / WEIGHTS_FILE).is_file():
        paths = run_checkpoints(inputs[0])[-(last or RecipeConfig.average_last) :]
        if not paths:
            raise CheckpointError(f"{inputs[0]}: no checkpoints to average in {inputs[0] / CHECKPOINTS_DIR}")
        return paths
    if last is not None:
        raise CheckpointError("--last applies to a run directory; give it alone, without checkpoint paths")
    if len(inputs) < 2:
        raise CheckpointError("give one run directory, or two or more checkpoints to average")
    return list(inputs)


def write_average(paths: list[Path], output: Path) -> dict[str, Any]:
    """Average ``paths`` into the .safetensors file ``output``, tokenizers beside it; the average's metadata."""
    weights, meta = average_checkpoints(paths)
    write_model_file(output, weights, meta, paths[0])
    return meta


def _check_compatible(ckpt: Checkpoint, first: Checkpoint, layout: dict[str, torch.Tensor]) -> None:
    """``ckpt`` must be of the model (settings, tokenizer, weight layout) of ``first``."""
    if ckpt.cfg.model != first.cfg.model:
        raise CheckpointError(f"{ckpt.path}: model settings differ from those of {first.path}; cannot average them")
    if ckpt.meta["tokenizer"] != first.meta["tokenizer"]:
        raise CheckpointError(f"{ckpt.path}: tokenizer differs from that of {first.path}; cannot average them")
    check_weights(layout, ckpt.weights, ckpt.path, f"those of {first.path}")
