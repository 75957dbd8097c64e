"""What the config.json files of the transformers families mtkit imports share: bounds on the sizes they claim,
settings mtkit keeps one of for both stacks, and the tensors their weights files must hold.

config.json decides every size the import then trusts (the tokenizer files' bounds, the safetensors header, the
model built), so each size is bounded here, and the weights file's names and shapes are compared with it before a
tensor is read, so a config.json describing a huge model allocates nothing. The layers of ``MarianMTModel`` and
``M2M100ForConditionalGeneration`` name their weights alike (interop/marian.py's ``layer_weights``).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from mtkit import untrusted
from mtkit.config import MAX_LAYERS, MAX_POSITIONS, ModelConfig
from mtkit.data.tokenizer import PAD_ID
from mtkit.hub_folders import ModelImportError, config_field
from mtkit.interop.hf_weights import WeightsFile
from mtkit.interop.marian import ACTIVATIONS, layer_weights
from mtkit.model.loading import skeleton_device
from mtkit.model.transformer import build_model

MAX_VOCABULARY = 1 << 20  # pieces in one vocabulary: NLLB-200's 256,206 fit four times
MAX_D_MODEL = 1 << 16
# the narrowest model dimension imported (OPUS-MT's narrowest is 256): embeddings this wide make the weights file
# grow with the vocabulary, and the tokenizer files with it
MIN_D_MODEL = 16
MAX_FFN = 1 << 18  # a feed-forward width: OPUS-MT's largest (tc-big) and NLLB-200 600M's are 4,096


def one_for_both_stacks(config: dict[str, Any], path: Path, first: str, second: str) -> int:
    """The encoder's setting ``first``, which the decoder's ``second`` must equal: mtkit has one for both."""
    value = config_field(config, first, path, int, low=1)
    if config_field(config, second, path, int, value, low=1) != value:
        raise ModelImportError(
            f"{path}: {second} {config[second]} differs from {first} {value}; mtkit has one for both stacks"
        )
    return value


def layer_settings(config: dict[str, Any], path: Path, default_activation: str) -> tuple[int, int, str]:
    """The head count and FFN width of both stacks, and ``model.activation``: what every layer of the model
    config.json describes computes with (its activation_function defaulting to ``default_activation``)."""
    heads = one_for_both_stacks(config, path, "encoder_attention_heads", "decoder_attention_heads")
    ffn = one_for_both_stacks(config, path, "encoder_ffn_dim", "decoder_ffn_dim")
    activation = config_field(config, "activation_function", path, str, default_activation)
    if activation not in ACTIVATIONS:
        raise ModelImportError(
            f"{path}: activation_function {untrusted.shown(activation)} is not one of {', '.join(ACTIVATIONS)}"
        )
    return heads, ffn, ACTIVATIONS[activation]


def dimensions(config: dict[str, Any], path: Path, ffn: int) -> tuple[int, list[int], int]:
    """d_model, the two stacks' layer counts and max_position_embeddings, each (and ``ffn``) within mtkit's
    bounds."""
    d_model = config_field(config, "d_model", path, int, low=MIN_D_MODEL)
    layers = [config_field(config, name, path, int, low=1) for name in ("encoder_layers", "decoder_layers")]
    positions = config_field(config, "max_position_embeddings", path, int, low=8)
    bounds = {
        "d_model": (d_model, MAX_D_MODEL),
        "encoder_ffn_dim": (ffn, MAX_FFN),
        "encoder_layers": (layers[0], MAX_LAYERS),
        "decoder_layers": (layers[1], MAX_LAYERS),
        "max_position_embeddings": (positions, MAX_POSITIONS),
    }
    for name, (value, most) in bounds.items():
        if value > most:
            raise ModelImportError(f"{path}: {name} {value:,} is beyond mtkit's bound of {most:,}")
    return d_model, layers, positions


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each weight inside the layers of a model of ``cfg``, by its transformers name, with its shape.

    The shapes are the model's own, read from a skeleton of one layer per stack built on the meta device, which
    costs no memory whatever config.json claims, and repeated for each layer config.json names."""
    with skeleton_device():
        skeleton = build_model(replace(cfg, encoder_layers=1, decoder_layers=1), 8, 8, PAD_ID)
    shapes = {}
    for key, tensor, _ in layer_weights(skeleton):
        side, rest = re.fullmatch(r"model\.(encoder|decoder)\.layers\.0\.(.+)", key).groups()
        for i in range(cfg.encoder_layers if side == "encoder" else cfg.decoder_layers):
            shapes[f"model.{side}.layers.{i}.{rest}"] = tuple(tensor.shape)
    return shapes


def check_tensors(
    weights: WeightsFile,
    cfg: ModelConfig,
    required: dict[str, tuple[int, ...]],
    optional: dict[str, tuple[int, ...]],
    config_path: Path,
    family: str,
) -> None:
    """The weights file holds each ``required`` tensor, any of the ``optional`` ones and nothing else, at the shapes
    given: checked on the header's names and shapes alone, before a tensor is read or a model built. ``family``
    names the models in errors (Marian, M2M100)."""
    for side in ("encoder", "decoder"):
        layer = re.compile(rf"model\.{side}\.layers\.(\d{{1,9}})\.")
        held = {int(m[1]) for key in weights.shapes if (m := layer.match(key))}
        count = getattr(cfg, f"{side}_layers")
        if len(held) != count:  # a gap in the numbering is named by the first tensor missing, below
            raise ModelImportError(
                f"{config_path}: {side}_layers is {count:,}, and {weights.path.name} holds {len(held):,} {side} layers"
            )
    for key in required:
        if key not in weights.shapes:
            raise ModelImportError(f"{weights.path}: no {key}, which {config_path.name} describes")
    for key, shape in weights.shapes.items():
        expected = required.get(key, optional.get(key))
        if expected is None:
            raise ModelImportError(f"{weights.path}: holds {key}, which no {family} model of {config_path.name} has")
        if shape != expected:
            raise ModelImportError(f"{weights.path}: {key} is {shape}, {config_path.name} makes it {expected}")
