"""Run the mtkit command line with a fault plan: the SIGKILLs of test_kill_resume.py.

Usage: ``python kill_runner.py PLAN mtkit-arguments...``, where PLAN is JSON:

- ``{}``: no fault;
- ``{"count": {phase: target}, "report": path}``: write to ``path`` the events of each kind that
  every call of each phase made;
- ``{"target": target, "call": K, "kind": kind, "event": N}``: SIGKILL at the N-th event of that
  kind in the K-th call of ``target``, or when that call returns.

A target is ``module:Attribute.path``, patched where mtkit looks it up. Events are those of
``sys.setprofile``: kind "any" counts every call and return (of C functions too); kind "file" counts
only the C calls that change files, so a kill lands just before or after one.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from collections.abc import Callable

from mtkit import cli

# C functions that change files: a kill just before or after one leaves a state of its own on disk.
CHANGES = {"open", "write", "flush", "close", "__exit__", "fsync", "chmod", "mkdir", "rename", "replace"}
CHANGES |= {"unlink", "rmdir"}


def changes_files(function) -> bool:
    owner = type(getattr(function, "__self__", None)).__module__
    in_os_or_io = getattr(function, "__module__", None) in ("posix", "io") or owner == "_io"
    return in_os_or_io and function.__name__ in CHANGES


def kinds(event: str, arg) -> tuple[str, ...]:
    """The kinds of event that a profile callback's ``event`` counts as."""
    if event in ("call", "return"):
        return ("any",)
    if event in ("c_call", "c_return"):
        return ("any", "file") if changes_files(arg) else ("any",)
    return ()


def patch(target: str, wrap: Callable) -> None:
    module, _, attr = target.partition(":")
    *parents, name = attr.split(".")
    owner = importlib.import_module(module)
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, wrap(getattr(owner, name)))


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def counted(phase: str, report: dict[str, list[dict[str, int]]]) -> Callable:
    """A wrapper that records the events of each call of ``phase`` in ``report``."""

    def wrap(original):
        def wrapper(*args, **kwargs):
            events = {"any": 0, "file": 0}

            def profile(frame, event, arg):
                for kind in kinds(event, arg):
                    events[kind] += 1

            outer = sys.getprofile()
            sys.setprofile(profile)
            try:
                return original(*args, **kwargs)
            finally:
                sys.setprofile(outer)
                report.setdefault(phase, []).append(events)

        return wrapper

    return wrap


def killed_at(call: int, kind: str, event: int) -> Callable:
    """A wrapper that kills the process at the ``event``-th event of ``kind`` of its ``call``-th call."""

    def wrap(original):
        calls = 0

        def wrapper(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls < call:
                return original(*args, **kwargs)
            seen = 0

            def profile(frame, what, arg):
                nonlocal seen
                if kind in kinds(what, arg):
                    seen += 1
                    if seen == event:
                        kill()

            sys.setprofile(profile)
            try:
                original(*args, **kwargs)
            finally:
                kill()

        return wrapper

    return wrap


def main() -> None:
    plan = json.loads(sys.argv[1])
    report: dict[str, list[dict[str, int]]] = {}
    if "count" in plan:
        for phase, target in plan["count"].items():
            patch(target, counted(phase, report))
    elif plan:
        patch(plan["target"], killed_at(plan["call"], plan["kind"], plan["event"]))
    sys.argv = ["mtkit", *sys.argv[2:]]
    try:
        cli.main()
    finally:
        if "report" in plan:
            with open(plan["report"], "w") as f:
                json.dump(report, f)


if __name__ == "__main__":
    main()
