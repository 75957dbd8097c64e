"""How settings are checked: each value against its field's type (and choices), each section by its own
``__post_init__``; whatever fails is a ``ConfigError`` naming the key."""

import dataclasses
import math
import typing
from typing import Any, Literal

from mtkit.errors import MtkitError
from mtkit.untrusted import shown


class ConfigError(MtkitError, ValueError):
    """A bad config file, key or value; the CLI prints it as one line."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_choices(config: Any, section: str) -> None:
    """Check each field of choices (``Literal``, or a list of them) against them, also when it is built in Python."""
    for name, hint in typing.get_type_hints(type(config)).items():
        if typing.get_origin(hint) in (Literal, tuple):
            coerce(f"{section}.{name}", getattr(config, name), hint)


def coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a field's type; ints are accepted where floats are expected, a YAML list where a
    ``tuple[X, ...]`` is (each item checked as an X)."""
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, (list, tuple)):
            return tuple(coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
        of = f" of {', '.join(map(str, typing.get_args(item)))}" if typing.get_origin(item) is Literal else ""
        raise ConfigError(f"{key} must be a list{of} (YAML: [a, b]), got {shown(value)}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return build(hint, value, key + ".")
        raise ConfigError(f"{key} must be a mapping of {', '.join(f.name for f in dataclasses.fields(hint))}")
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value in choices:
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {shown(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 2**63:  # beyond the 64-bit integers torch and numpy take
                raise ConfigError(f"{key} is too large, got {shown(value)}")
            return value
    elif hint is float:
        number = None
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                number = float(value)
            elif isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
                number = float(value)
        except (ValueError, OverflowError):  # not a number, or an int beyond any float
            pass
        if number is not None:
            if not math.isfinite(number):  # .inf and .nan parse, but no setting means them
                raise ConfigError(f"{key} must be a finite number, got {shown(value)}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{key} must be of type {name}, got {shown(value)}")


def build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """A section (or an item of a list of them) from its keys' values, each checked as ``coerce`` does."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            name = key if isinstance(key, str) and key.isprintable() else shown(key)
            raise ConfigError(f"unknown config key {prefix}{name} (known: {', '.join(sorted(known))})")
        kwargs[key] = coerce(prefix + key, value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if prefix.endswith("]."):  # an item of a list (data.corpora[1].): its checks do not know where it is
            raise ConfigError(f"{prefix[:-1]}: {err}") from None
        raise
