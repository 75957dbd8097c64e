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


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what a new process can use without swapping), if readable."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment_report(path: str = ".") -> dict:
    """What a run on this machine will use: torch, devices, precisions, threads, memory, disk at ``path``."""
    import shutil

    import torch.distributed as dist

    flags = _cpu_flags()
    report = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_instructions": "avx512_bf16" in flags or "amx_bf16" in flags,
        "threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gpus": [],
        "distributed_backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()},
        "memory_available_gib": None,
        "disk_free_gib": round(shutil.disk_usage(path).free / 2**30, 1),
    }
    available = _available_memory_bytes()
    if available is not None:
        report["memory_available_gib"] = round(available / 2**30, 1)
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        report["gpus"].append(
            {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "bf16": torch.cuda.is_bf16_supported(),
                "fp16": True,
            }
        )
    report["precisions"] = {
        "cpu": ["fp32", "bf16"],
        "cuda": (["fp32", "bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp32", "fp16"])
        if torch.cuda.is_available()
        else [],
    }
    return report
