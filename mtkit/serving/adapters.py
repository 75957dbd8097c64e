"""The LoRA adapters one server serves over its one base model (`mtkit serve --adapter NAME=PATH`).

The base model is in memory once. Each adapter gets a copy of its modules that holds the very same weights
(mtkit.model.lora.shared_copy) and its own adapter beside them, unmerged, and a translator over that copy: a
request names the adapter it wants (or none, for the base model), and the batcher searches the requests of each
adapter apart, as it does requests of other options, so no search mixes two adapters.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtkit.config import ConfigError
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import LineTranslator, Translator
from mtkit.model.adapter_file import read_adapter
from mtkit.model.checkpoint import CheckpointError, read_meta, stored_weights_digest, weights_file
from mtkit.model.loading import adapter_path, resolve
from mtkit.model.lora import put_adapters, shared_copy

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # what a request's adapter field names


@dataclass
class ServedAdapter:
    """An adapter the server serves: the translator over the base model's copy that carries it, and what
    /v1/models says of it."""

    translator: LineTranslator
    record: dict[str, Any]


def load_adapters(model: str | Path, translator: LineTranslator, paths: dict[str, Path]) -> dict[str, ServedAdapter]:
    """Each adapter of ``paths`` (by name) over ``translator``'s model, which was loaded from ``model``: checked to
    adapt that very model (by its weights' digest) before it is read, as every adapter is."""
    if not paths:
        return {}
    if not isinstance(translator, Translator) or isinstance(translator.model, Ensemble):
        raise ConfigError("--adapter serves adapters over one model of mtkit's engine")
    if (translator.precision or {}).get("precision") == "int8":
        raise ConfigError(
            "--adapter keeps each adapter beside the model's weights, which int8 quantizes: serve it in fp32 or bf16"
        )
    base = weights_file(resolve(Path(model)))
    _, cfg = read_meta(base)
    if cfg.train.lora.rank:
        raise CheckpointError(f"{model}: a LoRA run's adapter; serve its base model with --adapter NAME={model}")
    digest = stored_weights_digest(base)
    served = {}
    for name, path in paths.items():
        adapter = read_adapter(adapter_path(path), translator.model, digest, base)
        network = shared_copy(translator.model)
        put_adapters(network, adapter.settings, adapter.tensors)
        chosen = copy.copy(translator)
        chosen.model = network.eval()
        served[name] = ServedAdapter(chosen, adapter.record())
    return served
