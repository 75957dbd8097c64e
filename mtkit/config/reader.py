"""Reading a config: YAML (safe, bounded in size) plus ``--set`` overrides into a ``RunConfig``, every key
checked, an error naming the file and line or the ``--set`` that gave the bad value; and back to YAML."""

import re
from pathlib import Path
from typing import Any

import yaml

from mtkit.config.checks import ConfigError, build, coerce
from mtkit.config.model import PRESETS, ModelConfig, Preset
from mtkit.config.schema import SECTIONS, RunConfig
from mtkit.untrusted import shown


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts; the model preset fills model keys not given explicitly."""
    if not isinstance(raw, dict):
        raise ConfigError("a config must be a mapping of sections (data, tokenizer, model, train, decode)")
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {shown(section)} (known: {', '.join(SECTIONS)})")
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"config section {section} must be a mapping, got {shown(values)}")
    model_raw = dict(raw.get("model") or {})
    preset = coerce("model.preset", model_raw.get("preset", ModelConfig.preset), Preset)
    sections = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    sections["model"] = {**PRESETS[preset], **model_raw}
    return RunConfig(**{name: build(cls, sections[name], name + ".") for name, cls in SECTIONS.items()})


MAX_YAML_NODES = 10_000  # a config has about 100 values; aliases that expand to more are refused


def parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The value of a YAML document, read with the safe loader, and its node tree (for line numbers).

    No tags that build Python objects; anchors and aliases are allowed as long as the document they
    expand to has at most MAX_YAML_NODES nodes, so a few hundred bytes of nested aliases cannot take
    gigabytes. Raises yaml.YAMLError.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_NODES:,} values")
        return loader.construct_document(node), node
    except RecursionError:  # PyYAML composes recursively
        raise yaml.YAMLError("nested too deeply") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes in ``node`` with every alias expanded, counted once per distinct node (linear time)."""
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a node that contains itself: counted once, not forever
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``section.key=value`` override in place, or ``section.key.subkey=value`` for a key that is a mapping
    (train.lora); the value is parsed as YAML."""
    key, sep, text = assignment.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"--set expects section.key=value (or section.key.subkey=value), got {shown(assignment)}")
    try:
        value = parse_yaml(text)[0] if text.strip() else ""
    except yaml.YAMLError:
        value = text
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"config section {parts[0]} must be a mapping")
    if len(parts) == 3:
        section = section.setdefault(parts[1], {})
        if not isinstance(section, dict):
            raise ConfigError(f"{parts[0]}.{parts[1]} must be a mapping to set {key.strip()}")
    section[parts[-1]] = value


def read_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides.

    YAML is read with the safe loader and bounded in size (``parse_yaml``). An error about a key
    says where that key's value came from: the file and line, or the ``--set`` that gave it.
    """
    raw: Any = {}
    origins: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            raw, root = parse_yaml(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            where = getattr(err, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"{path}:{line} not valid YAML ({getattr(err, 'problem', None) or err})") from None
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config must be a mapping of sections")
        origins = {key: f"{path}:{line}" for key, line in _key_lines(root).items()}
    for assignment in overrides:
        apply_override(raw, assignment)
        origins[assignment.partition("=")[0].strip()] = f"--set {assignment}"
    try:
        return from_dict(raw)
    except ConfigError as err:
        named = re.findall(r"\b(?:" + "|".join(SECTIONS) + r")\.\w+", str(err))
        found = [origins[key] for key in named if key in origins]
        if not found:
            raise
        # A check across keys (d_model and heads) blames a --set over the file: the override is the change.
        origin = next((o for o in found if o.startswith("--set")), found[0])
        raise ConfigError(f"{origin}: {err}") from None


def _key_lines(root: yaml.Node | None) -> dict[str, int]:
    """The line of each ``section.key`` in a YAML config's node tree (1-based), for error messages."""
    lines = {}
    if isinstance(root, yaml.MappingNode):
        for section, body in root.value:
            if isinstance(body, yaml.MappingNode):
                for key, _ in body.value:
                    lines[f"{section.value}.{key.value}"] = key.start_mark.line + 1
    return lines


def config_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
