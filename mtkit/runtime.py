"""Process-level choices: seeding, device, precision context and threads."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from mtkit.errors import MtkitError

log = logging.getLogger("mtkit")


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
    """Run torch's operations on ``threads`` CPU threads (0 keeps torch's default: OMP_NUM_THREADS where set, else
    one per core), so that processes sharing a machine do not each take every core. torch's inter-op pool, which
    mtkit does not use, is left alone: it can be sized only once in a process, which is the caller's to choose."""
    if threads > 0:
        torch.set_num_threads(threads)


# The CPU features (as /proc/cpuinfo names them) with which oneDNN computes bf16 matrix products in bf16, by CPU
# architecture: x86's AVX-512 and AMX instructions (its ``flags`` line), 64-bit Arm's BF16 extension (its
# ``Features`` line: Neoverse V1 and N2 on, AWS Graviton3 on). Without one, bf16 is emulated through fp32 arithmetic
# and runs several times slower than fp32 itself.
NATIVE_BF16_CPU_FEATURES = {
    "x86": {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"},
    "arm": {"bf16": "Arm BF16"},
}
ARM_CPU_FEATURE = "asimd"  # Advanced SIMD: every 64-bit Arm CPU lists it, no x86 CPU does
CpuArchitecture = Literal["x86", "arm"]
# The x86 CPU features with which int8 matrix products run as int8 dot products (oneDNN's VNNI and AMX kernels).
INT8_CPU_FEATURES = {"amx_int8": "AMX-INT8", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI"}
# Without them, AVX2 multiplies int8 in pairs summed in int16: int8's "pairs" kernel (mtkit.model.quantization).
INT8_PAIRS_CPU_FEATURE = "avx2"
Int8Kernel = Literal["dot", "pairs"]
# Where ATen's own fp32 matrix products (MKL) run at full speed: Intel's x86 CPUs. On other x86 CPUs MKL takes a
# slower path, and decoding's product with the vocabulary goes through oneDNN instead (``fp32_vocabulary_gemm``).
MKL_CPU_VENDORS = {"GenuineIntel"}
# Output weights (vocabulary x width) from which oneDNN's product is the faster at any number of rows: below, its
# fixed cost of some 30 us a call outweighs what it saves at one row (docs/benchmarks.md).
ONEDNN_MIN_WEIGHTS = 2**19
Gemm = Literal["aten", "onednn"]
# What each precision computes in; int8's layers other than the linear ones (attention, norms) stay float32.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}


def cpu_architecture(cpu_features: set[str]) -> CpuArchitecture:
    """The architecture of a CPU with these features: ``arm`` where they are 64-bit Arm's, else ``x86``."""
    return "arm" if ARM_CPU_FEATURE in cpu_features else "x86"


def native_bf16(cpu_features: set[str]) -> list[str]:
    """The native-bf16 features among ``cpu_features``, by their usual names ("AVX512-BF16", "Arm BF16")."""
    features = NATIVE_BF16_CPU_FEATURES[cpu_architecture(cpu_features)]
    return [name for feature, name in features.items() if feature in cpu_features]


def wanted_for_bf16(cpu_features: set[str]) -> str:
    """The features that would make bf16 native on a CPU with these features, in words ("AVX512-BF16 or AMX-BF16");
    every architecture's where the list is empty (no /proc/cpuinfo), as the architecture is then unknown."""
    if cpu_features:
        names = list(NATIVE_BF16_CPU_FEATURES[cpu_architecture(cpu_features)].values())
    else:
        names = [name for features in NATIVE_BF16_CPU_FEATURES.values() for name in features.values()]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def int8_kernel(cpu_features: set[str]) -> Int8Kernel:
    """The kernel that computes int8 products fastest on a CPU with these features: ``dot`` where it has int8 dot
    products (or nothing better), ``pairs`` where AVX2 alone multiplies int8 (mtkit.model.quantization)."""
    dot_products = any(feature in cpu_features for feature in INT8_CPU_FEATURES)
    return "pairs" if INT8_PAIRS_CPU_FEATURE in cpu_features and not dot_products else "dot"


def fp32_vocabulary_gemm(cpu_vendor: str | None) -> Gemm:
    """The library that multiplies decoding's fp32 features by the output weights on a CPU from ``cpu_vendor``.

    ``onednn`` (oneDNN over weights packed once, as CTranslate2 also takes oneDNN rather than MKL on CPUs not made
    by Intel) on an x86 CPU of another vendor, where it measured 1.2-5.9x faster than ATen's product at 1 to 640
    rows (docs/benchmarks.md); ``aten`` on Intel's CPUs, where MKL was as fast or faster at 1 and at 640 rows
    (oneDNN won only at a few rows between), and where the vendor is unknown (no /proc/cpuinfo, or a CPU that is not
    x86) or this torch has no oneDNN.
    """
    if cpu_vendor is None or cpu_vendor in MKL_CPU_VENDORS or not torch.backends.mkldnn.is_available():
        return "aten"
    return "onednn"


def bf16_decoding_gemm(cpu_vendor: str | None, features: set[str]) -> Gemm:
    """The library that multiplies decoding's bf16 activations by a bf16 model's weights, in every linear layer, on a
    CPU from ``cpu_vendor`` with these ``features``.

    ATen's bf16 product on a CPU is oneDNN's too, but it lays the weights out for oneDNN again at every call.
    ``onednn`` (over a copy packed once) on an x86 CPU with native bf16 (``native_bf16``) not made by Intel, where it
    measured 1.1-2.9x faster than ATen's product at 1 to 640 rows for every layer shape of transformer-small and the
    students, the output projection included (AMD EPYC with AVX512-BF16, docs/benchmarks.md); ``aten`` on Intel's
    CPUs, where it has not been measured, on CPUs that emulate bf16, and where the vendor is unknown or this torch
    has no oneDNN.
    """
    return fp32_vocabulary_gemm(cpu_vendor) if native_bf16(features) else "aten"


@dataclass(frozen=True)
class PrecisionChoice:
    """The number format a run computes in, and why: what a precision setting (``auto`` included) came to on
    one device."""

    precision: str  # fp32, bf16 or fp16
    reason: str  # in words, for logs and reports: "auto: this CPU has AVX512-BF16"
    native: bool = True  # False: bf16 asked for on a CPU that only emulates it, int8 on one without VNNI, AMX or AVX2

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def __str__(self) -> str:
        return f"{self.precision} ({self.reason})"

    def to_dict(self) -> dict[str, str]:
        return {"precision": self.precision, "reason": self.reason}


NATIVE_BF16_GPU = (8, 0)  # the CUDA compute capability from which GPUs have bf16 units (Ampere: A100 and later)


def choose_precision(
    asked: str, device_type: str, cpu_features: set[str], gpu_capability: tuple[int, int] | None = None
) -> PrecisionChoice:
    """What the setting ``asked`` (auto, fp32, bf16 or fp16) means on a device with these features: the CPU's
    /proc/cpuinfo flags, and a GPU's CUDA compute capability.

    A function of the features alone, so that every machine's choice can be tested on any machine: ``auto`` is
    bf16 where the device computes it natively (a GPU from Ampere on; an x86 CPU with AVX512-BF16 or AMX-BF16, an
    Arm CPU with BF16), fp32 elsewhere; fp16 only when asked for, and only on CUDA, where it has fast units and the
    trainer scales the loss. An explicit bf16 where it is emulated runs, marked not ``native``.
    """
    if asked == "fp16":
        if device_type != "cuda":
            raise RuntimeSetupError("precision fp16 needs a CUDA device; use bf16 or auto on CPU")
        return PrecisionChoice("fp16", "asked for")
    if asked == "fp32":
        return PrecisionChoice("fp32", "asked for")
    if asked == "int8":
        if device_type != "cpu":
            raise RuntimeSetupError("precision int8 runs on the CPU; use bf16 or fp16 on a GPU")
        if found := [name for feature, name in INT8_CPU_FEATURES.items() if feature in cpu_features]:
            return PrecisionChoice("int8", f"asked for; int8 products on {' and '.join(found)}")
        if int8_kernel(cpu_features) == "pairs":
            return PrecisionChoice("int8", "asked for; int8 products in pairs on AVX2, with 7-bit weights")
        wanted = " or ".join([*INT8_CPU_FEATURES.values(), INT8_PAIRS_CPU_FEATURE.upper()])
        slow = f"asked for; this CPU has no {wanted}: int8 products run several times slower than fp32"
        return PrecisionChoice("int8", slow, False)
    if device_type == "cuda":
        native = gpu_capability is not None and tuple(gpu_capability) >= NATIVE_BF16_GPU
        capability = ".".join(map(str, gpu_capability or ()))
        if asked == "bf16":
            if native:
                return PrecisionChoice("bf16", "asked for")
            return PrecisionChoice("bf16", f"asked for; emulated on a GPU of compute capability {capability}", False)
        if native:
            return PrecisionChoice("bf16", f"auto: this GPU (compute capability {capability}) has bf16 units")
        return PrecisionChoice("fp32", f"auto: this GPU (compute capability {capability}) has no bf16 units")
    found, wanted = native_bf16(cpu_features), wanted_for_bf16(cpu_features)
    if asked == "bf16":
        if cpu_features and not found:
            return PrecisionChoice("bf16", f"asked for; emulated, as this CPU has no {wanted}", native=False)
        return PrecisionChoice("bf16", "asked for")
    if found:
        return PrecisionChoice("bf16", f"auto: this CPU has {' and '.join(found)}")
    if not cpu_features:
        return PrecisionChoice("fp32", f"auto: no CPU feature list (/proc/cpuinfo) to find {wanted} in")
    return PrecisionChoice("fp32", f"auto: this CPU has no {wanted}, so bf16 would be emulated")


_warned: set[str] = set()  # the warnings given once per process


def resolve_precision(asked: str, device: torch.device) -> PrecisionChoice:
    """``choose_precision`` on this machine's ``device``; an emulated bf16, or int8 without a fast int8 kernel, is
    warned about once per process."""
    choice = choose_precision(asked, device.type, cpu_features(), gpu_capability(device))
    if not choice.native and choice.reason not in _warned:
        _warned.add(choice.reason)
        if choice.precision == "bf16":
            log.warning("precision bf16 %s: several times slower than fp32 here (auto picks fp32)", choice.reason)
        else:
            log.warning("precision %s %s", choice.precision, choice.reason)
    return choice


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None for a CPU."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo; empty where that file is missing."""
    return read_cpu_features("/proc/cpuinfo")


def read_cpu_features(cpuinfo: str) -> frozenset[str]:
    """The features a /proc/cpuinfo file lists: x86 Linux writes them as ``flags``, 64-bit Arm Linux as ``Features``."""
    return frozenset((_proc_field(cpuinfo, "flags") or _proc_field(cpuinfo, "Features") or "").split())


@functools.cache
def cpu_vendor() -> str | None:
    """The x86 CPU's vendor as /proc/cpuinfo gives it ("GenuineIntel", "AuthenticAMD"); None where it is not listed."""
    return _proc_field("/proc/cpuinfo", "vendor_id")


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it, else the platform's processor name."""
    import platform

    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine() or "unknown CPU"


def hardware(device: torch.device) -> str:
    """The machine in a few words, for logs and reports: the GPU's name, or the CPU's name and its bf16 support."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    found = native_bf16(cpu_features())
    bf16 = f"native bf16: {' and '.join(found)}" if found else "no native bf16"
    return f"{cpu_name()} ({torch.get_num_threads()} threads, {bf16})"


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision context for the forward pass; a no-op in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def supported_precisions(device: torch.device) -> list[str]:
    """The train/translate precisions that run on ``device`` (bf16 included where it is emulated)."""
    supported = []
    for name in ("fp32", "bf16", "fp16"):
        try:
            choose_precision(name, device.type, cpu_features(), gpu_capability(device))
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


def allocator_in_use() -> str:
    """Which allocator this process runs under: "mimalloc" (which the mtkit command preloads) or "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def environment_report(path: Path = Path(".")) -> dict:
    """What a run on this machine will use: torch, devices, precisions, threads, memory, disk at ``path``."""
    import shutil

    import torch.distributed as dist

    mem_kib = _proc_field("/proc/meminfo", "MemAvailable")  # what a new process can use without swapping
    cuda = torch.cuda.is_available()
    disk = _existing_ancestor(path)
    return {
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_instructions": bool(native_bf16(cpu_features())),
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
        "auto_precision": {
            name: choose_precision("auto", name, cpu_features(), gpu_capability(torch.device(name))).to_dict()
            for name in ("cpu", *(["cuda"] if cuda else []))
        },
        "int8_decoding": choose_precision("int8", "cpu", cpu_features()).to_dict(),
        "fp32_vocabulary_gemm": fp32_vocabulary_gemm(cpu_vendor()),
        "bf16_decoding_gemm": bf16_decoding_gemm(cpu_vendor(), cpu_features()),
        "memory_available_gib": round(int(mem_kib.split()[0]) / 2**20, 1) if mem_kib else None,
        "disk_free_gib": round(shutil.disk_usage(disk).free / 2**30, 1),
        "disk_path": str(disk),  # where disk_free_gib was measured: ``path``, or its nearest existing parent
    }
