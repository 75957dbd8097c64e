"""Stopping on SIGINT or SIGTERM so that the same command resumes the run: training between two updates, so that
the checkpoint written on the way out holds a whole number of updates; work kept in whole parts (a chain's
translations) at once, since a part is written whole or not at all."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("mtkit")


class TrainingStopped(Exception):
    """Training ended early on SIGINT/SIGTERM, after saving the last checkpoint."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at update {step}")
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM become a request that the loop honours between updates.

    So the checkpoint written on the way out always holds a whole number of updates (an interrupt
    in the middle of a step could otherwise save updated weights with the old step count).
    A second Ctrl-C (SIGINT) aborts at once. Repeated SIGTERMs do not: a scheduler and torchrun
    may both pass one on, and the checkpoint must still be written.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            log.warning("%s received again", signal.Signals(signum).name)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signum
        log.warning("%s received: saving a checkpoint after this update", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class StageStopped(BaseException):
    """A stage that keeps its work in whole parts ended on SIGINT/SIGTERM; the parts it finished are kept.

    A BaseException, as KeyboardInterrupt is: it is raised wherever the program is, and no handler of
    errors may take it for one."""

    def __init__(self, signum: int, what: str, kept: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} while {what}: the parts done are kept in {kept}")
        self.signum = signum


@contextlib.contextmanager
def stop_at_once(what: str, kept: str) -> Iterator[None]:
    """SIGINT and SIGTERM raise StageStopped at once, saying what was going on and where its parts are kept."""

    def handle(signum: int, frame) -> None:
        raise StageStopped(signum, what, kept)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handle) for s in StopSignals.SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
