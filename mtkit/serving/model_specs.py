"""The models `mtkit serve` is told to serve, as ``ModelSpec``s: one model and its ``--adapter`` options, several
``--model NAME=PATH`` options, or a models file (TOML or YAML) for many:

    max_loaded = 2                      # optional: at most this many in memory at once (0: no bound)

    [[models]]
    name = "en-de"                      # what requests call it (letters, digits, '.', '_', '-')
    path = "runs/m30k"                  # relative to the file's folder

    [[models]]
    name = "nllb"
    path = "nllb-600m"
    adapters = { legal = "runs/legal-lora" }

The same in YAML is a mapping with ``models`` (a list of such mappings) and ``max_loaded``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

from mtkit import untrusted
from mtkit.config import ConfigError
from mtkit.serving.adapters import ADAPTER_NAME
from mtkit.serving.models import MODEL_NAME, ModelSpec

MAX_MODELS = 256  # in one server
MAX_ADAPTERS = 64  # of one model
MAX_FILE_BYTES = 1 << 20  # of a models file


def model_name(model: str | Path) -> str:
    """What clients see a model given by its path called: its folder's or file's name (best/ and last/ by their
    run's), never the path on the server."""
    path = Path(model)
    if path.name in ("", ".", ".."):  # a run served from inside it
        path = path.resolve()
    return path.parent.name if path.name in ("best", "last") and path.parent.name else path.name


def named_path(given: str, option: str) -> tuple[str, Path]:
    """``NAME=PATH`` (an option of `mtkit serve`: a model's or an adapter's) as its name and path; ConfigError for
    another form."""
    name, sep, path = given.partition("=")
    if not sep or not path or not MODEL_NAME.fullmatch(name):
        raise ConfigError(
            f"{option} takes NAME=PATH, NAME of letters, digits, '.', '_' and '-' (at most 64), got {given!r}"
        )
    return name, Path(path)


def unique(pairs: list[tuple[str, Path]], option: str) -> dict[str, Path]:
    """``pairs`` by name; ConfigError when a name comes twice."""
    named = dict(pairs)
    if len(named) != len(pairs):
        raise ConfigError(f"{option} gives each NAME once")
    return named


def specs_of(model: str | None, models: list[str], adapters: list[str]) -> list[ModelSpec]:
    """The specs the command line gives: the one ``model`` with its ``adapters`` (``NAME=PATH`` each), or the
    ``models`` (``NAME=PATH`` each; adapters of several models go in a models file)."""
    if model is not None and models:
        raise ConfigError("give one MODEL, or several with --model NAME=PATH, not both")
    if model is None and not models:
        raise ConfigError("give a MODEL to serve, --model NAME=PATH for several, or --models FILE")
    served = unique([named_path(given, "--adapter") for given in adapters], "--adapter")
    if model is not None:
        return [ModelSpec(model_name(model), Path(model), served)]
    if served:
        raise ConfigError("--adapter goes with one MODEL; give the adapters of several models in a --models file")
    named = unique([named_path(given, "--model") for given in models], "--model")
    if len(named) > MAX_MODELS:
        raise ConfigError(f"{len(named)} models; a server serves at most {MAX_MODELS}")
    return [ModelSpec(name, path) for name, path in named.items()]


def read_models_file(path: Path) -> tuple[list[ModelSpec], int | None]:
    """The models a models file names, and its ``max_loaded`` (None where it sets none); ConfigError naming the
    file and the entry otherwise. Paths are relative to the file's folder."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: over {MAX_FILE_BYTES:,} bytes; a models file is a short list")
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        content = tomllib.loads(text) if path.suffix.lower() == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"{path}: not readable {'TOML' if path.suffix.lower() == '.toml' else 'YAML'} ({first[:200]})"
        ) from None
    try:
        return _specs(content, path.parent)
    except untrusted.Malformed as err:
        raise ConfigError(f"{path}: {err}") from None


def _specs(content: Any, folder: Path) -> tuple[list[ModelSpec], int | None]:
    top = untrusted.mapping(content, "the file", required=("models",), optional=("max_loaded",))
    max_loaded = untrusted.integer(top["max_loaded"], "max_loaded") if "max_loaded" in top else None
    entries = top["models"]
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_MODELS:
        raise untrusted.Malformed(f"models must be a list of 1 to {MAX_MODELS} models")
    specs: dict[str, ModelSpec] = {}
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        fields = untrusted.mapping(entry, where, required=("name", "path"), optional=("adapters",))
        name = untrusted.string(fields["name"], f"{where}.name")
        if not MODEL_NAME.fullmatch(name):
            shown = untrusted.shown(name)
            raise untrusted.Malformed(f"{where}.name: letters, digits, '.', '_' and '-' (at most 64), got {shown}")
        if name in specs:
            raise untrusted.Malformed(f"{where}.name: {name!r} names an earlier model too")
        given = untrusted.mapping(fields.get("adapters", {}), f"{where}.adapters")
        if len(given) > MAX_ADAPTERS:
            raise untrusted.Malformed(f"{where}.adapters: {len(given):,} adapters; a model has at most {MAX_ADAPTERS}")
        adapters = {}
        for adapter, adapter_file in given.items():
            if not ADAPTER_NAME.fullmatch(adapter):
                raise untrusted.Malformed(f"{where}.adapters: {untrusted.shown(adapter)} is no adapter name")
            adapters[adapter] = folder / _path(adapter_file, f"{where}.adapters.{adapter}")
        specs[name] = ModelSpec(name, folder / _path(fields["path"], f"{where}.path"), adapters)
    return list(specs.values()), max_loaded


def _path(value: Any, what: str) -> str:
    """A path the file gives: a string that is not empty."""
    if not untrusted.string(value, what):
        raise untrusted.Malformed(f"{what} is empty")
    return value
