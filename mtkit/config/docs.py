"""Render ``docs/config.md`` from the config's dataclasses: each setting's key, type, default and help text,
each section's presets and bounds with their reasons.

The reference is read from the schema itself, so it says what the code says. Regenerate with
``python -m mtkit.config.docs > docs/config.md``; tests/test_config_docs.py fails while the file is stale.
"""

import dataclasses
import inspect
import sys
import typing
from typing import Any, Literal

import yaml

from mtkit.config import bounds
from mtkit.config.model import PRESET_REASONS, PRESETS, ModelConfig
from mtkit.config.schema import COMMAND_OPTIONS, SECTIONS

COMMAND = "python -m mtkit.config.docs > docs/config.md"

INTRO = """Typed configuration: the one home for defaults, loaded from YAML plus ``--set`` overrides.

The YAML file mirrors the dataclass tree (``data``, ``tokenizer``, ``model``, ``train``, ``decode``, ``recipe``,
``backtranslation``, ``distillation``, ``pair_filter``);
an unknown key or a value of the wrong type or range is a ``ConfigError`` naming the key.

Each section is a mapping in the YAML file; `--set section.key=value` overrides one key."""


def type_name(hint: Any) -> str:
    """A field's type as a reader of the YAML file sees it: ``int``, ``one of: post, pre``, ``list of: a, b``."""
    if typing.get_origin(hint) is Literal:
        return "one of: " + ", ".join(map(str, typing.get_args(hint)))
    if dataclasses.is_dataclass(hint):
        return "mapping"
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if typing.get_origin(item) is Literal:
            return "list of: " + ", ".join(map(str, typing.get_args(item)))
        return f"list of {type_name(item)}"
    return hint.__name__


def yaml_value(value: Any) -> str:
    """``value`` as it is written in a YAML config (``''``, ``true``, ``0.001``, ``[attention]``)."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).splitlines()[0]


def description(cls: type) -> str:
    """A section's docstring; "" for one without (where ``dataclass`` has put the signature)."""
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def _row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join([_row(*header), _row(*["---"] * len(header)), *(_row(*row) for row in rows)])


def _settings(cls: type) -> str:
    """A table of a section's settings (or of an item's keys): key, type, default and help text."""
    hints = typing.get_type_hints(cls)
    rows = [
        [f"`{f.name}`", type_name(hints[f.name]), _default(f.default), f.metadata["help"]]
        for f in dataclasses.fields(cls)
    ]
    return _table(["key", "type", "default", "why"], rows)


def _default(value: Any) -> str:
    """A setting's default as the table shows it; a mapping's (train.lora) as the mapping of its keys' defaults."""
    return f"`{yaml_value(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)}`"


def _section(name: str, cls: type) -> str:
    """One config section: its docstring, its settings, then its presets and bounds where it has them."""
    hints = typing.get_type_hints(cls)
    parts = [f"## `{name}`", description(cls), _settings(cls)]
    for f in dataclasses.fields(cls):  # a list of mappings (data.corpora): the keys of each
        item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is tuple else None
        if dataclasses.is_dataclass(item):
            parts += [f"### `{name}.{f.name}`: each item", description(item), _settings(item)]
        elif dataclasses.is_dataclass(hints[f.name]):  # a mapping of keys (train.lora)
            parts += [f"### `{name}.{f.name}`", description(hints[f.name]), _settings(hints[f.name])]
    if cls is ModelConfig:
        parts += ["### Presets", "`preset` sets these keys; keys given in the config override them.", _presets()]
    rows = [
        [
            f"`{bound}`",
            f"{getattr(bounds, bound):,}",
            ", ".join(f"`{key}`" for key in keys),
            bounds.REASONS[bound],
        ]
        for bound, keys in getattr(cls, "bounds", {}).items()
    ]
    if rows:
        parts += ["### Bounds", _table(["bound", "value", "keys", "why"], rows)]
    return "\n\n".join(part for part in parts if part)


def _presets() -> str:
    """A table of the model presets: the keys each one sets, and why it exists."""
    keys = list(dict.fromkeys(key for values in PRESETS.values() for key in values))
    rows = [
        [f"`{name}`", *(yaml_value(values[key]) if key in values else "" for key in keys), PRESET_REASONS[name]]
        for name, values in PRESETS.items()
    ]
    return _table(["preset", *(f"`{key}`" for key in keys), "why"], rows)


def render() -> str:
    """The whole of docs/config.md."""
    intro = [
        "# Configuration reference",
        f"Generated from the dataclasses in `mtkit/config/` by `{COMMAND}`: edit the settings and their help "
        "text there, then regenerate this file.",
        INTRO,
    ]
    sections = [_section(name, cls) for name, cls in {**SECTIONS, **COMMAND_OPTIONS}.items()]
    return "\n\n".join(intro + sections) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
