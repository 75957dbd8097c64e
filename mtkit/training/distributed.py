"""Data-parallel training across processes started by ``torchrun`` (or ``mtkit train --nproc-per-node``).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; ``from_environment`` joins the process group (NCCL
for GPUs, gloo for CPU). Besides the gradient all-reduce that DistributedDataParallel does, ranks
talk through one small gloo "agreement" collective per update (losses, out-of-memory, stop and
non-finite-gradient flags), so every rank takes the same decision. Collectives run with a timeout; when one expires a
second gloo group, kept only for diagnosis, finds out which rank stopped answering.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mtkit.errors import MtkitError

log = logging.getLogger("mtkit")

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class DistributedError(MtkitError, RuntimeError):
    """A collective that failed or timed out; the message names the rank(s) that stopped answering.
    ``main_exited``: rank 0 ended (its connection closed) rather than hung, and says why itself."""

    def __init__(self, message: str, main_exited: bool = False) -> None:
        super().__init__(message)
        self.main_exited = main_exited


# How long a rank that saw rank 0 end waits before ending too, so that torchrun records rank 0's exit status
# (exit 1: it printed why) rather than stopping rank 0 for this rank's failure; torchrun ends the wait.
MAIN_EXIT_GRACE_S = 10.0


@dataclass
class Distributed:
    """This process's place in the job; a single-process run is rank 0 of 1 and never communicates."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float = 1800.0
    agreement: Any = None  # gloo process group for per-update agreement and object exchange
    health: Any = None  # gloo process group used only to diagnose a failed collective

    @property
    def enabled(self) -> bool:
        """Whether this process joined a job (under torchrun, even one of a single rank)."""
        return self.agreement is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, requested: str) -> torch.device | None:
        """This rank's GPU under a multi-process CUDA job; None leaves the choice to ``pick_device``."""
        if self.enabled and requested in ("auto", "cuda") and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return None

    # -- collectives ------------------------------------------------------------------------

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all ranks (float64, on CPU through gloo)."""
        if not self.enabled:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        self._run("all_reduce", dist.all_reduce, tensor, group=self.agreement)
        return tensor.tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        self._run("broadcast", dist.broadcast_object_list, box, src=0, group=self.agreement)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        self._run("gather", dist.gather_object, obj, out, dst=0, group=self.agreement)
        return out

    def barrier(self) -> None:
        if self.enabled:
            self._run("barrier", dist.barrier, group=self.agreement)

    def _run(self, name: str, collective, *args, **kwargs):
        try:
            return collective(*args, **kwargs)
        except RuntimeError as err:
            raise self._diagnose(name, err) from None

    def _diagnose(self, name: str, err: RuntimeError) -> DistributedError:
        """Which rank is to blame: rank 0 learns who missed a monitored barrier; the others blame rank 0."""
        prefix = f"rank {self.rank}: {name} failed after up to {self.timeout_s:g} s (train.ddp_timeout)"
        start = time.monotonic()
        try:
            dist.monitored_barrier(group=self.health, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as barrier_err:
            missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(barrier_err))
            if missing:
                stopped = missing.group(1).strip()
                return DistributedError(f"{prefix}: rank(s) {stopped} stopped responding (hung or dead); stopping")
            if time.monotonic() - start < self.timeout_s / 2:  # its connection closed: it ended, it did not hang
                ended = f"rank {self.rank}: {name} failed: rank 0 has exited (its own message says why); stopping"
                return DistributedError(ended, main_exited=True)
            return DistributedError(f"{prefix}: rank 0 stopped responding (hung or dead); stopping")
        return DistributedError(f"{prefix}: {str(err).splitlines()[0]}")

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in LAUNCH_VARIABLES)


def from_environment(device: str, timeout_s: float) -> Distributed:
    """Join the job torchrun started (NCCL when this rank drives a GPU, else gloo), of one rank too, so that
    ``torchrun --nproc-per-node 1`` runs the code a larger job runs; alone as rank 0 of 1 otherwise."""
    if not launched_by_torchrun():
        return Distributed(timeout_s=timeout_s)
    rank, world, local = (int(os.environ[name]) for name in LAUNCH_VARIABLES)
    _stop_with_launcher()
    use_cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    agreement = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else dist.group.WORLD
    health = dist.new_group(backend="gloo", timeout=timeout)
    log.info("rank %d of %d joined (%s)", rank, world, "nccl" if use_cuda else "gloo")
    return Distributed(rank, world, local, timeout_s, agreement, health)


def _stop_with_launcher() -> None:
    """Ask Linux to send this rank SIGTERM when its launcher dies, so no orphan rank trains on.

    torchrun starts each rank in a session of its own; if torchrun itself is killed, the ranks
    would otherwise keep running. SIGTERM makes them save a checkpoint and exit like Ctrl-C does.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher was already gone before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def torchrun_arguments(nproc_per_node: int, command: list[str]) -> list[str]:
    """Arguments for ``torch.distributed.run`` that start ``python -m mtkit COMMAND`` on this machine."""
    return ["--standalone", f"--nproc-per-node={nproc_per_node}", "-m", "mtkit", *command]
