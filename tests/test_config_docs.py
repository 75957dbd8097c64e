"""docs/config.md: generated from mtkit/config/, current, and complete (every setting with its default and why)."""

import dataclasses
import inspect
import re
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

from mtkit.config import SECTIONS, ConfigError, bounds, data, decoding, model, training, workflows
from mtkit.config.docs import COMMAND, render
from mtkit.config.model import PRESET_REASONS, PRESETS
from mtkit.config.schema import RunConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
FIELDS = [(name, cls, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
# Every dataclass of settings (RunConfig holds the sections, not settings).
SETTINGS_CLASSES = [
    cls
    for module in (data, decoding, model, training, workflows)
    for _, cls in inspect.getmembers(module, dataclasses.is_dataclass)
    if cls.__module__ == module.__name__ and cls is not RunConfig
]
BOUNDED = [
    (cls, bound, key) for cls in SETTINGS_CLASSES for bound, keys in getattr(cls, "bounds", {}).items() for key in keys
]


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
    default = f.default
    if dataclasses.is_dataclass(default):  # a nested section (train.lora): a mapping of its keys
        default = dataclasses.asdict(default)
        default = {key: list(value) if isinstance(value, tuple) else value for key, value in default.items()}
    default = list(default) if isinstance(default, tuple) else default  # a tuple is a list in YAML
    assert yaml.safe_load(row[2].strip("`")) == default


def test_every_setting_and_preset_says_why():
    settings = [(cls, f) for cls in SETTINGS_CLASSES for f in dataclasses.fields(cls)]
    missing = [f"{cls.__name__}.{f.name}" for cls, f in settings if not f.metadata.get("help")]
    assert not missing, f"give these a help text, setting(default, help), in mtkit/config/: {', '.join(missing)}"
    assert list(PRESET_REASONS) == list(PRESETS) and all(PRESET_REASONS.values())


def test_the_choices_of_literal_settings_are_listed():
    listed = rows(render())
    for section, cls, f in FIELDS:
        hint = typing.get_type_hints(cls)[f.name]
        if typing.get_origin(hint) is Literal:
            assert listed[f"{section}.{f.name}"][1] == "one of: " + ", ".join(typing.get_args(hint))


def test_presets_and_bounds_are_listed_in_the_model_section():
    model_section = render().split("## `model`")[1].split("\n## ")[0]
    for name, values in PRESETS.items():
        assert f"| `{name}` | " + " | ".join(map(str, values.values())) + " | " in model_section
    assert "| `MAX_LAYERS` | 1,000 | `encoder_layers`, `decoder_layers` | per stack |" in model_section
    assert "| `MAX_POSITIONS` | 65,536 | `max_positions` | Position tables are computed" in model_section


def test_every_bound_with_a_reason_is_a_bound():
    constants = {name for name, value in vars(bounds).items() if name.isupper() and isinstance(value, (int, float))}
    assert set(bounds.REASONS) <= constants
    assert {bound for _, bound, _ in BOUNDED} <= set(bounds.REASONS), "a bound a section lists has no reason"


@pytest.mark.parametrize("cls, bound, key", BOUNDED, ids=[f"{c.__name__}.{k}-{b}" for c, b, k in BOUNDED])
def test_a_key_is_refused_past_the_bound_its_section_lists(cls, bound, key):
    """The bounds docs/config.md lists beside a key are the ones its section's checks compare it with."""
    limit = getattr(bounds, bound)
    past = limit / 2 if bound.startswith("MIN_") else limit * 2
    if typing.get_origin(typing.get_type_hints(cls)[key]) is tuple:  # a list: its length is bounded
        past = tuple(range(past))
    with pytest.raises(ConfigError):
        cls(**{key: past})
