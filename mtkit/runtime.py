"""Process-level choices: seeding, device, precision context and threads."""

from __future__ import annotations

import contextlib
import importlib.util
import random
from pathlib import Path

import torch

from mtkit.errors import MtkitError


class RuntimeSetupError(MtkitError, ValueError):
    """A device or precision that this machine cannot provide."""


def require(module: str, needed_for: str, install: str) -> None:
    """RuntimeSetupError now, before any work, when an optional package is not installed."""
    if importlib.util.find_spec(module) is None:
        raise RuntimeSetupError(f"{needed_for} needs the {module} package: pip install {install}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    """'auto' is cuda when available, else cpu; 'cpu', 'cuda' and 'cuda:N' must exist here.

    Anything else (a typo, or torch's 'meta', which holds no data) is a RuntimeSetupError.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = name.partition(":")
    if name != "cpu" and (kind != "cuda" or (index and not index.isdigit())):
        raise RuntimeSetupError(f"device must be auto, cpu, cuda or cuda:N, got {name[:40]!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeSetupError(f"device {name} requested but torch sees no CUDA device (try --device cpu)")
    if index and int(index) >= torch.cuda.device_count():
        raise RuntimeSetupError(f"device {name} requested but torch sees {torch.cuda.device_count()} CUDA device(s)")
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


def supported_precisions(device: torch.device) -> list[str]:
    """The train/translate precisions that ``compute_dtype`` accepts on ``device``."""
    supported = []
    for name in ("fp32", "bf16", "fp16"):
        try:
            compute_dtype(name, device)
        except RuntimeSetupError:
            continue
        supported.append(name)
    return supported


def _proc_field(path: str, key: str) -> str | None:
    """The value after ``key:`` on the first matching line of a /proc file, if the file is readable."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent: where a not-yet-created run directory will live."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def environment_report(path: Path = Path(".")) -> dict:
    """What a run on this machine will use: torch, devices, precisions, threads, memory, disk at ``path``."""
    import shutil

    import torch.distributed as dist

    from mtkit.launch import allocator_in_use

    flags = set((_proc_field("/proc/cpuinfo", "flags") or "").split())
    mem_kib = _proc_field("/proc/meminfo", "MemAvailable")  # what a new process can use without swapping
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_instructions": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "threads": torch.get_num_threads(),
        "allocator": allocator_in_use(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpus": [
            {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
            for props in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
        ],
        "distributed_backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()},
        "precisions": {
            "cpu": supported_precisions(torch.device("cpu")),
            "cuda": supported_precisions(torch.device("cuda")) if cuda else [],
        },
        "memory_available_gib": round(int(mem_kib.split()[0]) / 2**20, 1) if mem_kib else None,
        "disk_free_gib": round(shutil.disk_usage(_existing_ancestor(path)).free / 2**30, 1),
    }
