"""Process-level choices: seeding, device, precision context and threads."""

from __future__ import annotations

import contextlib
import random

import torch


class RuntimeSetupError(ValueError):
    """A device or precision that this machine cannot provide."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    """'auto' is cuda when available, else cpu; asking for cuda without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeSetupError("device cuda requested but torch sees no CUDA device (try --device cpu)")
    return torch.device(name)


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The matmul dtype of a precision setting; fp16 is GPU-only (it needs loss scaling and fast fp16 units)."""
    if precision == "fp16" and device.type != "cuda":
        raise RuntimeSetupError("precision fp16 needs a CUDA device; use bf16 on CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeSetupError("precision bf16 is not supported by this GPU; use fp16")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision context for the forward pass; a no-op in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
