"""Import a transformers model as an mtkit model: ``import_hf`` reads config.json's model_type and imports a
``MarianMTModel`` (OPUS-MT and other Marian models, here) or an
``M2M100ForConditionalGeneration`` (NLLB-200, M2M100: m2m100_import.py).

The source is a folder as ``save_pretrained`` writes it, or a Hugging Face Hub repository, downloaded
through huggingface_hub at a revision and kept in its cache. The output is an mtkit checkpoint folder
(model.safetensors and the tokenizer models) that translate, eval, serve, average, export and
``train.init_from`` take. What Marian models have and how mtkit expresses it, exactly:

- post-norm layers, no final LayerNorm, token embeddings scaled by sqrt(D) (``scale_embedding``),
  swish, GELU or ReLU (``model.activation``), one head count and FFN width for both stacks;
- sinusoidal positions from 0, sin and cos in two halves of the model dimension: the residual stream
  is permuted into mtkit's interleaved layout (marian.py); stored position tables must be those;
- ``final_logits_bias`` becomes the output bias (``model.output_bias``); shared embeddings
  (``share_encoder_decoder_embeddings``) become ``model.tie_embeddings``, a decoder tied to the output
  alone ``model.tie_output``;
- ids: Marian numbers pieces by vocab.json, not by the SentencePiece model. mtkit ids are Marian's
  renumbered: 0 a new padding row, 1 unk, 2 Marian's pad, which is also its decoder start (mtkit's
  bos, never generated), 3 eos, then every other piece in Marian's order. Each side's SentencePiece
  model is rewritten with its pieces in that order (``tokenizer_model``): pieces of the vocabulary that
  the model never produces are kept as unused, pieces the model produces that the vocabulary lacks
  follow the vocabulary and encode as unk (``mtkit.data.tokenizer.vocabulary_size``), as
  MarianTokenizer maps them; language tags (``>>fr<<``) segment whole. The new padding row's logit
  is ``NOT_A_TOKEN``, so every probability is Marian's.
- a folder ``mtkit export --format hf`` wrote (recognised by its vocab.json, ``mtkit_layout``) keeps
  mtkit's ids: its padding rows and appended start id are dropped (they must be a zero row with the
  logit bias ``NOT_A_TOKEN``), and the decoder's position row 0, which carries bos' scaled embedding,
  must be exactly that, so the import is the exported model.
- fp16 and bf16 weights are widened to float32, which keeps every value.

A config mtkit cannot express is refused in one line naming the field. Every file is untrusted:
sizes are bounded before reading: vocab.json by the number of pieces config.json gives it (96 bytes
a piece), the safetensors header by the number of tensors config.json describes; the header's tensors
must fit in the file, and their names and shapes are compared with config.json before a tensor is read
or the model is built, so a config.json describing a huge model allocates nothing, and a vocabulary
(with its vocab.json) is as large as the embeddings the file holds (d_model is at least 16); weights
must be finite; no path is taken from a file, a file may not be a link out of the model's folder (a
snapshot of huggingface_hub's cache links into its repository's blobs/), and pytorch_model.bin loads
with ``weights_only=True``. The rewritten SentencePiece models are loaded once to check that they
give mtkit's special ids, and one whose pieces vocab.json mostly lacks (another model's, or source and
target swapped) is refused.

generate's ``num_beams`` and ``length_penalty`` (generation_config.json's, else config.json's, where
older transformers saved them) become ``decode.beam`` and ``decode.lenpen``, with
``decode.length_penalty`` power, as transformers ranks hypotheses.

The languages a model translates are recorded as ``data.src_lang``/``data.tgt_lang``, as a trained
model's are: given to the import, or read from an OPUS-MT name (``opus-mt-en-de``); otherwise mtkit's
``src`` and ``tgt``. A name's ``mul`` or language-group code (``opus-mt-en-mul``,
``opus-mt-tc-big-en-zle``) states no language, nor does the name of a model whose vocabulary holds
target tags (``>>por<<``) state its target: such a model translates into the language a tag at the
start of the input names, and its tags are recorded (``imported.language_tags``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mtkit import untrusted
from mtkit.config import DataConfig, DecodeConfig, ModelConfig, RunConfig, TokenizerConfig
from mtkit.data.tokenizer import BOS_ID, PAD_ID
from mtkit.files import file_sha256
from mtkit.hub_folders import (
    CONFIG_FILES,
    WEIGHT_FILES,
    ModelImportError,
    check_links,
    locate,
    read_decoding,
    read_mapping,
)
from mtkit.interop.hf_weights import open_weights, read_weights, same_as, take
from mtkit.interop.import_output import check_output, save_import
from mtkit.interop.m2m100_config import MODEL_TYPE as M2M100_TYPE
from mtkit.interop.m2m100_import import import_m2m100
from mtkit.interop.m2m100_vocabulary import TOKENIZER_FILES as M2M100_TOKENIZER_FILES
from mtkit.interop.marian import NOT_A_TOKEN, from_marian, layer_weights, residual_order, to_marian
from mtkit.interop.marian_config import MarianConfig, check_shapes, read_config, tensor_count
from mtkit.interop.marian_languages import languages
from mtkit.interop.marian_vocabulary import Vocabulary, read_vocabularies, target_tags, tokenizer_model
from mtkit.model.transformer import Transformer, build_model, sinusoidal_table

TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json")
MARIAN_FILES = ("config.json", "source.spm", "target.spm", "vocab.json")  # the files every MarianMTModel folder has


# -- converting -----------------------------------------------------------------------------


def _rows(matrix: Tensor, order: list[int], order_dims: Tensor) -> Tensor:
    """Marian's embedding ``matrix`` in mtkit's id order and residual layout, a zero row at the new pad id
    (``order[0]`` -1; mtkit's own export keeps its pad row)."""
    if order[0] >= 0:
        return matrix[torch.tensor(order)][:, torch.argsort(order_dims)]
    rows = matrix[torch.tensor(order[1:])]
    return torch.cat([rows.new_zeros(1, rows.size(1)), rows])[:, torch.argsort(order_dims)]


def _check_dropped(target: Tensor, bias: Tensor, tgt: Vocabulary, path: Path) -> None:
    """mtkit's own export: the ids it appended are no target token (bias ``NOT_A_TOKEN``) and its decoder start
    reads a zero embedding, so dropping them keeps every probability and the first step's input."""
    kept = len(tgt.order)
    if target[-1].any() or (bias[0, kept:] > NOT_A_TOKEN).any():
        raise ModelImportError(
            f"{path}: laid out as mtkit's export, but its appended ids are not a zero start row with a logit bias "
            f"of {NOT_A_TOKEN:g}"
        )


def _check_positions(weights: dict[str, Tensor], model: ModelConfig, path: Path, start: Tensor | None) -> None:
    """Stored position tables (older files have them) must be the sinusoids mtkit computes; in mtkit's own export
    the decoder's row 0 also carries ``start``, what mtkit's bos adds to the first step, which mtkit recomputes."""
    expected = to_marian(sinusoidal_table(model.max_positions, model.d_model), "reads", residual_order(model.d_model))
    for side in ("encoder", "decoder"):
        key = f"model.{side}.embed_positions.weight"
        if key in weights:
            table = weights.pop(key)
            wanted = expected
            if side == "decoder" and start is not None:
                wanted = expected.clone()
                wanted[0] += start
            if table.shape != wanted.shape or (table - wanted).abs().max() > 1e-5:
                raise ModelImportError(f"{path}: {key} is not Marian's sinusoidal table, the positions mtkit computes")


def convert(
    weights: dict[str, Tensor], marian: MarianConfig, src: Vocabulary, tgt: Vocabulary, path: Path
) -> Transformer:
    """The mtkit model computing what the Marian weights compute (see the module docstring)."""
    cfg, d = marian.model, marian.model.d_model
    order = residual_order(d)
    model = build_model(cfg, len(src.order), len(tgt.order), PAD_ID)
    weights = dict(weights)
    with torch.no_grad():
        if marian.shared:
            key = "model.shared.weight" if "model.shared.weight" in weights else "model.encoder.embed_tokens.weight"
            shared = take(weights, key, path, (marian.vocab_size, d))
            for tied in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
                same_as(weights, tied, shared, path)
            model.encoder.embed.tokens.weight.copy_(_rows(shared, src.order, order))
            target = shared
        else:
            source = take(weights, "model.encoder.embed_tokens.weight", path, (marian.vocab_size, d))
            target = take(weights, "model.decoder.embed_tokens.weight", path, (marian.decoder_vocab_size, d))
            model.encoder.embed.tokens.weight.copy_(_rows(source, src.order, order))
            model.decoder.embed.tokens.weight.copy_(_rows(target, tgt.order, order))
            if cfg.tie_output:
                same_as(weights, "lm_head.weight", target, path)
            else:
                output = take(weights, "lm_head.weight", path, (marian.decoder_vocab_size, d))
                model.output.weight.copy_(_rows(output, tgt.order, order))
        bias = weights.pop("final_logits_bias", torch.zeros(1, marian.decoder_vocab_size))
        if tuple(bias.shape) != (1, marian.decoder_vocab_size):
            raise ModelImportError(
                f"{path}: final_logits_bias is {tuple(bias.shape)}, not (1, {marian.decoder_vocab_size})"
            )
        if tgt.exported:
            _check_dropped(target, bias, tgt, path)
            model.output.bias.copy_(bias[0, torch.tensor(tgt.order)])
        else:
            model.output.bias.copy_(torch.cat([torch.tensor([NOT_A_TOKEN]), bias[0, torch.tensor(tgt.order[1:])]]))
        start = model.decoder.embed.scale * target[BOS_ID] if tgt.exported else None
        _check_positions(weights, cfg, path, start)
        for key, tensor, axis in layer_weights(model):
            tensor.copy_(from_marian(take(weights, key, path, tuple(tensor.shape)), axis, order))
    if weights:
        raise ModelImportError(f"{path}: holds {next(iter(weights))}, which no Marian model of config.json has")
    return model.eval()


# -- the import -----------------------------------------------------------------------------


def import_hf(
    source: str,
    out_dir: Path,
    revision: str | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> Path:
    """Write ``out_dir``, an mtkit checkpoint folder, from a transformers folder or Hub repository ``source``: a
    MarianMTModel or an M2M100ForConditionalGeneration (NLLB-200, M2M100: m2m100_import.py), as
    config.json's model_type says."""
    out_dir = Path(out_dir)
    check_output(out_dir)
    names = (*TOKENIZER_FILES, *M2M100_TOKENIZER_FILES)
    folder, roots, origin = locate(source, revision, names)
    check_links(folder, roots, (*CONFIG_FILES, *names, *WEIGHT_FILES), local=Path(source).is_dir())
    config = folder / "config.json"
    if not config.is_file():
        raise ModelImportError(f"{folder}: no config.json, which says what model a transformers folder holds")
    model_type = read_mapping(config).get("model_type")
    if model_type == M2M100_TYPE:
        return import_m2m100(folder, origin, out_dir, src_lang, tgt_lang)
    if model_type != "marian":
        raise ModelImportError(
            f"{config}: model_type must be marian (a MarianMTModel) or {M2M100_TYPE} (an "
            f"M2M100ForConditionalGeneration: NLLB-200, M2M100), got {untrusted.shown(model_type)}"
        )
    return _import_marian_folder(folder, origin, out_dir, src_lang, tgt_lang)


def _import_marian_folder(
    folder: Path, origin: dict[str, str], out_dir: Path, src_lang: str | None, tgt_lang: str | None
) -> Path:
    """The import of the MarianMTModel in ``folder``, found and its links checked."""
    for name in MARIAN_FILES:
        if not (folder / name).is_file():
            raise ModelImportError(
                f"{folder}: no {name}; a MarianMTModel folder has config.json, source.spm, target.spm and vocab.json"
            )
    marian = read_config(folder / "config.json")
    weights_file = open_weights(folder, tensor_count(marian))
    check_shapes(weights_file, marian, folder / "config.json")
    beam, lenpen = read_decoding(folder)
    src, tgt = read_vocabularies(folder, marian)
    tags = target_tags(src, tgt)
    langs = languages(origin["source"].removeprefix("hf:"), src_lang, tgt_lang, tags)
    models = _tokenizer_models(folder, src, tgt)
    model = convert(read_weights(weights_file), marian, src, tgt, weights_file.path)
    cfg = RunConfig(
        data=DataConfig(src_lang=langs[0], tgt_lang=langs[1]),
        tokenizer=TokenizerConfig(joint=models["src"] == models["tgt"], vocab_size=len(tgt.order)),
        model=marian.model,
        decode=DecodeConfig(beam=beam, lenpen=lenpen, length_penalty="power", early_stop=False),
    )
    imported = {
        **origin,
        "sha256": file_sha256(weights_file.path),
        **({"language_tags": " ".join(tags)} if tags else {}),
    }
    save_import(out_dir, model, cfg, models, imported)
    return out_dir


def _tokenizer_models(folder: Path, src: Vocabulary, tgt: Vocabulary) -> dict[str, bytes]:
    """Each side's SentencePiece model rewritten for its vocabulary (the target's is vocab.json's too when the
    two sides share it); language tags segment whole on the source side, where the input names them."""
    tgt_name = "vocab.json" if tgt is src else "target_vocab.json"
    return {
        "src": tokenizer_model(folder / "source.spm", src, "vocab.json", language_tags=True),
        "tgt": tokenizer_model(folder / "target.spm", tgt, tgt_name, language_tags=False),
    }
