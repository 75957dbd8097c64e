"""Dynamic batching: the sentences of concurrent requests searched together, one batch at a time.

A search costs about as much for 32 sentences as for one on a CPU or GPU that would otherwise sit
half idle, so the server gathers the sentences of requests that arrive together into one batch. One
worker thread runs every batch, so the model is never used by two threads at once. Requests whose
options differ (another beam) cannot share a search, so each batch holds requests of one set of
options; of the groups ready (full, or waited long enough), the one with the oldest request goes
first, and a full group never waits behind one still gathering.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger("mtkit")

Result = TypeVar("Result")


class Refused(RuntimeError):
    """The batcher takes no more work now: its queue is full, or it is closing."""


@dataclass
class _Job(Generic[Result]):
    lines: list[str]
    options: Hashable
    queued_at: float = field(default_factory=time.monotonic)
    future: Future[list[Result]] = field(default_factory=Future)


class Batcher(Generic[Result]):
    """Runs ``translate(lines, options)`` on batches of at most ``max_batch_size`` sentences gathered from
    the jobs submitted, each batch waiting at most ``max_wait_s`` after its oldest job arrived.

    ``translate`` returns one result per line; each job's future gets those of its own lines, in order,
    or the exception translating them raised (no other job's). A job of more than ``max_batch_size``
    sentences is a batch of its own, never split.
    """

    def __init__(
        self,
        translate: Callable[[list[str], Hashable], list[Result]],
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
    ) -> None:
        self.translate = translate
        self.max_batch_size, self.max_wait_s, self.max_queue = max_batch_size, max_wait_s, max_queue
        self._jobs: deque[_Job[Result]] = deque()
        self._waiting = 0  # sentences in self._jobs
        self._closing = False
        self._changed = threading.Condition()
        self._worker = threading.Thread(target=self._run, name="mtkit-batcher", daemon=True)

    def start(self) -> None:
        self._worker.start()

    def submit(self, lines: list[str], options: Hashable) -> Future[list[Result]]:
        """Queue ``lines`` for translation with ``options``; cancelling the future before its batch starts
        withdraws them. Raises ``Refused`` when the queue would hold more than ``max_queue`` sentences."""
        with self._changed:
            if self._closing:
                raise Refused("the server is shutting down")
            if self._waiting + len(lines) > self.max_queue:
                raise Refused(f"{self._waiting:,} sentences are waiting already (at most {self.max_queue:,})")
            job: _Job[Result] = _Job(lines, options)
            self._jobs.append(job)
            self._waiting += len(lines)
            log.debug("queued %d sentences (%d waiting)", len(lines), self._waiting)
            self._changed.notify()
        return job.future

    def close(self) -> None:
        """Take no more jobs, finish those queued, and return once the worker has ended."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._worker.is_alive():
            self._worker.join()

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._run_batch(batch)

    def _next_batch(self) -> list[_Job[Result]] | None:
        """The jobs of the next batch, taken off the queue: the first group of jobs sharing options (by their
        oldest job) that is full or has waited long enough, so a full group never waits behind a slow one;
        None once closing with nothing left."""
        with self._changed:
            while True:
                self._drop_cancelled()
                if not self._jobs:
                    if self._closing:
                        return None
                    self._changed.wait()
                    continue
                groups: dict[Hashable, list[_Job[Result]]] = {}
                for job in self._jobs:
                    groups.setdefault(job.options, []).append(job)
                now = time.monotonic()
                for mates in groups.values():
                    full = sum(len(job.lines) for job in mates) >= self.max_batch_size
                    if self._closing or full or mates[0].queued_at + self.max_wait_s <= now:
                        return self._take(mates)
                self._changed.wait(self._jobs[0].queued_at + self.max_wait_s - now)  # the oldest is due first

    def _take(self, mates: list[_Job[Result]]) -> list[_Job[Result]]:
        """The oldest of ``mates`` that fit in a batch (at least one), off the queue."""
        batch, size = [], 0
        for job in mates:
            if batch and size + len(job.lines) > self.max_batch_size:
                break
            batch.append(job)
            size += len(job.lines)
        for job in batch:
            self._jobs.remove(job)
        self._waiting -= size
        return batch

    def _drop_cancelled(self) -> None:
        """Jobs whose requests gave up waiting leave the queue, and their sentences stop counting."""
        for job in [job for job in self._jobs if job.future.cancelled()]:
            self._jobs.remove(job)
            self._waiting -= len(job.lines)

    def _run_batch(self, batch: list[_Job[Result]]) -> None:
        jobs = [job for job in batch if job.future.set_running_or_notify_cancel()]  # cancelled ones are skipped
        if jobs:
            self._translate_jobs(jobs)

    def _translate_jobs(self, jobs: list[_Job[Result]]) -> None:
        """Each job's results, or its error. When a batch of several jobs fails, each is translated again on
        its own, so a request that breaks the search fails alone and its batch-mates get their answers."""
        lines = [line for job in jobs for line in job.lines]
        log.debug("batch of %d sentences from %d requests", len(lines), len(jobs))
        try:
            results = self.translate(lines, jobs[0].options)
        except Exception as err:
            if len(jobs) > 1:
                log.warning("a batch of %d requests failed (%s); translating each alone", len(jobs), err)
                for job in jobs:
                    self._translate_jobs([job])
                return
            log.exception("a request of %d sentences failed", len(lines))
            jobs[0].future.set_exception(err)
            return
        start = 0
        for job in jobs:
            job.future.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)
