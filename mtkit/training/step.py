"""The arithmetic of one update on the device: gradients accumulated over a rank's batches, synchronised
between ranks, unscaled and clipped, then applied, or skipped when they are not finite.

The order is that of a mixed-precision step: the loss scaler unscales the gradients before they are
clipped, and with fp16 loss scaling the scaler both applies the update and skips one that overflowed.
A disabled scaler (fp32, bf16) keeps one code path.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mtkit.data.parallel import Batch
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtkit.training.distributed import Distributed


def accumulate_gradients(
    forward: torch.nn.Module,
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    group_tokens: int,
    dist: Distributed,
    device: torch.device,
) -> tuple[Tensor, Tensor, bool]:
    """Forward and backward over this rank's batches with gradients kept local: the summed loss and NLL
    (float64 scalars on the device, not read here) and whether the device ran out of memory."""
    scale = dist.world_size  # DDP averages over ranks; this makes the update a sum over the group
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    local = forward.no_sync() if dist.enabled else contextlib.nullcontext()
    try:
        with local:
            for batch in batches:
                loss, nll = forward(*batch.to(device).tensors())
                scaler.scale(loss * scale / group_tokens).backward()
                loss_sum += loss.detach().double()
                nll_sum += nll.double()
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return zero, zero, True
    return loss_sum, nll_sum, False


def local_outcome(
    loss_sum: Tensor, nll_sum: Tensor, oom: bool, model: torch.nn.Module, scaler: torch.amp.GradScaler
) -> tuple[float, float, float]:
    """The summed loss and NLL with the norm of this rank's gradients, read from the device in one go: what the
    ranks agree on before the all-reduce. Without loss scaling a non-finite loss makes the norm non-finite too;
    with it, only the gradients decide (overflow). The norm is 0 when the rank ran out of memory."""
    checked = [loss_sum, nll_sum, torch.zeros((), dtype=torch.float64, device=loss_sum.device)]
    if not oom:
        checked[2] = torch.nn.utils.get_total_norm([q.grad for q in _parameters_with_gradients(model)]).double()
        if not scaler.is_enabled():
            checked[2] = checked[2] + loss_sum * 0.0
    loss, nll, norm = torch.stack(checked).tolist()
    return loss, nll, norm


def synchronise_gradients(forward: torch.nn.Module, device: torch.device) -> None:
    """DDP's bucketed all-reduce of the gradients accumulated so far, run by a backward that adds nothing.

    Micro-batches run under ``no_sync`` so that a rank out of memory can drop out of an update
    before any communication (peers would otherwise wait for it in the all-reduce). Once all
    ranks agree the update is good, a one-token batch weighted by zero drives DDP's all-reduce.
    The price is that communication no longer overlaps the last backward pass.
    """
    one = torch.ones(1, 1, dtype=torch.long, device=device)
    first = torch.zeros(1, dtype=torch.long, device=device)
    loss, _ = forward(one * EOS_ID, one == PAD_ID, one * BOS_ID, one * EOS_ID, first)
    (loss * 0.0).backward()


def clip_gradients(model: torch.nn.Module, clip_norm: float) -> Tensor:
    """The gradients' global norm (a device tensor), after clipping them to ``clip_norm`` if it is above 0."""
    parameters = _parameters_with_gradients(model)
    if clip_norm > 0:
        return torch.nn.utils.clip_grad_norm_(parameters, clip_norm)
    return torch.nn.utils.get_total_norm([q.grad for q in parameters])


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, stats: dict, finite: bool) -> dict:
    """Apply the update if its gradients (and, without loss scaling, its loss) are ``finite``, which all ranks
    agree on; ``stats`` with why it was skipped otherwise: fp16 "overflow", which the scaler skips and backs
    off from itself, or "nonfinite"."""
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    elif finite:
        optimizer.step()
    if not finite:
        stats["skipped"] = "overflow" if scaler.is_enabled() else "nonfinite"
    optimizer.zero_grad(set_to_none=True)
    return stats


def _parameters_with_gradients(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [q for q in model.parameters() if q.grad is not None]
