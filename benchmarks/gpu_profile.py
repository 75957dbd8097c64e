"""Where a GPU's time goes in bf16 training, from torch.profiler over the loop ``mtkit train`` runs.

One process trains a preset (transformer-base by default) on the Multi30k pairs in 25,000-token
batches through ``Trainer.run()``, and measures at update boundaries, after a few warm-up updates:

1. ``attention_kernels``: a few updates under torch.profiler with CUDA activity, each attention
   module's forward marked by kind: encoder self-attention (a padding mask), decoder
   self-attention (causal), cross-attention (a padding mask). Per kind, the attention operators
   that ran (SDPA's backend op says which kernel family PyTorch chose) and the kernels they
   launched, forward and backward (a backward matched to its forward by autograd sequence
   number), with calls and GPU time. Over the whole window, every kernel whose name is an
   attention kernel's (flash, efficient/mem_eff/cutlass/fmha, cudnn, softmax, bmm), and the
   Adam step: one fused operator (``_fused_adam_``) launching fused kernels, or one per tensor.
2. ``gpu_idle``: more updates under the profiler: the GPU's busy time (the union of its kernels,
   copies and fills) against the same updates' wall time, idle share = 1 - busy / wall; then as
   many updates without the profiler, whose wall time shows how much of the idle share is the
   profiler's own host overhead.

Each measurement goes to OUT/gpu_check.json and as lines of OUT/summary.txt as soon as it ends.
``--device cpu`` runs the same code on a CPU, where CPU operators stand in for kernels: a check
of the script, not a measurement.

Usage, from the repository root::

    python benchmarks/gpu_profile.py --tokenizer SPM.model --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gpu_check import note, record
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from train_throughput import MULTI30K, bench_config, synchronize

MARK = "mtkit-profile: "  # the prefix of the ranges that mark each attention module's forward
ATTENTION_KINDS = ("encoder self-attention", "decoder self-attention", "cross-attention")
MASKS = {
    "encoder self-attention": "padding mask",
    "decoder self-attention": "causal",
    "cross-attention": "padding mask",
}
# Operator names of attention: SDPA and its backends, and the products and softmax of the math path.
ATTENTION_OPS = ("scaled_dot_product", "attention", "bmm", "softmax")
ATTENTION_KERNELS = ("flash", "efficient", "mem_eff", "cutlass", "fmha", "cudnn", "sdpa", "attention", "softmax", "bmm")
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # device activities that keep the GPU busy


# -- which kind of attention a module is, and marking its forward -----------------------------


def attention_kind(module_name: str) -> str | None:
    """The kind of attention of the module named ``module_name`` in the model, None for other modules."""
    if module_name.endswith("cross_attn"):
        return "cross-attention"
    if module_name.endswith("self_attn"):
        return "encoder self-attention" if module_name.startswith("encoder") else "decoder self-attention"
    return None


@contextlib.contextmanager
def marked_attention(model: torch.nn.Module) -> Iterator[None]:
    """Each attention module's forward inside a profiler range named ``MARK + kind`` while this is open."""
    open_ranges: list[record_function] = []
    handles = []
    for name, module in model.named_modules():
        kind = attention_kind(name)
        if kind is None:
            continue

        def enter(_module, _args, label: str = MARK + kind) -> None:
            mark = record_function(label)
            mark.__enter__()
            open_ranges.append(mark)

        def leave(_module, _args, _output) -> None:
            open_ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# -- reading a profile -------------------------------------------------------------------------


@dataclass
class Tally:
    """Calls and GPU time by name."""

    calls: Counter = field(default_factory=Counter)
    micros: Counter = field(default_factory=Counter)

    def add(self, name: str, micros: float = 0.0) -> None:
        self.calls[name] += 1
        self.micros[name] += micros

    def table(self, per: int = 1) -> dict[str, dict]:
        """Name -> calls and GPU milliseconds, each divided by ``per`` (updates), most time first."""
        order = sorted(self.calls, key=lambda n: (-self.micros[n], n))
        return {n: {"calls": self.calls[n] / per, "gpu_ms": self.micros[n] / per / 1000} for n in order}


def subtree(event) -> Iterator:
    """``event`` and every operator under it on its thread."""
    yield event
    for child in event.cpu_children:
        yield from subtree(child)


