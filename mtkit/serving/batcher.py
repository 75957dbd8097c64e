"""Dynamic batching: the sentences of concurrent requests searched together, a step at a time.

A search costs about as much for 32 sentences as for one on a CPU or GPU that would otherwise sit
half idle, so the server gathers the sentences of requests that arrive together into one search.
One worker thread runs every search (or, for several queues, hands each queue's step to ``step_queues``, which
may run the queues' steps at once, each queue's searches in turn), so a model is never used by two threads at once.
Requests
whose options differ (another beam, or scoring given translations rather than searching) cannot share a
search, so each set of options has its own; a "sentence" is whatever a job's options make of it, a text
to translate or a pair to score.

A search is stepped by the worker (``Search``): a continuous one (``mtkit.decoding.continuous``) takes new
sentences at every step and gives back each as it is done, so a request joins a search already
running; a ``WholeBatch`` translates everything it was given in one step. An idle search waits for
batch-mates: it starts once it has ``max_batch_size`` sentences or its oldest request has waited
``max_wait_s``, and a full one never waits behind one still gathering.

A request nobody waits for any more (it timed out, its client went away) is withdrawn: it leaves the
queue, or its sentences leave the search they are in at its next step.

The jobs of a server of several models queue apart: each job's options name its queue (``queue_of``), which
``max_queue`` bounds on its own, so that one model's flood never refuses another's requests; and an admission
policy (``admit``) may hold a queue's jobs back, as a pool of models does while the model they need waits for
room in memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

log = logging.getLogger("mtkit")

IDLE_WAKE_S = 1.0  # an idle batcher looks up this often, so that signals reach their handlers (``_next_jobs``)

Line = TypeVar("Line")  # what a request gives for each of its results: a text, or a pair of them
Result = TypeVar("Result")
Translate = Callable[[list[Line], Hashable], list[Result]]
# Which of the queues (in the order of their oldest job) that have jobs to start may start them now, given the
# queues whose searches are running: the rest wait.
Admit = Callable[[list[Hashable], set[Hashable]], set[Hashable]]


class StepQueues(Protocol):
    """Runs one step of each queue's searches (a callable each) and returns once all are done: in turn, or at once
    in threads of its own."""

    def __call__(self, steps: list[Callable[[], None]]) -> None: ...

    def close(self) -> None:
        """Free what it holds: the batcher has stopped."""


class InTurn:
    """Each queue's step in turn, in the batcher's thread."""

    def __call__(self, steps: list[Callable[[], None]]) -> None:
        for step in steps:
            step()

    def close(self) -> None:
        pass


class Refused(RuntimeError):
    """The batcher takes no more work now: its queue is full, or it is closing."""


class Withdrawn(RuntimeError):
    """What the future of a request withdrawn from its search holds (``Batcher.withdraw``)."""


class Search(Protocol[Line, Result]):
    """Sentences in, results out, a step at a time."""

    def add(self, key: Hashable, line: Line) -> None:
        """Take ``line``; a later ``step`` gives back its result with ``key``."""

    def step(self) -> list[tuple[Hashable, Result]]:
        """Work one step; the results of the sentences done by it."""

    def drop(self, keys: set[Hashable]) -> None:
        """Take back the lines of ``keys``: no result comes back for them."""

    def __len__(self) -> int:
        """Sentences taken and not yet given back."""


class WholeBatch(Generic[Line, Result]):
    """A search of everything added at once: each step translates all the lines added since the last."""

    def __init__(self, translate: Translate[Line, Result], options: Hashable) -> None:
        self.translate, self.options = translate, options
        self.keys: list[Hashable] = []
        self.lines: list[Line] = []

    def add(self, key: Hashable, line: Line) -> None:
        self.keys.append(key)
        self.lines.append(line)

    def step(self) -> list[tuple[Hashable, Result]]:
        keys, lines = self.keys, self.lines
        self.keys, self.lines = [], []
        return list(zip(keys, self.translate(lines, self.options)))

    def drop(self, keys: set[Hashable]) -> None:
        kept = [(key, line) for key, line in zip(self.keys, self.lines) if key not in keys]
        self.keys, self.lines = [key for key, _ in kept], [line for _, line in kept]

    def __len__(self) -> int:
        return len(self.lines)


@dataclass(eq=False)  # jobs are told apart by identity: a job and its line number key a sentence
class _Job(Generic[Line, Result]):
    lines: list[Line]
    options: Hashable
    queued_at: float = field(default_factory=time.monotonic)
    future: Future[list[Result]] = field(default_factory=Future)
    results: dict[int, Result] = field(default_factory=dict)  # by line, as they come back


class Batcher(Generic[Line, Result]):
    """Runs the jobs submitted through searches of at most ``max_batch_size`` sentences each, an idle search
    waiting at most ``max_wait_s`` after its oldest job arrived.

    ``open_search(options)`` makes the search for a set of options (by default a ``WholeBatch`` over
    ``translate``); ``translate(lines, options)`` gives one result per line, and translates each job of a
    search that failed again on its own, so a request that breaks a search fails alone and its
    search-mates get their answers. Each job's future gets its own lines' results, in order, or the
    exception translating them raised. A job of more than ``max_batch_size`` sentences is searched on its
    own, never split. ``queue_of(options)`` names the queue of a job (one for all by default), each bounded by
    ``max_queue`` sentences; ``admit`` chooses the queues whose jobs may start (all by default); ``step_queues``
    runs each step of the queues' searches (the searches of one queue always in turn, in one thread), in turn by
    default.
    """

    def __init__(
        self,
        translate: Translate[Line, Result],
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
        open_search: Callable[[Hashable], Search[Line, Result]] | None = None,
        queue_of: Callable[[Hashable], Hashable] = lambda options: None,
        admit: Admit | None = None,
        step_queues: StepQueues | None = None,
    ) -> None:
        self.translate = translate
        self.open_search = open_search or (lambda options: WholeBatch(translate, options))
        self.queue_of = queue_of
        self.admit: Admit = admit or (lambda queues, busy: set(queues))
        self.step_queues = step_queues or InTurn()
        self.max_batch_size, self.max_wait_s, self.max_queue = max_batch_size, max_wait_s, max_queue
        self._jobs: deque[_Job[Line, Result]] = deque()
        self._waiting: Counter[Hashable] = Counter()  # sentences in self._jobs, by queue
        self._closing = False
        self._changed = threading.Condition()
        self._withdrawn: set[Future[list[Result]]] = set()  # futures of running jobs to take back
        self._searches: dict[Hashable, Search[Line, Result]] = {}  # the worker's alone
        self._running: dict[Hashable, list[_Job[Line, Result]]] = {}  # the jobs in each search
        self._live: Counter[Hashable] = Counter()  # sentences in the searches, by queue, as the worker last counted
        self._on_step: Callable[[Hashable, int], None] = lambda queue, sentences: None
        self._worker = threading.Thread(target=self.run, name="mtkit-batcher", daemon=True)

    def start(self) -> None:
        """Run the searches in a thread of the batcher's own."""
        self._worker.start()

    def submit(self, lines: list[Line], options: Hashable) -> Future[list[Result]]:
        """Queue ``lines`` for translation with ``options``; cancelling the future before its search takes them
        withdraws them. Raises ``Refused`` when the queue would hold more than ``max_queue`` sentences."""
        with self._changed:
            if self._closing:
                raise Refused("the server is shutting down")
            queue = self.queue_of(options)
            waiting = self._waiting[queue]
            if waiting + len(lines) > self.max_queue:
                raise Refused(f"{waiting:,} sentences are waiting already (at most {self.max_queue:,})")
            job: _Job[Line, Result] = _Job(lines, options)
            self._jobs.append(job)
            self._waiting[queue] += len(lines)
            log.debug("queued %d sentences (%d waiting)", len(lines), waiting + len(lines))
            self._changed.notify()
        return job.future

    def pending(self, queue: Hashable = None) -> int:
        """Sentences of ``queue`` queued or in a search, not yet given back (as of the worker's last step)."""
        return self._waiting[queue] + self._live[queue]

    def watch_steps(self, observer: Callable[[Hashable, int], None]) -> None:
        """``observer`` is told the queue and the sentences of each search step before it runs, in the worker's
        thread."""
        self._on_step = observer

    def withdraw(self, future: Future[list[Result]]) -> None:
        """Nobody waits for ``future``'s translations any more: its job leaves the queue now, or the search it is
        in at that search's next step (a whole batch already translating runs to its end); the future then
        holds ``Withdrawn``."""
        if future.cancel():  # still queued: ``_drop_cancelled`` takes it off
            return
        with self._changed:
            if not future.done():
                self._withdrawn.add(future)
                self._changed.notify()

    def close(self) -> None:
        """Take no more jobs, finish those queued and running, and return once the batcher's own thread, if
        it has one, has ended."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._worker.is_alive():
            self._worker.join()

    def run(self) -> None:
        """Run the searches from this thread until the batcher is closed and has nothing left to do."""
        try:
            while (taken := self._next_jobs()) is not None:
                for job in taken:
                    if job.future.set_running_or_notify_cancel():  # cancelled ones are skipped
                        self._start(job)
                self._take_back()
                self._count_live()
                by_oldest = sorted(self._searches, key=lambda options: self._running[options][0].queued_at)
                outcomes = self._step_all(by_oldest)
                for options in by_oldest:
                    self._settle(options, outcomes[options])
                    if not self._running.get(options):  # done, or failed and dropped
                        self._searches.pop(options, None)
                        self._running.pop(options, None)
                self._count_live()
        finally:
            self.step_queues.close()

    def _step_all(self, by_oldest: list[Hashable]) -> dict[Hashable, list[tuple[Hashable, Result]] | Exception]:
        """One step of every search, oldest first: the searches of each queue in turn, the queues as
        ``step_queues`` runs them; what each step gave back, or the exception it raised."""
        queues: dict[Hashable, list[Hashable]] = {}
        for options in by_oldest:
            queues.setdefault(self.queue_of(options), []).append(options)
            self._on_step(self.queue_of(options), len(self._searches[options]))
        outcomes: dict[Hashable, list[tuple[Hashable, Result]] | Exception] = {}

        def stepping(group: list[Hashable]) -> Callable[[], None]:
            def step() -> None:
                for options in group:
                    try:
                        outcomes[options] = self._searches[options].step()
                    except Exception as err:
                        outcomes[options] = err

            return step

        self.step_queues([stepping(group) for group in queues.values()])
        return outcomes

    def _count_live(self) -> None:
        live: Counter[Hashable] = Counter()
        for options, search in self._searches.items():
            live[self.queue_of(options)] += len(search)
        self._live = live

    def _next_jobs(self) -> list[_Job[Line, Result]] | None:
        """The jobs that join a search now, taken off the queue: for each set of options, the oldest that fit
        beside the sentences its search holds, once the search is running, full, or its oldest job has waited
        long enough. Waits while no search has work; None once closing with nothing left."""
        with self._changed:
            while True:
                self._drop_cancelled()
                busy = {options for options, search in self._searches.items() if len(search)}
                if not self._jobs and not busy:
                    if self._closing:
                        return None
                    # Bounded: the server runs this in the main thread, where Python runs signal handlers only
                    # between bytecodes; a SIGTERM the kernel hands to another thread waits until this returns.
                    self._changed.wait(IDLE_WAKE_S)
                    continue
                groups: dict[Hashable, list[_Job[Line, Result]]] = {}
                for job in self._jobs:
                    groups.setdefault(job.options, []).append(job)
                now = time.monotonic()
                due = {
                    options: mates
                    for options, mates in groups.items()
                    if options in busy
                    or self._closing
                    or mates[0].queued_at + self.max_wait_s <= now
                    or self._live_in(options, busy) + sum(len(job.lines) for job in mates) >= self.max_batch_size
                }
                queues = list(dict.fromkeys(self.queue_of(options) for options in due))
                admitted = self.admit(queues, {self.queue_of(options) for options in busy}) if queues else set()
                taken = []
                for options, mates in due.items():
                    if self.queue_of(options) in admitted:
                        taken += self._take(mates, self._live_in(options, busy))
                if taken or busy:
                    return taken
                self._changed.wait(max(self._jobs[0].queued_at + self.max_wait_s - now, 0.001))  # oldest due first

    def _live_in(self, options: Hashable, busy: set[Hashable]) -> int:
        """Sentences in the running search of ``options`` (none when it has none)."""
        return len(self._searches[options]) if options in busy else 0

    def _take(self, mates: list[_Job[Line, Result]], live: int) -> list[_Job[Line, Result]]:
        """The oldest of ``mates`` that fit beside ``live`` sentences (at least one when there are none), off
        the queue."""
        batch, size = [], live
        for job in mates:
            if (batch or live) and size + len(job.lines) > self.max_batch_size:
                break
            batch.append(job)
            size += len(job.lines)
        for job in batch:
            self._jobs.remove(job)
        self._waiting[self.queue_of(mates[0].options)] -= size - live
        return batch

    def _drop_cancelled(self) -> None:
        """Jobs whose requests gave up waiting leave the queue, and their sentences stop counting."""
        for job in [job for job in self._jobs if job.future.cancelled()]:
            self._jobs.remove(job)
            self._waiting[self.queue_of(job.options)] -= len(job.lines)

    def _take_back(self) -> None:
        """The withdrawn jobs leave their searches; a search left with none is dropped."""
        with self._changed:
            withdrawn, self._withdrawn = self._withdrawn, set()
        if not withdrawn:
            return
        for options, jobs in list(self._running.items()):
            for job in [job for job in jobs if job.future in withdrawn]:
                jobs.remove(job)
                self._searches[options].drop({(job, number) for number in range(len(job.lines))})
                job.future.set_exception(Withdrawn(f"withdrawn with {len(job.results)}/{len(job.lines)} lines done"))
                log.debug("a request of %d sentences withdrawn from its search", len(job.lines))
            if not jobs:
                self._searches.pop(options)
                self._running.pop(options)

    def _start(self, job: _Job[Line, Result]) -> None:
        """``job``'s lines join the search of its options (opened if there is none)."""
        if not job.lines:
            job.future.set_result([])
            return
        if job.options not in self._searches:
            try:  # a model that cannot be loaded, say
                self._searches[job.options] = self.open_search(job.options)
            except Exception as err:
                log.exception("a search for a request of %d sentences could not start", len(job.lines))
                job.future.set_exception(err)
                return
            self._running[job.options] = []
        search = self._searches[job.options]
        self._running[job.options].append(job)
        for number, line in enumerate(job.lines):
            search.add((job, number), line)
        log.debug(
            "%d sentences join a search of %d (%d requests)",
            len(job.lines), len(search), len(self._running[job.options]),
        )  # fmt: skip

    def _settle(self, options: Hashable, outcome: list[tuple[Hashable, Result]] | Exception) -> None:
        """What a step of the search of ``options`` gave back: each job whose lines are all done gets its results.
        A failed step fails the search; each of its jobs is translated again on its own."""
        jobs = self._running[options]
        if isinstance(outcome, Exception):
            self._running[options] = []
            if len(jobs) == 1:
                log.error("a request of %d sentences failed", len(jobs[0].lines), exc_info=outcome)
                jobs[0].future.set_exception(outcome)
                return
            log.warning("a search of %d requests failed (%s); translating each alone", len(jobs), outcome)
            for job in jobs:
                self._translate_alone(job)
            return
        for (job, number), result in outcome:
            job.results[number] = result
        finished = [job for job in jobs if len(job.results) == len(job.lines)]
        for job in finished:
            jobs.remove(job)
            job.future.set_result([job.results[number] for number in range(len(job.lines))])

    def _translate_alone(self, job: _Job[Line, Result]) -> None:
        try:
            job.future.set_result(self.translate(job.lines, job.options))
        except Exception as err:
            log.exception("a request of %d sentences failed", len(job.lines))
            job.future.set_exception(err)
