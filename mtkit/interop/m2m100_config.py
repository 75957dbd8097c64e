"""An ``M2M100ForConditionalGeneration``'s config.json (NLLB-200's dense models, M2M100) as mtkit expresses it, and
the tensors it makes its weights file hold.

What these fairseq-trained models have, and how mtkit expresses it exactly:

- pre-norm layers and a final LayerNorm on each stack (``model.norm`` pre); fairseq's sinusoids from position 2
  (``model.positions`` fairseq), so the weights copy as they are; token embeddings scaled by sqrt(D)
  (``scale_embedding``); ReLU, GELU or swish; one head count and FFN width for both stacks;
- one embedding table for the encoder, the decoder and the output (``model.tie_embeddings``), no output bias;
- fairseq's special ids (<s> 0, <pad> 1, </s> 2, <unk> 3; m2m100_vocabulary.py renumbers them) and the decoder
  reading eos before its first output (``model.decoder_start`` eos), as fairseq trained it.

dropout, attention_dropout and activation_dropout become mtkit's; encoder_layerdrop and decoder_layerdrop, which
skip whole layers in training, have no mtkit setting and are ignored: they change nothing at inference. Anything
else mtkit cannot express is refused in one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtkit import untrusted
from mtkit.config import ConfigError, ModelConfig
from mtkit.hub_folders import ModelImportError, config_field, read_mapping
from mtkit.interop.hf_config import MAX_VOCABULARY, check_tensors, dimensions, layer_settings, layer_shapes
from mtkit.interop.hf_weights import WeightsFile

MODEL_TYPE = "m2m_100"
# fairseq's dictionary: its special ids, which config.json repeats, and the decoder's start, its eos
FAIRSEQ_IDS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}
# The one embedding table: transformers saves it as model.shared.weight; a file converted elsewhere may keep
# another of its tied names instead, and older ones repeat it under each.
TABLE_NAMES = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
TABLE_NAMES += ("lm_head.weight",)
# Settings of the BART family's other models that M2M100 lacks: a LayerNorm on the embeddings.
_NOT_M2M100 = ("layernorm_embedding", "normalize_embedding")


@dataclass
class M2M100Settings:
    """What mtkit reads of config.json: the model it describes and its vocabulary's size."""

    model: ModelConfig
    vocab_size: int


def read_config(path: Path) -> M2M100Settings:
    """config.json as mtkit expresses it; ModelImportError naming the first field it cannot express."""
    config = read_mapping(path)
    _check_architecture(config, path)
    heads, ffn, activation = layer_settings(config, path, "relu")
    for name, fairseq_id in FAIRSEQ_IDS.items():
        if config_field(config, name, path, int, fairseq_id) != fairseq_id:
            raise ModelImportError(
                f"{path}: {name} is {config[name]}, not fairseq's {fairseq_id}: mtkit reads these models' ids as "
                "fairseq numbers them (<s> 0, <pad> 1, </s> 2, <unk> 3, the decoder starting from </s>)"
            )
    vocab_size = config_field(config, "vocab_size", path, int, low=5)
    if vocab_size > MAX_VOCABULARY:
        raise ModelImportError(f"{path}: a vocabulary of over {MAX_VOCABULARY:,} pieces")
    d_model, layers, positions = dimensions(config, path, ffn)
    if config_field(config, "num_hidden_layers", path, int, layers[0], low=1) != layers[0]:
        raise ModelImportError(
            f"{path}: num_hidden_layers {config['num_hidden_layers']} differs from encoder_layers {layers[0]}"
        )
    try:
        model = ModelConfig(
            encoder_layers=layers[0],
            decoder_layers=layers[1],
            d_model=d_model,
            heads=heads,
            ffn=ffn,
            dropout=float(config_field(config, "dropout", path, float, 0.1)),
            attention_dropout=float(config_field(config, "attention_dropout", path, float, 0.1)),
            activation_dropout=float(config_field(config, "activation_dropout", path, float, 0.0)),
            activation=activation,
            norm="pre",
            positions="fairseq",
            decoder_start="eos",
            tie_embeddings=True,
            output_bias=False,
            max_positions=positions,
        )
    except ConfigError as err:
        raise ModelImportError(f"{path}: {err}") from None
    return M2M100Settings(model, vocab_size)


def _check_architecture(config: dict[str, Any], path: Path) -> None:
    """An M2M100 model: its model_type, its pre-norm layers, scaled embeddings and one table tied to the output."""
    if config.get("model_type") != MODEL_TYPE:
        raise ModelImportError(
            f"{path}: model_type must be {MODEL_TYPE} (an M2M100ForConditionalGeneration: NLLB-200, M2M100), got "
            f"{untrusted.shown(config.get('model_type'))}"
        )
    for name in _NOT_M2M100:
        if config.get(name):
            raise ModelImportError(f"{path}: {name} is set, and M2M100 models have no such option")
    if not config_field(config, "normalize_before", path, bool, True):
        raise ModelImportError(f"{path}: normalize_before false asks for post-norm layers; M2M100's are pre-norm")
    if not config_field(config, "scale_embedding", path, bool, True):
        raise ModelImportError(
            f"{path}: scale_embedding false: mtkit scales embeddings by sqrt(d_model), as NLLB-200 and M2M100 do"
        )
    if not config_field(config, "tie_word_embeddings", path, bool, True):
        raise ModelImportError(
            f"{path}: tie_word_embeddings false asks for an lm_head of its own; mtkit ties the output to the "
            "embeddings, as NLLB-200 and M2M100 do"
        )


def expected_shapes(settings: M2M100Settings, stored: set[str]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The tensors a weights file of ``settings`` must hold and those it may hold (copies of the tied table), by
    name, with their shapes (the layers' from ``layer_shapes``, which allocates nothing); ``stored`` (the file's
    names) tells which name the table has: the first of ``TABLE_NAMES`` held."""
    d = settings.model.d_model
    required = layer_shapes(settings.model)
    for side in ("encoder", "decoder"):
        required |= {f"model.{side}.layer_norm.weight": (d,), f"model.{side}.layer_norm.bias": (d,)}
    table = next((name for name in TABLE_NAMES if name in stored), TABLE_NAMES[0])
    required[table] = (settings.vocab_size, d)
    optional = {name: (settings.vocab_size, d) for name in TABLE_NAMES if name != table}
    return required, optional


def tensor_count(settings: M2M100Settings) -> int:
    """The most tensors a weights file of ``settings`` may hold: what bounds its safetensors header."""
    required, optional = expected_shapes(settings, set())
    return len(required) + len(optional)


def check_shapes(weights: WeightsFile, settings: M2M100Settings, config_path: Path) -> None:
    """The weights file holds exactly the tensors config.json describes, at its shapes: checked on the names and
    shapes alone, before a tensor is read or a model built, so a config.json of a huge model allocates nothing."""
    required, optional = expected_shapes(settings, set(weights.shapes))
    check_tensors(weights, settings.model, required, optional, config_path, "M2M100")