def is_attention_op(name: str) -> bool:
    return name.startswith("aten::") and any(part in name.lower() for part in ATTENTION_OPS)


def attention_by_kind(events, updates: int) -> dict[str, dict]:
    """Per kind of attention: the attention operators in its marked forwards and in their backwards, and the
    kernels those launched, per update."""
    forward_of: dict[tuple[int, int], str] = {}  # (sequence number, thread) of a forward op -> its kind
    found = {
        kind: {part: Tally() for part in ("forward_ops", "forward_kernels", "backward_ops", "backward_kernels")}
        for kind in ATTENTION_KINDS
    }
    for event in events:
        if not event.name.startswith(MARK) or event.device_type != DeviceType.CPU:
            continue
        kind = event.name.removeprefix(MARK)
        for op in (op for child in event.cpu_children for op in _outermost_attention_ops(child)):
            for inner in subtree(op):
                if is_attention_op(inner.name):  # SDPA, then the backend it dispatched to
                    found[kind]["forward_ops"].add(inner.name)
                if inner.sequence_nr >= 0:
                    forward_of[(inner.sequence_nr, inner.thread)] = kind
                for kernel in inner.kernels:
                    found[kind]["forward_kernels"].add(kernel.name, kernel.duration)
    for event in events:
        if not event.name.startswith("autograd::engine::evaluate_function: "):
            continue
        kind = forward_of.get((event.sequence_nr, event.fwd_thread))
        if kind is None:
            continue
        found[kind]["backward_ops"].add(event.name.removeprefix("autograd::engine::evaluate_function: "))
        for inner in subtree(event):
            for kernel in inner.kernels:
                found[kind]["backward_kernels"].add(kernel.name, kernel.duration)
    return {kind: {part: tally.table(updates) for part, tally in parts.items()} for kind, parts in found.items()}


def _outermost_attention_ops(event) -> Iterator:
    """The attention operators under ``event`` that are not inside another one."""
    if is_attention_op(event.name):
        yield event
        return
    for child in event.cpu_children:
        yield from _outermost_attention_ops(child)


def activity(event) -> str:
    """What a profiler event records: "kernel", "gpu_memcpy", "cpu_op", ... (a torch without the accessor: kernel
    for device events, cpu_op for the others)."""
    if hasattr(event, "activity_type"):
        return event.activity_type()
    return "kernel" if event.device_type() == DeviceType.CUDA else "cpu_op"


def device_work(kineto_events) -> Iterator:
    """The events of work on a GPU: kernels, copies and fills (not annotations projected onto its timeline)."""
    for event in kineto_events:
        if event.device_type() == DeviceType.CUDA and activity(event) in DEVICE_WORK:
            yield event


def busy_micros(kineto_events) -> float:
    """Microseconds in which the GPU ran at least one kernel, copy or fill: the union of their intervals."""
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in device_work(kineto_events))
    busy, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1000


def adam_step(events, kineto_events, updates: int) -> dict:
    """What the optimizer's step ran: fused (``_fused_adam_``) or not, its kernels and their time."""
    ops = Tally()
    for event in events:
        name = event.name.lower()
        if event.device_type == DeviceType.CPU and "adam" in name and name.startswith("aten::"):
            ops.add(event.name)
    kernels = Tally()
    for event in device_work(kineto_events):
        if _fused_adam(event.name()):
            kernels.add(event.name(), event.duration_ns() / 1000)
    fused_ops = sum(n for name, n in ops.calls.items() if _fused_adam(name))
    return {
        "fused": fused_ops > 0,
        "fused_adam_ops_per_update": fused_ops / updates,
        "adam_ops": ops.table(updates),
        "fused_adam_kernels": kernels.table(updates),
    }


def _fused_adam(name: str) -> bool:
    """Whether ``name`` is the fused Adam step's: the operator ``_fused_adam_`` or its kernel (FusedAdam...)."""
    return "fusedadam" in name.lower().replace("_", "")


def matching_kernels(kineto_events, updates: int) -> dict[str, dict]:
    """Every GPU kernel whose name is an attention kernel's, per update (CPU operators with ``--device cpu``)."""
    found = Tally()
    for event in kineto_events:
        on_gpu = event.device_type() == DeviceType.CUDA and activity(event) == "kernel"
        on_cpu = event.device_type() == DeviceType.CPU and activity(event) == "cpu_op"
        name = event.name()
        if (on_gpu or on_cpu) and not name.startswith(MARK) and any(p in name.lower() for p in ATTENTION_KERNELS):
            found.add(name, event.duration_ns() / 1000 if on_gpu else 0.0)
    return found.table(updates)


