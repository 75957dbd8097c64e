"""Export a model told its languages by tokens (an imported NLLB-200 or M2M100, or a model fine-tuned from one) as a
transformers ``M2M100ForConditionalGeneration`` folder, which runs without mtkit.

The import (m2m100_import.py) expresses these models exactly, and the export undoes it:

- weights: the one embedding table (encoder, decoder and output: ``model.shared.weight``) with its rows in
  fairseq's order, mtkit's ids but the first four (mtkit's pad, unk, bos and eos, 0 to 3, are fairseq's 1, 3, 0
  and 2); every weight inside the layers and the two final LayerNorms as they are: mtkit's ``fairseq`` positions
  are the sinusoids transformers computes, in its layout. float32.
- config.json: fairseq's special ids (bos 0, pad 1, eos 2) and ``decoder_start_token_id`` 2, the eos that mtkit's
  decoder reads where its search starts (``model.decoder_start`` eos); scaled embeddings, the sizes, the
  activation; no layerdrop, which mtkit does not train with.
- generation_config.json: transformers forces the target language's token first (``forced_bos_token_id``, the
  default target's where the model has one; pass it to ``generate`` otherwise), as mtkit's search does; <s> and
  <pad>, which mtkit never generates, are suppressed; ``num_beams`` and ``length_penalty`` are the model's decoding
  settings as the Marian export states them (hf_export.py), ``max_new_tokens`` its positions, and
  ``forced_eos_token_id`` ends a hypothesis the length cap cut with eos, as mtkit's search does.
- the tokenizer files: m2m100_tokenizer.py.

Refused in one line: a model without every one of these models' traits (fairseq positions, eos as the decoder's
start, pre-norm layers, one tied table, no output bias), and a vocabulary neither NllbTokenizer nor M2M100Tokenizer
numbers as the model does.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtkit.config import ConfigError, DecodeConfig, ModelConfig, RunConfig
from mtkit.data.directions import default_languages, language_leads
from mtkit.files import atomic_write_directory
from mtkit.interop.export_folder import MANIFEST, check_replaceable
from mtkit.interop.hf_export import import_transformers, transformers_length_penalty, transformers_manifest
from mtkit.interop.m2m100_config import FAIRSEQ_IDS, TABLE_NAMES
from mtkit.interop.m2m100_tokenizer import fairseq_layout, save_tokenizer
from mtkit.interop.m2m100_vocabulary import fairseq_order
from mtkit.interop.marian import layer_weights
from mtkit.model.checkpoint import read_meta
from mtkit.model.loading import InferenceBundle, load_for_inference, resolve
from mtkit.model.transformer import Transformer

ARCHITECTURE = "M2M100ForConditionalGeneration"
NEVER_GENERATED = [FAIRSEQ_IDS["bos_token_id"], FAIRSEQ_IDS["pad_token_id"]]  # mtkit's bos and pad
# what the model must be for M2M100ForConditionalGeneration to compute it: what the import makes of one
TRAITS = {
    "positions": "fairseq",
    "decoder_start": "eos",
    "norm": "pre",
    "tie_embeddings": True,
    "output_bias": False,
    "attention_window": 0,
}


def told_languages_by_tokens(model_path: Path) -> bool:
    """Whether the model of ``model_path`` is told its languages by tokens (``data.languages``), read from its
    metadata alone: what the transformers export writes as an M2M100ForConditionalGeneration."""
    _, cfg = read_meta(resolve(Path(model_path)))
    return bool(cfg.data.languages)


def check_expressible(cfg: RunConfig) -> None:
    """ConfigError naming what ``M2M100ForConditionalGeneration`` cannot compute of a model of ``cfg``."""
    if not cfg.data.languages:
        raise ConfigError(f"{ARCHITECTURE} is told its languages by tokens, and this model has no data.languages")
    for name, wanted in TRAITS.items():
        value = getattr(cfg.model, name)
        if value != wanted:
            raise ConfigError(f"{ARCHITECTURE} has model.{name} {_shown(wanted)}; this model has {_shown(value)}")


def _shown(value: object) -> str:
    """A config value as YAML writes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def fairseq_rows(table: Tensor) -> Tensor:
    """An embedding table in mtkit's id order with its rows in fairseq's: the inverse of the import's."""
    return table[torch.argsort(fairseq_order(table.size(0)))]


def m2m100_weights(model: Transformer) -> dict[str, Tensor]:
    """The state dict of the equivalent ``M2M100ForConditionalGeneration`` (see the module docstring)."""
    table = fairseq_rows(model.encoder.embed.tokens.weight)
    weights = dict.fromkeys(TABLE_NAMES, table)
    for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        weights[f"model.{side}.layer_norm.weight"] = stack.final_norm.weight
        weights[f"model.{side}.layer_norm.bias"] = stack.final_norm.bias
    weights |= {name: tensor for name, tensor, _ in layer_weights(model)}
    return {name: tensor.detach().float().clone() for name, tensor in weights.items()}


