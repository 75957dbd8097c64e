"""A ``MarianMTModel``'s config.json as mtkit expresses it, and the tensors it makes its weights file hold.

config.json decides every size the import then trusts (the vocabularies, the safetensors header, the
model built), so each field is checked here and bounded, and a setting mtkit cannot express is refused
in one line naming the field. The weights file's names and shapes are compared with config.json
before a tensor is read, so a config.json describing a huge model allocates nothing.
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

# Settings of transformers' BART family that change the architecture; Marian models have them false (older
# transformers wrote them out). static_position_embeddings true is Marian's sinusoids: checked on its own.
_NOT_MARIAN = ("normalize_before", "add_final_layer_norm", "normalize_embedding")


@dataclass
class MarianConfig:
    """What mtkit reads of config.json: the model it describes, and Marian's special ids."""

    model: ModelConfig
    vocab_size: int  # source (or shared) vocabulary
    decoder_vocab_size: int
    shared: bool  # share_encoder_decoder_embeddings
    pad_id: int  # Marian's pad, which is also its decoder start
    eos_id: int


def read_config(path: Path) -> MarianConfig:
    """config.json as mtkit expresses it; ModelImportError naming the first field it cannot express."""
    config = read_mapping(path)
    _check_marian(config, path)
    heads, ffn, activation = layer_settings(config, path, "gelu")
    if not config_field(config, "scale_embedding", path, bool, False):
        raise ModelImportError(
            f"{path}: scale_embedding false: mtkit scales embeddings by sqrt(d_model), as OPUS-MT does"
        )
    shared, tie_output = _embedding_ties(config, path)
    vocab_size, decoder_vocab_size = _vocabulary_sizes(config, path, shared)
    pad_id = config_field(config, "pad_token_id", path, int, 58100)
    start = config_field(config, "decoder_start_token_id", path, int, pad_id)
    if start != pad_id:
        raise ModelImportError(f"{path}: decoder_start_token_id {start} is not pad_token_id {pad_id}, as Marian's is")
    eos_id = config_field(config, "eos_token_id", path, int, 0)
    d_model, layers, positions = _dimensions(config, path, ffn)
    try:
        model = ModelConfig(
            encoder_layers=layers[0],
            decoder_layers=layers[1],
            d_model=d_model,
            heads=heads,
            ffn=ffn,
            dropout=float(config_field(config, "dropout", path, float, 0.1)),
            attention_dropout=float(config_field(config, "attention_dropout", path, float, 0.0)),
            activation_dropout=float(config_field(config, "activation_dropout", path, float, 0.0)),
            activation=activation,
            norm="post",
            positions="sinusoidal",
            tie_embeddings=shared,
            tie_output=not shared and tie_output,
            output_bias=True,
            max_positions=positions,
        )
    except ConfigError as err:
        raise ModelImportError(f"{path}: {err}") from None
    return MarianConfig(model, vocab_size, decoder_vocab_size, shared, pad_id, eos_id)


def _check_marian(config: dict[str, Any], path: Path) -> None:
    """A Marian model: its model_type, none of the BART family's other layouts, sinusoidal positions."""
    if config.get("model_type") != "marian":
        raise ModelImportError(
            f"{path}: model_type must be marian (a MarianMTModel), got {untrusted.shown(config.get('model_type'))}"
        )
    for name in _NOT_MARIAN:
        if config.get(name):
            raise ModelImportError(f"{path}: {name} is set, and Marian models have no such option")
    if not config_field(config, "static_position_embeddings", path, bool, True):
        raise ModelImportError(
            f"{path}: static_position_embeddings false asks for learned positions; Marian's are sinusoids"
        )


def _embedding_ties(config: dict[str, Any], path: Path) -> tuple[bool, bool]:
    """share_encoder_decoder_embeddings and tie_word_embeddings, in a combination mtkit can tie."""
    shared = config_field(config, "share_encoder_decoder_embeddings", path, bool, True)
    tie_output = config_field(config, "tie_word_embeddings", path, bool, True)
    if shared and not tie_output:
        raise ModelImportError(
            f"{path}: tie_word_embeddings false with share_encoder_decoder_embeddings true: mtkit ties all three "
            "embeddings, or the decoder's to the output"
        )
    return shared, tie_output


def _vocabulary_sizes(config: dict[str, Any], path: Path, shared: bool) -> tuple[int, int]:
    """vocab_size and decoder_vocab_size (the same when absent), equal for shared embeddings, and bounded."""
    vocab_size = config_field(config, "vocab_size", path, int, low=5)
    if config.get("decoder_vocab_size") is None:  # absent, or null as older transformers wrote it
        config["decoder_vocab_size"] = vocab_size
    decoder_vocab_size = config_field(config, "decoder_vocab_size", path, int, low=5)
    if shared and decoder_vocab_size != vocab_size:
        raise ModelImportError(
            f"{path}: decoder_vocab_size {decoder_vocab_size} is not vocab_size {vocab_size}, and embeddings are shared"
        )
    if max(vocab_size, decoder_vocab_size) > MAX_VOCABULARY:
        raise ModelImportError(f"{path}: a vocabulary of over {MAX_VOCABULARY:,} pieces")
    return vocab_size, decoder_vocab_size


def _dimensions(config: dict[str, Any], path: Path, ffn: int) -> tuple[int, list[int], int]:
    """d_model, the two stacks' layer counts and max_position_embeddings within mtkit's bounds, and d_model even,
    as Marian's positions need."""
    d_model, layers, positions = dimensions(config, path, ffn)
    if d_model % 2:
        raise ModelImportError(f"{path}: d_model {d_model} is odd; Marian's positions need an even one")
    return d_model, layers, positions


def expected_shapes(marian: MarianConfig, stored: set[str]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The tensors a weights file of ``marian`` must hold and those it may hold (copies of tied ones, position
    tables), by name, with their shapes (the layers' from ``layer_shapes``, which allocates nothing);
    ``stored`` (the file's names) tells which name a shared table has."""
    cfg, d = marian.model, marian.model.d_model
    required = layer_shapes(cfg)
    source, target = (marian.vocab_size, d), (marian.decoder_vocab_size, d)
    optional = {
        "final_logits_bias": (1, marian.decoder_vocab_size),
        **{f"model.{side}.embed_positions.weight": (cfg.max_positions, d) for side in ("encoder", "decoder")},
    }
    if marian.shared:
        key = "model.shared.weight" if "model.shared.weight" in stored else "model.encoder.embed_tokens.weight"
        required[key] = source
        tied = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
        optional.update({name: source for name in tied if name != key})
    else:
        required["model.encoder.embed_tokens.weight"] = source
        required["model.decoder.embed_tokens.weight"] = target
        (optional if cfg.tie_output else required)["lm_head.weight"] = target
    return required, optional


def tensor_count(marian: MarianConfig) -> int:
    """The most tensors a weights file of ``marian`` may hold: what bounds its safetensors header."""
    required, optional = expected_shapes(marian, set())
    return len(required) + len(optional) + 1  # and model.shared.weight, the name of a shared table


def check_shapes(weights: WeightsFile, marian: MarianConfig, config_path: Path) -> None:
    """The weights file holds exactly the tensors config.json describes, at its shapes: checked on the names and
    shapes alone, before a tensor is read or a model built, so a config.json of a huge model allocates nothing."""
    required, optional = expected_shapes(marian, set(weights.shapes))
    check_tensors(weights, marian.model, required, optional, config_path, "Marian")