# -- the measurements, each over consecutive updates of Trainer.run() --------------------------


class Window:
    """Consecutive updates measured together: ``begin`` before the first, ``end`` with their wall seconds after
    the last."""

    name: str
    updates: int

    def begin(self) -> None:
        """Start measuring."""

    def end(self, seconds: float) -> None:
        """Stop measuring and record what was measured."""


class Warmup(Window):
    name = "warmup"

    def __init__(self, updates: int) -> None:
        self.updates = updates

    def end(self, seconds: float) -> None:
        print(f"gpu_profile: {self.updates} warm-up updates in {seconds:.2f} s", flush=True)


class KernelWindow(Window):
    """Step 1: which attention kernels and which Adam step run."""

    name = "attention_kernels"

    def __init__(self, out: Path, model: torch.nn.Module, updates: int, device: str) -> None:
        self.out, self.model, self.updates, self.device = out, model, updates, device
        self._stack = contextlib.ExitStack()

    def begin(self) -> None:
        self.profiler = self._stack.enter_context(profile(activities=activities(self.device)))
        self._stack.enter_context(marked_attention(self.model))

    def end(self, seconds: float) -> None:
        self._stack.close()
        events, raw = self.profiler.events(), self.profiler.profiler.kineto_results.events()
        by_kind = attention_by_kind(events, self.updates)
        adam = adam_step(events, raw, self.updates)
        record(
            self.out,
            "attention_kernels",
            {
                "updates": self.updates,
                "per_update": True,
                "by_kind": by_kind,
                "matching_kernels": matching_kernels(raw, self.updates),
                "adam": adam,
            },
        )
        for kind, parts in by_kind.items():
            note(self.out, f"attention kernels, {kind} ({MASKS[kind]}), per update: {describe(parts)}")
        kernels = adam["fused_adam_kernels"]
        launches = sum(k["calls"] for k in kernels.values())
        time_ms = sum(k["gpu_ms"] for k in kernels.values())
        verdict = "fused" if adam["fused"] else "NOT fused"
        note(
            self.out,
            f"adam step: {verdict}, {adam['fused_adam_ops_per_update']:g} _fused_adam_ call(s) per update, "
            f"{launches:g} fused_adam kernel launch(es), {time_ms:.2f} ms GPU per update"
            + (f" ({short(next(iter(kernels)))})" if kernels else ""),
        )


class IdleWindow(Window):
    """Step 2: the GPU's busy time against wall time, under the profiler."""

    name = "gpu_idle"
    figures: dict | None = None

    def __init__(self, out: Path, updates: int, device: str, label: str) -> None:
        self.out, self.updates, self.device, self.label = out, updates, device, label

    def begin(self) -> None:
        self.profiler = profile(activities=activities(self.device))
        self.profiler.start()

    def end(self, seconds: float) -> None:
        self.profiler.stop()
        raw = self.profiler.profiler.kineto_results.events()
        work = list(device_work(raw))
        busy = busy_micros(work) / 1e6
        self.figures = {
            "updates": self.updates,
            "wall_s_profiled": seconds,
            "gpu_busy_s": busy,
            "gpu_kernel_sum_s": sum(e.duration_ns() for e in work if activity(e) == "kernel") / 1e9,
            "device_work_per_update": len(work) / self.updates,
            "idle_share_profiled": 1 - busy / seconds,
        }
        record(self.out, "gpu_idle", self.figures)
        note(
            self.out,
            f"gpu idle share, {self.label}: {self.figures['idle_share_profiled']:.1%} under the profiler "
            f"(GPU busy {busy:.3f} s of {seconds:.3f} s wall over {self.updates} updates, "
            f"{self.figures['device_work_per_update']:.0f} kernels/copies per update)",
        )