def m2m100_config(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """``M2M100Config`` arguments for a model of ``cfg``."""
    return {
        "vocab_size": vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.encoder_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.heads,
        "decoder_attention_heads": cfg.heads,
        "encoder_ffn_dim": cfg.ffn,
        "decoder_ffn_dim": cfg.ffn,
        "activation_function": cfg.activation,  # transformers' names: relu, gelu (erf), swish
        "max_position_embeddings": cfg.max_positions,
        "scale_embedding": True,
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout,
        "activation_dropout": cfg.activation_dropout,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "tie_word_embeddings": True,
        **FAIRSEQ_IDS,
    }


def generation_settings(decode: DecodeConfig, max_positions: int, target_token: int | None) -> dict[str, Any]:
    """``GenerationConfig`` arguments: the model's decoding as far as transformers can say it (see the module), the
    default target language's token forced first where there is one."""
    settings: dict[str, Any] = {
        **FAIRSEQ_IDS,
        "forced_eos_token_id": FAIRSEQ_IDS["eos_token_id"],
        "suppress_tokens": NEVER_GENERATED,
        "max_new_tokens": max_positions,
        "num_beams": decode.beam,
    }
    if target_token is not None:
        settings["forced_bos_token_id"] = target_token
    if decode.beam > 1:
        settings.update(length_penalty=transformers_length_penalty(decode), early_stopping=True)
    if decode.min_len:
        settings["min_new_tokens"] = decode.min_len
    return settings


def _default_target(bundle: InferenceBundle) -> int | None:
    """The id of the default target language's token (mtkit's and fairseq's alike, from 4), if the model has one."""
    data = bundle.cfg.data
    source, target = default_languages(data)
    if target is None:
        return None
    return language_leads(data, bundle.src_tok, bundle.tgt_tok, source or target, target)[1][0]


def _m2m100_model(bundle: InferenceBundle, transformers: Any) -> Any:
    """An ``M2M100ForConditionalGeneration`` holding the bundle's weights and its generation defaults."""
    cfg, vocab_size = bundle.cfg.model, bundle.src_tok.vocab_size
    hf = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**m2m100_config(cfg, vocab_size)))
    with torch.no_grad():
        hf.load_state_dict(m2m100_weights(bundle.model))
    settings = generation_settings(bundle.cfg.decode, cfg.max_positions, _default_target(bundle))
    hf.generation_config = transformers.GenerationConfig(**settings)
    return hf.eval()


def export_m2m100(model_path: Path, out_dir: Path, adapter: Path | None = None) -> Path:
    """Write ``out_dir``: the model of ``model_path`` (run directory, checkpoint or .safetensors), told its
    languages by tokens, as a transformers M2M100ForConditionalGeneration with NllbTokenizer's or M2M100Tokenizer's
    files and its decoding defaults, a LoRA ``adapter`` (or a LoRA run's own) merged into its weights; the
    manifest records the adapter.

    An existing export in ``out_dir`` is replaced whole; any other folder that is not empty is refused.
    """
    out_dir = Path(out_dir)
    transformers = import_transformers()
    check_replaceable(out_dir)
    checkpoint = resolve(model_path)
    bundle = load_for_inference(checkpoint, torch.device("cpu"), adapter=adapter, merge=True)
    try:
        check_expressible(bundle.cfg)
        if bundle.src_tok.sha256 != bundle.tgt_tok.sha256:
            raise ConfigError(f"{ARCHITECTURE} has one vocabulary, and this model has two tokenizers")
        fairseq_layout(bundle.tgt_tok, bundle.cfg.data)
    except ConfigError as err:
        raise ConfigError(f"{model_path}: cannot export to transformers: {err}") from None
    hf = _m2m100_model(bundle, transformers)
    manifest = transformers_manifest(checkpoint, bundle)

    def fill(directory: Path) -> None:
        hf.save_pretrained(str(directory))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
            save_tokenizer(directory, bundle.tgt_tok, bundle.cfg.data, bundle.cfg.model.max_positions, transformers)
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")

    transformers.utils.logging.disable_progress_bar()  # a bar for writing one small file is noise
    try:
        atomic_write_directory(out_dir, fill)
    except ConfigError as err:
        raise ConfigError(f"{model_path}: cannot export to transformers: {err}") from None
    finally:
        transformers.utils.logging.enable_progress_bar()
    return out_dir
