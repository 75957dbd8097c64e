"""Checks for values read from files: checkpoint headers, export manifests, token-store and prepare records.

Such a file may have been edited, damaged or made by someone else, so each value is checked for
the type and range mtkit itself writes before anything uses it. A name read from a file is only
ever one of the names mtkit writes there, never a path, so no file can point mtkit outside the
folder it belongs to. Each check raises ``Malformed`` with what is wrong; the caller adds which
file it was.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Collection
from typing import Any

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 4, 4, 60, 60, 40
# A path read from a file, shown to the user to copy (a hint, never opened): whole up to this many characters.
_PATH = reprlib.Repr()
_PATH.maxstring = 400
_TYPE_NAMES = {dict: "a mapping", list: "a list", str: "a string", int: "an integer", float: "a number"}


class Malformed(ValueError):
    """A value in a file is not of the form mtkit writes there."""


def mapping(value: Any, what: str, required: Collection[str] = (), optional: Collection[str] | None = None) -> dict:
    """``value`` as a dict with string keys holding every ``required`` key, and no key beyond ``optional``
    (and ``required``) when ``optional`` is given."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise Malformed(f"{what} must be {_TYPE_NAMES[dict]}, got {shown(value)}")
    missing = [key for key in required if key not in value]
    if missing:
        raise Malformed(f"{what} has no {', '.join(map(repr, missing))}")
    if optional is not None:
        extra = [key for key in value if key not in required and key not in optional]
        if extra:
            raise Malformed(f"{what} has unknown key(s) {', '.join(map(repr, extra[:3]))}")
    return value


def integer(value: Any, what: str, low: int | None = 0, high: int | None = None) -> int:
    """``value`` as an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise Malformed(f"{what} must be {_TYPE_NAMES[int]}, got {shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise Malformed(f"{what} must be {bounds}, got {value}")
    return value


def number(value: Any, what: str) -> float:
    """``value`` as a finite float (ints accepted, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise Malformed(f"{what} must be a finite {_TYPE_NAMES[float]}, got {shown(value)}")
    return float(value)


def string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise Malformed(f"{what} must be {_TYPE_NAMES[str]}, got {shown(value)}")
    return value


def strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list):
        raise Malformed(f"{what} must be {_TYPE_NAMES[list]}, got {shown(value)}")
    return [string(item, f"{what}[{i}]") for i, item in enumerate(value)]


def sha256(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise Malformed(f"{what} must be a SHA-256 (64 lowercase hex digits), got {shown(value)}")
    return value


def one_of(value: Any, what: str, allowed: Collection[str]) -> str:
    """One of the strings mtkit writes in this place. For a file name this refuses any path."""
    if not isinstance(value, str) or value not in allowed:
        raise Malformed(f"{what} must be one of {', '.join(sorted(allowed))}, got {shown(value)}")
    return value


def shown(value: Any) -> str:
    """``repr(value)`` cut short without building it whole: an error line never repeats a huge value."""
    return _SHORT.repr(value)


def shown_path(value: Any) -> str:
    """``shown`` for a path the user may copy from the message: whole unless it is longer than any real one."""
    return _PATH.repr(value) if isinstance(value, str) else shown(value)
