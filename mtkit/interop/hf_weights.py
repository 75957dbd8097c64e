"""A transformers model's weights file read as untrusted: names and shapes first, tensors only once checked.

model.safetensors has its header read alone, bounded by the number of tensors the model's config.json
describes, and each tensor must lie inside the file's data, so that an importer can compare the names
and shapes with config.json before a tensor is read or a model built; pytorch_model.bin loads with
``weights_only=True``, bounded by the file's size. An importer then takes each tensor by name at the
shape config.json gives it (``take``), and checks the copies older files keep of a tied one (``same_as``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import Tensor

from mtkit import untrusted
from mtkit.hub_folders import WEIGHT_FILES, ModelImportError
from mtkit.model import checkpoint
from mtkit.model.checkpoint import CheckpointError, check_finite

MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own bound on a file's header
# a safetensors header's bytes: 512 for each tensor config.json describes (a name, dtype, shape and offsets take
# about 120), and this much besides (__metadata__)
HEADER_ENTRY_BYTES = 512
HEADER_BYTES = 64 << 10
# safetensors' dtypes and their sizes in bytes: a header's tensors must fit in the file's data
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2}
DTYPE_BYTES |= {"I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass
class WeightsFile:
    """The folder's weights file, with each tensor's shape as its header states it (safetensors), or as torch
    read it (pytorch_model.bin, bounded by the file's size: ``checkpoint.load_torch_file``)."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    loaded: dict[str, Tensor] | None  # pytorch_model.bin's tensors; None for a safetensors file, read later


def open_weights(folder: Path, tensors: int) -> WeightsFile:
    """model.safetensors or else pytorch_model.bin (``weights_only``): names and shapes, only the header read of
    the first, bounded by ``tensors``, the number of tensors the model's config.json allows."""
    path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if path is None:
        raise ModelImportError(f"{folder}: no model.safetensors or pytorch_model.bin")
    if path.suffix == ".safetensors":
        return WeightsFile(path, safetensors_shapes(path, HEADER_BYTES + tensors * HEADER_ENTRY_BYTES), None)
    try:
        weights = checkpoint.load_torch_file(path)
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises several types for truncated or foreign files
        raise ModelImportError(f"{path}: not readable weights ({type(err).__name__})") from None
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in weights.items()
    ):
        raise ModelImportError(f"{path}: must hold a mapping of names to tensors")
    return WeightsFile(path, {key: tuple(tensor.shape) for key, tensor in weights.items()}, weights)


def safetensors_shapes(path: Path, limit: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as a safetensors file's header states it, read alone, its length checked against
    ``limit`` before it is read: the file is neither mapped nor read further. Each tensor's dtype, shape and
    offsets must agree, and the tensors fit in the file's data, so that the sizes config.json is checked against
    are those of the tensors the file holds."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > min(limit, MAX_SAFETENSORS_HEADER):
            raise ModelImportError(
                f"{path}: not readable weights (a safetensors header of {length:,} bytes, more than the "
                f"{min(limit, MAX_SAFETENSORS_HEADER):,} its model's tensors may take)"
            )
        if not 2 <= length <= size - 8:
            raise ModelImportError(f"{path}: not readable weights (a safetensors header of {length:,} bytes)")
        text = f.read(length)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise ModelImportError(f"{path}: not readable weights (its safetensors header is not JSON)") from None
    shapes = {}
    for key, entry in (header if isinstance(header, dict) else {"": None}).items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ModelImportError(f"{path}: not readable weights (no shape for {untrusted.shown(key)} in its header)")
        _check_extent(path, key, entry, shape, size - 8 - length)
        shapes[key] = tuple(shape)
    return shapes


def _check_extent(path: Path, key: str, entry: dict[str, Any], shape: list[int], data_bytes: int) -> None:
    """A safetensors header's tensor ``key`` takes the bytes its dtype and shape give, inside the file's data."""
    dtype = entry.get("dtype")
    itemsize = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
    offsets = entry.get("data_offsets")
    fits = (
        itemsize is not None
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
        and all(n >= 0 for n in shape)
        and 0 <= offsets[0] <= offsets[1] <= data_bytes
        and offsets[1] - offsets[0] == itemsize * math.prod(shape)
    )
    if not fits:
        raise ModelImportError(
            f"{path}: not readable weights (its header states {untrusted.shown(key)} as "
            f"{untrusted.shown(entry.get('dtype'))} {tuple(shape)} at bytes {untrusted.shown(offsets)}, and the file "
            f"holds {data_bytes:,} bytes of tensors)"
        )


def read_weights(weights: WeightsFile) -> dict[str, Tensor]:
    """The tensors, as float32 (fp16 and bf16 widen exactly); each must be floating-point and finite."""
    path = weights.path
    try:
        if weights.loaded is not None:
            tensors = weights.loaded
        else:
            with safetensors.safe_open(path, framework="pt") as f:
                tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises several types for truncated or foreign files
        raise ModelImportError(f"{path}: not readable weights ({type(err).__name__})") from None
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ModelImportError(f"{path}: {key} is {tensor.dtype}, not a floating-point tensor")
    check_finite(tensors, path)
    return {key: tensor.float() for key, tensor in tensors.items()}


def take(weights: dict[str, Tensor], key: str, path: Path, shape: tuple[int, ...]) -> Tensor:
    """``weights[key]``, removed from ``weights``, of the ``shape`` the model's config.json gives it."""
    if key not in weights:
        raise ModelImportError(f"{path}: no {key}")
    tensor = weights.pop(key)
    if tuple(tensor.shape) != shape:
        raise ModelImportError(f"{path}: {key} is {tuple(tensor.shape)}, config.json makes it {shape}")
    return tensor


def same_as(weights: dict[str, Tensor], key: str, expected: Tensor, path: Path) -> None:
    """A copy of a tied tensor that a file stores again (older files do) must be that tensor; removed from
    ``weights``."""
    if key in weights and not torch.equal(weights.pop(key), expected):
        raise ModelImportError(f"{path}: {key} differs from the tensor config.json ties it to")
