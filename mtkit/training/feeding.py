"""Batches made ahead of the update that trains on them, by a background thread.

Collating a batch (gathering its pairs from the token store and padding them) takes the host time a GPU
would otherwise wait through at the start of each update. ``Feed`` runs the data walk in a thread that
stays up to ``depth`` updates ahead, its batches in page-locked (pinned) memory when they go to a GPU, so
that ``Batch.to`` copies them while the GPU computes. The walk is the same generator either way, so the
batches and their order do not depend on the depth; depth 0 runs it in the training loop itself.

The walk's own position is not the run's: each ``Group`` carries the data position after it, which the
trainer adopts when it takes the group, so a checkpoint records the batches trained on, not those made.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from dataclasses import dataclass, field

from mtkit.data.parallel import Batch

POLL_S = 0.1  # how often a waiting thread checks whether the feed was closed


@dataclass
class Group:
    """This rank's batches of one update, the group's target tokens (all ranks) and the position after it:
    ``epoch`` and ``batch_in_epoch`` for one corpus, ``mix`` for several (CorpusMix's position)."""

    batches: list[Batch]
    tokens: int
    epoch: int = 0
    batch_in_epoch: int = 0
    mix: list[int] = field(default_factory=list)


@dataclass
class _Failed:
    error: BaseException


class Feed:
    """The groups of ``walk`` (endless: the trainer decides when to stop), made up to ``depth`` updates ahead in
    a thread (``pin``: in pinned memory).

    ``next`` hands them over in order; an error of the walk is raised there, in the training thread.
    ``close`` stops the thread; a closed feed is discarded (a rollback starts a new one elsewhere).
    """

    def __init__(self, walk: Generator[Group, None, None], depth: int, pin: bool = False) -> None:
        self._walk, self._pin = walk, pin
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._closed = threading.Event()
            self._thread = threading.Thread(target=self._fill, name="mtkit-feed", daemon=True)
            self._thread.start()

    def next(self) -> Group:
        if self._thread is None:
            return self._pinned(next(self._walk))
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._thread.is_alive():
                    continue
                try:  # it may have queued its last item (an error) just before it ended
                    item = self._queue.get_nowait()
                except queue.Empty:  # a walk is endless, and errors are queued: not expected
                    raise RuntimeError("the batch feed thread ended without a batch or an error") from None
            if isinstance(item, _Failed):
                raise item.error
            return item

    def _pinned(self, group: Group) -> Group:
        if self._pin:
            group.batches = [batch.pin_memory() for batch in group.batches]
        return group

    def _fill(self) -> None:
        try:
            for group in self._walk:
                if not self._put(self._pinned(group)):
                    return
        except BaseException as err:  # handed to the training thread, which raises it
            self._put(_Failed(err))

    def _put(self, item: Group | _Failed) -> bool:
        """Queue ``item`` once there is room; False if the feed was closed meanwhile."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the thread and wait for it, so that nothing else walks the data at the same time."""
        if self._thread is not None:
            self._closed.set()
            self._thread.join()
            self._thread = None
        self._walk.close()
