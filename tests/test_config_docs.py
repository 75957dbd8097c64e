"""docs/config.md: generated from mtkit/config.py, current, and complete (every setting with its default and why)."""

import dataclasses
import inspect
import re
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

from mtkit import config
from mtkit.config_docs import COMMAND, explanations, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
FIELDS = [(name, cls, f) for name, cls in config.SECTIONS.items() for f in dataclasses.fields(cls)]


def rows(text: str) -> dict[str, list[str]]:
    """The cells of each settings-table row in a rendered file, by ``section.key``."""
    found, section = {}, ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line.strip("# `")
        elif line.startswith("| `") and section:
            cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            found.setdefault(f"{section}.{cells[0].strip('`')}", cells)
    return found


def test_the_file_is_current():
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/config.md is stale; regenerate it with: {COMMAND}"


@pytest.mark.parametrize("section, cls, f", FIELDS, ids=[f"{s}.{f.name}" for s, _, f in FIELDS])
def test_every_setting_is_listed_with_its_default(section, cls, f):
    row = rows(render())[f"{section}.{f.name}"]
    default = list(f.default) if isinstance(f.default, tuple) else f.default  # a tuple is a list in YAML
    assert yaml.safe_load(row[2].strip("`")) == default


def test_every_setting_and_preset_says_why():
    why = explanations(inspect.getsource(config))
    names = [f"{cls.__name__}.{f.name}" for _, cls, f in FIELDS] + [f"PRESETS.{name}" for name in config.PRESETS]
    missing = [name for name in names if not why[name]]
    assert not missing, f"add a comment saying why to these in mtkit/config.py: {', '.join(missing)}"


def test_the_choices_of_literal_settings_are_listed():
    listed = rows(render())
    for section, cls, f in FIELDS:
        hint = typing.get_type_hints(cls)[f.name]
        if typing.get_origin(hint) is Literal:
            assert listed[f"{section}.{f.name}"][1] == "one of: " + ", ".join(typing.get_args(hint))


def test_presets_and_bounds_are_listed_in_the_model_section():
    model = render().split("## `model`")[1].split("\n## ")[0]
    for name, values in config.PRESETS.items():
        assert f"| `{name}` | " + " | ".join(map(str, values.values())) + " | " in model
    assert "| `MAX_LAYERS` | 1,000 | `encoder_layers`, `decoder_layers` | per stack |" in model
    assert "| `MAX_POSITIONS` | 65,536 | `max_positions` | Bounds on what a config" in model


def test_comments_are_the_one_ending_the_line_and_the_full_lines_right_above():
    source = """
class C:
    a: int = 1  # ends a's line
    # not b's: a blank line follows

    # first line
    # second line
    b: str = "#not a comment"  # and the end
    c: int = 3
"""
    why = explanations(source)
    assert why == {"C.a": "ends a's line", "C.b": "first line second line and the end", "C.c": ""}
