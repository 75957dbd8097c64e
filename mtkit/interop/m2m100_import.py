"""Import an ``M2M100ForConditionalGeneration`` folder (NLLB-200's dense models, M2M100) as an mtkit model.

The model mtkit writes computes exactly what transformers' does: m2m100_config.py says how each part of the
architecture is expressed, m2m100_vocabulary.py how the ids are. The weights copy as they are, but for the first
four rows of the one embedding table (fairseq's special ids renumbered as mtkit's); fp16 and bf16 weights widen to
float32, which keeps every value.

The folder is read as the Marian import reads one (hf_import.py): every size bounded by config.json's before a file
is read, the weights file's names and shapes compared with config.json before a tensor is read or the model built,
weights finite, pytorch_model.bin loaded with ``weights_only=True``, no link out of the folder followed.

Such a model translates between any two of its languages, told which by tokens: the checkpoint's config records
them (``data.languages``, ``data.language_token``), and a default direction where ``--src-lang`` and
``--tgt-lang`` give one (``data.src_lang``, ``data.tgt_lang``; otherwise mtkit's ``src`` and ``tgt``, which say
that translate must be told). generate's ``num_beams`` and ``length_penalty`` become ``decode.beam`` and
``decode.lenpen`` as for Marian.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mtkit import untrusted
from mtkit.config import DataConfig, DecodeConfig, RunConfig, TokenizerConfig
from mtkit.data.tokenizer import PAD_ID
from mtkit.files import file_sha256
from mtkit.hub_folders import ModelImportError, read_decoding
from mtkit.interop.hf_weights import open_weights, read_weights, same_as, take
from mtkit.interop.import_output import save_import
from mtkit.interop.m2m100_config import TABLE_NAMES, M2M100Settings, check_shapes, read_config, tensor_count
from mtkit.interop.m2m100_vocabulary import FairseqVocabulary, read_vocabulary, tokenizer_model
from mtkit.interop.marian import layer_weights
from mtkit.model.transformer import Transformer, build_model


def convert(weights: dict[str, Tensor], settings: M2M100Settings, vocab: FairseqVocabulary, path: Path) -> Transformer:
    """The mtkit model computing what the M2M100 weights compute: the table's rows in mtkit's id order, every other
    weight as it is."""
    cfg, d = settings.model, settings.model.d_model
    model = build_model(cfg, settings.vocab_size, settings.vocab_size, PAD_ID)
    weights = dict(weights)
    with torch.no_grad():
        name = next((name for name in TABLE_NAMES if name in weights), TABLE_NAMES[0])
        table = take(weights, name, path, (settings.vocab_size, d))
        for tied in TABLE_NAMES:
            same_as(weights, tied, table, path)
        model.encoder.embed.tokens.weight.copy_(table[vocab.order])
        for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
            stack.final_norm.weight.copy_(take(weights, f"model.{side}.layer_norm.weight", path, (d,)))
            stack.final_norm.bias.copy_(take(weights, f"model.{side}.layer_norm.bias", path, (d,)))
        for key, tensor, _ in layer_weights(model):
            tensor.copy_(take(weights, key, path, tuple(tensor.shape)))
    if weights:
        raise ModelImportError(f"{path}: holds {next(iter(weights))}, which no M2M100 model of config.json has")
    return model.eval()


def direction(languages: tuple[str, ...], src_lang: str | None, tgt_lang: str | None) -> tuple[str, str]:
    """The default direction to record: the languages given, each one of the model's, else mtkit's ``src`` and
    ``tgt`` (no default)."""
    for flag, code in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang)):
        if code is not None and code not in languages:
            shown = ", ".join(languages[:6]) + (", ..." if len(languages) > 6 else "")
            raise ModelImportError(
                f"{flag} {untrusted.shown(code)} is not one of the model's {len(languages):,} languages ({shown})"
            )
    if src_lang is not None and src_lang == tgt_lang:
        raise ModelImportError(f"--src-lang and --tgt-lang are both {src_lang}")
    return src_lang or DataConfig.src_lang, tgt_lang or DataConfig.tgt_lang


def import_m2m100(
    folder: Path, origin: dict[str, str], out_dir: Path, src_lang: str | None = None, tgt_lang: str | None = None
) -> Path:
    """Write ``out_dir``, an mtkit checkpoint folder, from the M2M100 model in ``folder`` (found, and its links
    checked, by ``hf_import.import_hf``), recording ``origin``, its languages and the default direction given."""
    settings = read_config(folder / "config.json")
    weights_file = open_weights(folder, tensor_count(settings))
    check_shapes(weights_file, settings, folder / "config.json")
    beam, lenpen = read_decoding(folder)
    vocab = read_vocabulary(folder, settings.vocab_size)
    src, tgt = direction(vocab.languages, src_lang, tgt_lang)
    spm = tokenizer_model(vocab)
    model = convert(read_weights(weights_file), settings, vocab, weights_file.path)
    data = DataConfig(src_lang=src, tgt_lang=tgt, languages=vocab.languages, language_token=vocab.language_token)
    cfg = RunConfig(
        data=data,
        tokenizer=TokenizerConfig(joint=True, vocab_size=settings.vocab_size),
        model=settings.model,
        decode=DecodeConfig(beam=beam, lenpen=lenpen, length_penalty="power", early_stop=False),
    )
    imported = {**origin, "sha256": file_sha256(weights_file.path)}
    save_import(out_dir, model, cfg, {"src": spm, "tgt": spm}, imported)
    return out_dir
