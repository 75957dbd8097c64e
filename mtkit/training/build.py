"""What a run trains with, built from its config in one place: the optimizer, the loss wrapped for data
parallelism under torchrun, and the number of batch shapes a compiled loss is compiled for."""

from __future__ import annotations

import inspect
import logging

import torch

from mtkit.config import TrainConfig
from mtkit.data.parallel import ShapeBuckets
from mtkit.model.loss import TrainingObjective
from mtkit.model.transformer import count_parameters
from mtkit.training.freezing import adapters_only, freeze

log = logging.getLogger("mtkit")


def build_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.Adam:
    """Adam over the parameters that train: with train.lora the adapters alone, else those train.freeze leaves."""
    training = adapters_only(model) if tc.lora.rank else freeze(model, tc.freeze)
    trained, every = sum(p.numel() for p in training), count_parameters(model)
    log.info("%s of the model's %s parameters train", f"{trained:,}", f"{every:,}")
    # fused: one kernel steps every parameter, rather than one kernel per tensor (docs/benchmarks.md)
    return torch.optim.Adam(
        training,
        lr=tc.lr,
        betas=(0.9, 0.98),
        eps=1e-9,
        weight_decay=tc.weight_decay,
        fused=True,
    )


def data_parallel(objective: TrainingObjective, device: torch.device) -> torch.nn.Module:
    """The loss under DistributedDataParallel, which all-reduces the gradients of its backward passes."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    # Buffers (the sinusoidal table) never change, so there is nothing to broadcast before each forward.
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    return DistributedDataParallel(objective, device_ids=device_ids, **no_buffer_sync)


def batch_shape_count(buckets: ShapeBuckets, max_tokens: int) -> int | None:
    """How many batch shapes training can meet, from the longest pair the data allows (``max_tokens`` pieces, a
    language's token among them where the model reads one, and a bos or eos) and the one-token batch of a
    data-parallel update; None when every batch has its own (train.pad_to_multiple 1), which the compiler then
    covers with symbolic sizes."""
    multiple = buckets.multiple
    if multiple == 1:
        return None
    widths = -(-buckets.width(max_tokens + 1) // multiple)
    shapes = widths * widths + 1
    log.info("train.compile: at most %d batch shapes (train.pad_to_multiple %d), each compiled once", shapes, multiple)
    return shapes