class PlainWindow(Window):
    """The same number of updates without the profiler: the wall time the idle share is also given against."""

    name = "gpu_idle_unprofiled"

    def __init__(self, out: Path, idle: IdleWindow) -> None:
        self.out, self.idle, self.updates = out, idle, idle.updates

    def end(self, seconds: float) -> None:
        figures = self.idle.figures
        if figures is None:
            raise RuntimeError("the profiled window recorded nothing to compare with")
        figures.update(wall_s_unprofiled=seconds, idle_share_unprofiled=1 - figures["gpu_busy_s"] / seconds)
        record(self.out, "gpu_idle", figures)
        note(
            self.out,
            f"gpu idle share, {self.idle.label}: {figures['idle_share_unprofiled']:.1%} against the wall time of "
            f"{self.updates} updates without the profiler ({seconds:.3f} s; {self.updates / seconds:.2f} updates/s)",
        )


def activities(device: str) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def describe(parts: dict[str, dict]) -> str:
    """One kind's forward and backward: its operators, then its kernels with calls and GPU time."""
    text = []
    for direction in ("forward", "backward"):
        ops = ", ".join(f"{short(n)} x{v['calls']:g}" for n, v in parts[f"{direction}_ops"].items()) or "none"
        kernels = ", ".join(
            f"{short(n)} x{v['calls']:g} {v['gpu_ms']:.2f} ms" for n, v in parts[f"{direction}_kernels"].items()
        )
        text.append(f"{direction} {ops}" + (f" -> {kernels}" if kernels else ""))
    return "; ".join(text)


def short(name: str, width: int = 90) -> str:
    """A kernel's name cut to ``width`` characters (template arguments make some a few thousand long)."""
    return name if len(name) <= width else name[: width - 3] + "..."


class _WindowsDone(Exception):
    """Raised from the last measured update: ``Trainer.run()`` ends there, without a final checkpoint."""


def run_windows(out: Path, trainer, windows: list[Window], device: str) -> None:
    """Train with ``trainer.run()`` until every window has run, each over the next ``updates`` updates. A window
    whose figures cannot be read is recorded as failed, and the next one still runs."""
    step = trainer.train_step
    plan = iter(windows)
    current, left, finished, clock = windows[0], 0, 0, 0.0

    def measured_step(batches, group_tokens):  # the loop calls this once per update
        nonlocal current, left, finished, clock
        if left == 0:
            current = next(plan)
            left = current.updates
            synchronize(device)
            current.begin()
            clock = time.perf_counter()
        stats = step(batches, group_tokens)
        left -= 1
        if left == 0:
            synchronize(device)
            seconds = time.perf_counter() - clock
            try:
                current.end(seconds)
            except Exception as err:  # report and go on: the next window still measures something
                record(out, f"{current.name}_failed", f"{type(err).__name__}: {err}")
                note(out, f"{current.name}: failed ({type(err).__name__}: {err})")
            finished += 1
            if finished == len(windows):
                raise _WindowsDone
        return stats

    trainer.train_step = measured_step
    try:
        trainer.run()
    except _WindowsDone:
        pass


def main(argv: list[str] | None = None) -> None:
    from mtkit.runtime import set_threads
    from mtkit.training.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="a joint SentencePiece model")
    p.add_argument("--out", type=Path, required=True, help="gpu_check.json and summary.txt go here")
    p.add_argument("--src", type=Path, default=MULTI30K / "train.en.gz")
    p.add_argument("--tgt", type=Path, default=MULTI30K / "train.de.gz")
    p.add_argument("--preset", default="transformer-base")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--batch-tokens", type=int, default=25_000)
    p.add_argument("--warmup", type=int, default=5, help="updates before anything is measured")
    p.add_argument("--kernel-updates", type=int, default=3, help="updates profiled for step 1")
    p.add_argument("--idle-updates", type=int, default=20, help="updates profiled for step 2, then as many without")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    set_threads(0)
    cfg = bench_config(
        args.src,
        args.tgt,
        args.tokenizer,
        args.precision,
        threads=0,
        preset=args.preset,
        batch_tokens=args.batch_tokens,
        device=args.device,
    )
    trainer = Trainer(cfg, out / "profile_run", restart=True)
    label = f"{args.preset} {args.precision}, {args.batch_tokens:,}-token batches"
    idle = IdleWindow(out, args.idle_updates, args.device, label)
    windows: list[Window] = [
        Warmup(args.warmup),
        KernelWindow(out, trainer.model, args.kernel_updates, args.device),
        idle,
        PlainWindow(out, idle),
    ]
    run_windows(out, trainer, [w for w in windows if w.updates > 0], args.device)


if __name__ == "__main__":
    main()
