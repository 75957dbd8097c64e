"""The adapter file: a LoRA adapter's tensors, and what applying them needs, in one safetensors file.

It holds the adapter's tensors alone (``LAYER.lora.a`` and ``LAYER.lora.b``, mtkit.model.lora) and, in its
header, the entry ``mtkit.adapter``: JSON of its format, ``rank``, ``alpha``, ``targets`` (train.lora's names)
and ``base_sha256``, the digest of the weights of the base model it adapts (``checkpoint.weights_digest``), so
that it is never applied to another. A LoRA run's checkpoints are such files (each one's model.safetensors),
with the run's own header beside (mtkit.model.checkpoint).

An adapter file may come from anyone, so it is read as untrusted, each step before the next: its header alone,
its length bounded by the tensors the base model could have adapters for; the metadata, each value checked; the
base's digest, a mismatch refused in one line naming both files; the tensors' names, dtypes and shapes against
the base's layers; only then the tensors, each finite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
from torch import Tensor

from mtkit import untrusted
from mtkit.config import ConfigError, LoraConfig
from mtkit.files import file_sha256
from mtkit.model.checkpoint import CheckpointError, check_finite
from mtkit.model.lora import expected_tensors, most_tensors
from mtkit.model.transformer import Transformer

ADAPTER_KEY = "mtkit.adapter"  # the header entry that makes a safetensors file an adapter
ADAPTER_FORMAT = 1
# A header's bytes: this much for its metadata (the adapter's record, a LoRA checkpoint's config and records),
# and 512 for each tensor the base could have an adapter tensor for (a name, dtype, shape and offsets take ~150).
HEADER_BYTES = 1 << 20
ENTRY_BYTES = 512
STORED_DTYPE = "F32"  # training keeps adapters in float32, whatever the precision it computes in


@dataclass(frozen=True)
class Adapter:
    """An adapter read from ``path`` and checked against the base it adapts."""

    path: Path
    settings: LoraConfig  # rank, alpha and targets (its dropout, a training setting, is 0)
    tensors: dict[str, Tensor]
    sha256: str  # of the file

    def record(self) -> dict[str, Any]:
        """What an export's manifest and the server's /v1/models say of it: never its path."""
        rank, alpha, targets = self.settings.rank, self.settings.alpha, list(self.settings.targets)
        return {"sha256": self.sha256, "rank": rank, "alpha": alpha, "targets": targets}


def adapter_header(settings: LoraConfig, base_sha256: str) -> dict[str, str]:
    """The header entry of an adapter of ``settings`` on the base whose weights' digest is ``base_sha256``."""
    record = {
        "format": ADAPTER_FORMAT,
        "rank": settings.rank,
        "alpha": settings.alpha,
        "targets": list(settings.targets),
        "base_sha256": base_sha256,
    }
    return {ADAPTER_KEY: json.dumps(record)}


def read_adapter(path: Path, model: Transformer, base_sha256: str, base: Path) -> Adapter:
    """The adapter in the file ``path``, checked to adapt ``model``, read from ``base`` with the weights digest
    ``base_sha256``: CheckpointError, in one line naming the file, for anything else (see the module)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: adapter not found")
    header = _header(path, HEADER_BYTES + ENTRY_BYTES * most_tensors(model))
    settings, recorded = _metadata(path, header)
    if recorded != base_sha256:
        raise CheckpointError(
            f"{path}: adapts another base model than {base} (its base's weights digest {recorded[:12]}, that "
            f"model's {base_sha256[:12]})"
        )
    try:
        expected = expected_tensors(model, settings)
    except ConfigError as err:
        raise CheckpointError(f"{path}: malformed adapter metadata: {err}") from None
    _check_layout(path, header, expected)
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in expected}
    except Exception as err:  # safetensors raises several types for a truncated or inconsistent file
        raise CheckpointError(f"{path}: not a readable adapter ({type(err).__name__})") from None
    check_finite(tensors, path)
    return Adapter(path, settings, tensors, file_sha256(path))


def _header(path: Path, limit: int) -> dict[str, Any]:
    """The safetensors header of ``path``, read alone once its length is known to be at most ``limit``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > limit:
            raise CheckpointError(
                f"{path}: refused: a header of {length:,} bytes, more than the {limit:,} an adapter of this base "
                "model may take"
            )
        if size < 8 or not 2 <= length <= size - 8:
            raise CheckpointError(f"{path}: not a readable adapter (a safetensors header of {length:,} bytes)")
        text = f.read(length)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):  # JSON, UTF-8 or nesting
        raise CheckpointError(f"{path}: not a readable adapter (its safetensors header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable adapter (its safetensors header is not a mapping)")
    return header


def _metadata(path: Path, header: dict[str, Any]) -> tuple[LoraConfig, str]:
    """The adapter's settings and its base's weights digest, from the header's ``ADAPTER_KEY`` entry."""
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or not isinstance(metadata.get(ADAPTER_KEY), str):
        raise CheckpointError(f"{path}: not an mtkit adapter (no {ADAPTER_KEY!r} entry in its header)")
    try:
        try:
            record = json.loads(metadata[ADAPTER_KEY])
        except (ValueError, RecursionError):
            raise untrusted.Malformed(f"{ADAPTER_KEY} is not JSON") from None
        keys = ("format", "rank", "alpha", "targets", "base_sha256")
        record = untrusted.mapping(record, ADAPTER_KEY, required=keys, optional=())
        if record["format"] != ADAPTER_FORMAT:
            raise untrusted.Malformed(f"format {untrusted.shown(record['format'])} is not {ADAPTER_FORMAT}")
        rank = untrusted.integer(record["rank"], "rank", low=1)
        alpha = untrusted.number(record["alpha"], "alpha")
        targets = tuple(untrusted.strings(record["targets"], "targets"))
        settings = LoraConfig(rank=rank, alpha=alpha, targets=targets)
        return settings, untrusted.sha256(record["base_sha256"], "base_sha256")
    except (untrusted.Malformed, ConfigError) as err:
        raise CheckpointError(f"{path}: malformed adapter metadata: {err}") from None


def _check_layout(path: Path, header: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """The header's tensors are exactly ``expected``'s names, each float32 of its shape."""
    stored = {name: entry for name, entry in header.items() if name != "__metadata__"}
    missing = [name for name in expected if name not in stored]
    extra = [name for name in stored if name not in expected]
    if missing or extra:
        named = [*(f"no {name}" for name in missing[:3]), *(f"an extra {untrusted.shown(name)}" for name in extra[:3])]
        raise CheckpointError(f"{path}: its tensors are not those its metadata says it adapts ({', '.join(named)})")
    for name, shape in expected.items():
        entry = stored[name]
        found = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if found != list(shape) or dtype != STORED_DTYPE:
            raise CheckpointError(
                f"{path}: {name} is {untrusted.shown(dtype)} {untrusted.shown(found)} there; this base model's "
                f"adapter of its rank needs {STORED_DTYPE} {list(shape)}"
            )
