"""Render ``docs/config.md`` from ``mtkit/config.py``: each setting's key, type, default and the comments on it.

The comments are read from the source, so the reference says what the code says. Regenerate with
``python -m mtkit.config_docs > docs/config.md``; tests/test_config_docs.py fails while the file is stale.
"""

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from typing import Any, Literal

import yaml

from mtkit import config

COMMAND = "python -m mtkit.config_docs > docs/config.md"


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Each comment's text by line number, and whether it fills its line (rather than ending a line of code)."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            full_line = not token.line[: token.start[1]].strip()
            found[token.start[0]] = (token.string.lstrip("#").strip(), full_line)
    return found


def _explanation(line: int, comments: dict[int, tuple[str, bool]]) -> str:
    """The full-line comments directly above ``line`` and the comment ending it, joined into one text."""
    first = line
    while comments.get(first - 1, ("", False))[1]:
        first -= 1
    parts = [comments[n][0] for n in range(first, line)]
    if line in comments and not comments[line][1]:
        parts.append(comments[line][0])
    return " ".join(parts)


def explanations(source: str) -> dict[str, str]:
    """The comments on each name in ``source``: class fields (``ModelConfig.heads``), module constants
    (``MAX_LAYERS``) and the string keys of module-level dicts (``PRESETS.transformer-big``); "" if none."""
    lines = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    lines[f"{node.name}.{item.target.id}"] = item.lineno
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    lines[target.id] = node.lineno
                    for key in node.value.keys if isinstance(node.value, ast.Dict) else []:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            lines[f"{target.id}.{key.value}"] = key.lineno
    comments = _comments(source)
    return {name: _explanation(line, comments) for name, line in lines.items()}


def _bounds(node: ast.ClassDef) -> dict[str, list[str]]:
    """The module constants (``MAX_LAYERS``) that a section's ``_check`` calls compare fields with, and those fields."""
    bounds: dict[str, list[str]] = {}
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_check":
            names = list(ast.walk(call))
            fields = [n.attr for n in names if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"]
            for constant in dict.fromkeys(n.id for n in names if isinstance(n, ast.Name) and n.id.isupper()):
                bounds[constant] = list(dict.fromkeys(bounds.get(constant, []) + fields))
    return bounds


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
    """``value`` as it is written in a YAML config (``''``, ``true``, ``0.001``)."""
    return yaml.safe_dump(value).splitlines()[0]


def _row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join([_row(*header), _row(*["---"] * len(header)), *(_row(*row) for row in rows)])


def _section(name: str, cls: type, node: ast.ClassDef, why: dict[str, str], classes: dict[str, ast.ClassDef]) -> str:
    """One config section: its docstring, its settings, then its presets and bounds where it has them."""
    hints = typing.get_type_hints(cls)
    rows = [
        [f"`{f.name}`", type_name(hints[f.name]), f"`{yaml_value(f.default)}`", why[f"{cls.__name__}.{f.name}"]]
        for f in dataclasses.fields(cls)
    ]
    parts = [f"## `{name}`", ast.get_docstring(node) or "", _table(["key", "type", "default", "why"], rows)]
    for f in dataclasses.fields(cls):  # a list of mappings (data.corpora): the keys of each
        item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is tuple else None
        if dataclasses.is_dataclass(item):
            parts += [f"### `{name}.{f.name}`: each item", _items(item, classes[item.__name__], why)]
    if cls is config.ModelConfig:
        parts += ["### Presets", "`preset` sets these keys; keys given in the config override them.", _presets(why)]
    bounds = [
        [f"`{bound}`", f"{getattr(config, bound):,}", ", ".join(f"`{f}`" for f in fields), why[bound]]
        for bound, fields in _bounds(node).items()
    ]
    if bounds:
        parts += ["### Bounds", _table(["bound", "value", "keys", "why"], bounds)]
    return "\n\n".join(part for part in parts if part)


def _items(cls: type, node: ast.ClassDef, why: dict[str, str]) -> str:
    """The keys of one item of a list setting: its docstring, then a table as a section's."""
    hints = typing.get_type_hints(cls)
    rows = [
        [f"`{f.name}`", type_name(hints[f.name]), f"`{yaml_value(f.default)}`", why[f"{cls.__name__}.{f.name}"]]
        for f in dataclasses.fields(cls)
    ]
    return "\n\n".join([ast.get_docstring(node) or "", _table(["key", "type", "default", "why"], rows)])


def _presets(why: dict[str, str]) -> str:
    """A table of the model presets: the keys each one sets, and why it exists."""
    keys = list(dict.fromkeys(key for values in config.PRESETS.values() for key in values))
    rows = [
        [f"`{name}`", *(yaml_value(values[key]) if key in values else "" for key in keys), why[f"PRESETS.{name}"]]
        for name, values in config.PRESETS.items()
    ]
    return _table(["preset", *(f"`{key}`" for key in keys), "why"], rows)


def render() -> str:
    """The whole of docs/config.md."""
    source = inspect.getsource(config)
    why = explanations(source)
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    intro = [
        "# Configuration reference",
        f"Generated from `mtkit/config.py` by `{COMMAND}`: edit the dataclasses and their comments there, "
        "then regenerate this file.",
        inspect.getdoc(config),
        "Each section is a mapping in the YAML file; `--set section.key=value` overrides one key.",
    ]
    sections = [_section(name, cls, classes[cls.__name__], why, classes) for name, cls in config.SECTIONS.items()]
    sections += [
        _section(name, cls, classes[cls.__name__], why, classes) for name, cls in config.COMMAND_OPTIONS.items()
    ]
    return "\n\n".join(intro + sections) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
