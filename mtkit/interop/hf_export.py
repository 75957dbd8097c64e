"""Export a trained model as a transformers ``MarianMTModel`` folder, which runs without mtkit.

``MarianMTModel`` is the post-norm encoder-decoder of the paper, as mtkit's default model is: token
embeddings scaled by sqrt(D), sinusoidal positions from 0, ReLU (or GELU, or swish), LayerNorm (epsilon
1e-5) after each residual, no final LayerNorm, an optional bias on the logits (``final_logits_bias``).
The mapping, each choice where a reviewer can check it:

- positions: Marian computes its sinusoids itself, sin and cos in two halves of the model dimension
  where mtkit interleaves them; one permutation of the residual stream maps one layout to the other
  (marian.py, which names every weight inside the layers for the export and the import).
- vocabulary: the SentencePiece pieces in id order (vocab.json), so row i stays id i, and one more
  id after them, ``<pad>``, with a zero embedding: Marian's own layout, where the decoder starts from
  pad's zero embedding and pad is the last id (the piece SentencePiece calls pad, id 0, is renamed
  ``<unused:0>``; no text encodes to it). mtkit's decoder starts from bos, so the decoder's position
  table carries bos's scaled embedding in row 0, which only the start token ever reads: zero + row 0
  is what mtkit computes at step 0. The position tables are therefore written to model.safetensors
  (Marian computes them itself only when the file has none), and CTranslate2's
  ``ct2-transformers-converter``, which starts Marian decoders from a zero embedding, drops the last
  id and reads the tables from the loaded model, converts the folder to the same function. Two
  vocabularies of different sizes are padded to one size with ``<unused:N>`` rows. Rows that are no
  target token (the appended and padding ones) get a ``final_logits_bias`` of -1e4, so they take no
  share of the softmax; every other bias is the model's output bias, or 0. Tied embeddings map to
  ``share_encoder_decoder_embeddings`` + ``tie_word_embeddings``, a tied output alone
  (``model.tie_output``) to ``tie_word_embeddings``, untied ones (two vocabularies or one) to separate
  encoder, decoder and output matrices.
- special ids: unk 1, bos 2 and eos 3 are mtkit's; the tokenizer appends eos to the source and pads
  with ``<pad>``, and mtkit's pad and bos are never generated (``suppress_tokens``).
- decoding defaults (generation_config.json): ``num_beams`` is decode.beam. transformers divides a
  hypothesis' log-probability by length ** a (eos counted, the start token not), as mtkit's
  decode.length_penalty ``power`` does: ``length_penalty`` is then decode.lenpen. mtkit's ``gnmt``
  divides by ((5 + length) / 6) ** alpha; the two change with length alike, at one length L, when
  a = alpha * L / (5 + L), and ``length_penalty`` is that a at ``PENALTY_LENGTH`` tokens, a typical
  sentence (at 15 or 30 tokens a would be 6% smaller or 7% larger). transformers stops once
  ``num_beams`` hypotheses have ended (mtkit's decode.early_stop false); ``min_new_tokens`` is
  decode.min_len. mtkit caps each sentence at max_len_a * source length + max_len_b tokens (eos
  included); transformers has one bound per call, so ``max_new_tokens`` is the model's own limit,
  max_positions, which no sentence's cap exceeds. Pass ``max_new_tokens`` to a call to bound it
  tighter; ``forced_eos_token_id`` ends a hypothesis cut there with eos, as mtkit's cap does.

Refused, with the reason: pre-norm models (Marian has no final LayerNorm), learned, relative or rotary
positions and attention windows (Marian has sinusoidal positions and full attention only).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtkit.config import ConfigError, DecodeConfig, ModelConfig
from mtkit.data.directions import directions, tags_targets
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from mtkit.files import atomic_write_directory
from mtkit.interop.export_folder import MANIFEST, MANIFEST_FORMAT, check_replaceable, provenance, vocabulary
from mtkit.interop.marian import NOT_A_TOKEN, layer_weights, residual_order, to_marian
from mtkit.model.checkpoint import CheckpointError
from mtkit.model.loading import InferenceBundle, load_for_inference, resolve
from mtkit.model.transformer import Transformer
from mtkit.version import __version__

RUNTIME = "transformers"  # the manifest's runtime, which tells this export from a CTranslate2 one
START_PIECE = "<pad>"  # the id after both vocabularies: Marian's pad and decoder start, named as Marian names it
PENALTY_LENGTH = 20  # tokens: where transformers' length penalty is made to act as mtkit's (see the module)


def import_transformers() -> Any:
    """The transformers module, imported on first use so that mtkit runs without it."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError(
            "the transformers export needs transformers: pip install -e '.[hf]' in mtkit's clone"
        ) from None
    return transformers


def transformers_manifest(checkpoint: Path, bundle: InferenceBundle) -> dict[str, Any]:
    """The mtkit.json of a transformers export of ``checkpoint`` (loaded as ``bundle``), of either architecture."""
    return {
        "format": MANIFEST_FORMAT,
        "runtime": RUNTIME,
        "mtkit_version": __version__,
        **provenance(checkpoint, bundle),
        "decode": asdict(bundle.cfg.decode),
    }


def check_expressible(cfg: ModelConfig) -> None:
    """ConfigError naming what ``MarianMTModel`` cannot compute, if anything."""
    if cfg.norm != "post":
        raise ConfigError("MarianMTModel is post-norm only (no final LayerNorm); this model has model.norm pre")
    if cfg.positions != "sinusoidal":
        raise ConfigError(
            f"MarianMTModel has sinusoidal positions only; this model has model.positions {cfg.positions}"
        )
    if cfg.attention_window:
        raise ConfigError(
            f"MarianMTModel attends to every position; this model has model.attention_window {cfg.attention_window}"
        )
    if cfg.decoder_start != "bos":
        raise ConfigError("this export's decoder starts from mtkit's bos; this model has model.decoder_start eos")


def start_id(src_vocab: int, tgt_vocab: int) -> int:
    """The appended id (``START_PIECE``): the decoder's start and the padding; the export has one more rows."""
    return max(src_vocab, tgt_vocab)


def _with_rows(matrix: Tensor, rows: int) -> Tensor:
    """``matrix`` with zero rows appended up to ``rows``."""
    return torch.cat([matrix, matrix.new_zeros(rows - matrix.size(0), matrix.size(1))])


def marian_weights(model: Transformer, tied: bool) -> dict[str, Tensor]:
    """The state dict of the equivalent ``MarianMTModel`` (see the module docstring for the layout)."""
    order = residual_order(model.output.in_features)
    src_vocab, tgt_vocab = model.encoder.embed.tokens.num_embeddings, model.output.out_features
    rows = start_id(src_vocab, tgt_vocab) + 1
    src = _with_rows(model.encoder.embed.tokens.weight[:, order], rows)
    tgt = src if tied else _with_rows(model.decoder.embed.tokens.weight[:, order], rows)
    tied_output = model.output.weight is model.decoder.embed.tokens.weight
    out = tgt if tied_output else _with_rows(model.output.weight[:, order], rows)
    layers = {name: to_marian(tensor, axis, order) for name, tensor, axis in layer_weights(model)}
    embeddings = {"model.encoder.embed_tokens.weight": src, "model.decoder.embed_tokens.weight": tgt}
    if tied:
        embeddings["model.shared.weight"] = src
    positions = model.encoder.embed.table[:, order]
    decoder_positions = positions.clone()
    decoder = model.decoder.embed
    decoder_positions[0] += decoder.scale * decoder.tokens.weight[BOS_ID, order]  # what the start token reads
    final_logits_bias = torch.zeros(1, rows)
    if model.output.bias is not None:
        final_logits_bias[0, :tgt_vocab] = model.output.bias
    final_logits_bias[0, tgt_vocab:] = NOT_A_TOKEN
    return {
        **embeddings,
        "model.encoder.embed_positions.weight": positions,
        "model.decoder.embed_positions.weight": decoder_positions,
        **layers,
        "lm_head.weight": out,
        "final_logits_bias": final_logits_bias,
    }


def marian_config(cfg: ModelConfig, src_vocab: int, tgt_vocab: int) -> dict[str, Any]:
    """``MarianConfig`` arguments for a model of ``cfg``."""
    start = start_id(src_vocab, tgt_vocab)
    return {
        "vocab_size": start + 1,
        "decoder_vocab_size": start + 1,
        "share_encoder_decoder_embeddings": cfg.tie_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings or cfg.tie_output,
        "max_position_embeddings": cfg.max_positions,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.encoder_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.heads,
        "decoder_attention_heads": cfg.heads,
        "encoder_ffn_dim": cfg.ffn,
        "decoder_ffn_dim": cfg.ffn,
        "activation_function": cfg.activation,  # transformers' names: relu, gelu (erf), swish
        "scale_embedding": True,
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout,
        "activation_dropout": cfg.activation_dropout,
        "pad_token_id": start,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "decoder_start_token_id": start,
        "forced_eos_token_id": EOS_ID,
    }


def transformers_length_penalty(decode: DecodeConfig, length: int = PENALTY_LENGTH) -> float:
    """The a of transformers' length ** a: decode.lenpen itself for the ``power`` penalty; for ``gnmt``, the a that
    changes with length as ((5 + length) / 6) ** alpha does at ``length``."""
    if decode.length_penalty == "power":
        return decode.lenpen
    return round(decode.lenpen * length / (5 + length), 4)


def generation_settings(decode: DecodeConfig, max_positions: int, start: int) -> dict[str, Any]:
    """``GenerationConfig`` arguments: the run's decoding, as far as transformers can say it (see the module)."""
    settings: dict[str, Any] = {
        "decoder_start_token_id": start,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": start,
        "forced_eos_token_id": EOS_ID,
        "suppress_tokens": [PAD_ID, BOS_ID],
        "max_new_tokens": max_positions,  # the decoder reads the start token and all but the last of these
        "num_beams": decode.beam,
    }
    if decode.beam > 1:
        settings.update(length_penalty=transformers_length_penalty(decode), early_stopping=True)
    if decode.min_len:
        settings["min_new_tokens"] = decode.min_len
    return settings


def _special_pieces(src_tok: Tokenizer, tgt_tok: Tokenizer) -> dict[str, str]:
    """unk and eos as the tokenizers name them (MarianTokenizer takes one name for each), and the pad piece."""
    ids = [UNK_ID, EOS_ID]
    names = tgt_tok.sp.id_to_piece(ids)
    if src_tok.sp.id_to_piece(ids) != names:
        raise CheckpointError(f"{src_tok.path} and {tgt_tok.path} name unk/eos differently; Marian needs one name")
    return {"unk_token": names[0], "eos_token": names[1], "pad_token": START_PIECE}


def _piece_ids(tok: Tokenizer, rows: int) -> str:
    """vocab.json: piece -> id for ``rows`` ids, the last ``START_PIECE`` (see the module docstring)."""
    pieces = vocabulary(tok)
    pieces[PAD_ID] = "<unused:0>"  # mtkit's pad is no input or output of the export; the name is START_PIECE's
    pieces += [f"<unused:{i}>" for i in range(len(pieces), rows - 1)] + [START_PIECE]
    return json.dumps({piece: i for i, piece in enumerate(pieces)}, ensure_ascii=False, indent=1) + "\n"


def _save_tokenizer(directory: Path, src_tok: Tokenizer, tgt_tok: Tokenizer, max_positions: int) -> None:
    """source.spm, target.spm, vocab.json (+ target_vocab.json for two vocabularies), tokenizer_config.json."""
    transformers = import_transformers()
    separate = src_tok.path != tgt_tok.path
    rows = start_id(src_tok.vocab_size, tgt_tok.vocab_size) + 1
    with tempfile.TemporaryDirectory() as tmp:
        vocab, target_vocab = Path(tmp) / "vocab.json", Path(tmp) / "target_vocab.json"
        vocab.write_text(_piece_ids(src_tok, rows), encoding="utf-8")
        target_vocab.write_text(_piece_ids(tgt_tok, rows), encoding="utf-8")
        tokenizer = transformers.MarianTokenizer(
            source_spm=str(src_tok.path),
            target_spm=str(tgt_tok.path),
            vocab=str(vocab),
            target_vocab_file=str(target_vocab) if separate else None,
            separate_vocabs=separate,
            model_max_length=max_positions,
            **_special_pieces(src_tok, tgt_tok),
        )
        tokenizer.save_pretrained(str(directory))


def _marian_model(model: Transformer, cfg: ModelConfig, src_vocab: int, tgt_vocab: int) -> Any:
    """A ``MarianMTModel`` holding ``model``'s weights, position tables included."""
    transformers = import_transformers()
    marian = transformers.MarianMTModel(transformers.MarianConfig(**marian_config(cfg, src_vocab, tgt_vocab)))
    weights = marian_weights(model, cfg.tie_embeddings)
    with torch.no_grad():
        marian.load_state_dict({k: v.detach().clone() for k, v in weights.items()})
    return marian.eval()


def _save_model(marian: Any, directory: Path) -> None:
    """config.json and model.safetensors, the position tables kept: ``save_pretrained`` leaves them out."""
    from safetensors.torch import load_file, save_file

    marian.save_pretrained(str(directory))
    path = directory / "model.safetensors"
    weights = load_file(path)
    state = marian.state_dict()
    for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        weights[key] = state[key].detach().clone()
    save_file(weights, path, metadata={"format": "pt"})


def export_transformers(model_path: Path, out_dir: Path, adapter: Path | None = None) -> Path:
    """Write ``out_dir``: the model of ``model_path`` (run directory, checkpoint or .safetensors) as a
    transformers MarianMTModel with its MarianTokenizer and the run's decoding defaults, with a LoRA ``adapter``
    (or a LoRA run's own) merged into its weights; the manifest records the adapter.

    An existing export in ``out_dir`` is replaced whole; any other folder that is not empty is refused.
    """
    out_dir = Path(out_dir)
    transformers = import_transformers()
    check_replaceable(out_dir)
    checkpoint = resolve(model_path)
    bundle = load_for_inference(checkpoint, torch.device("cpu"), adapter=adapter, merge=True)
    cfg = bundle.cfg.model
    try:
        check_expressible(cfg)
    except ConfigError as err:
        raise ConfigError(f"{model_path}: cannot export to transformers: {err}") from None
    if tags_targets(bundle.cfg.data):
        targets = ", ".join(dict.fromkeys(tgt for _, tgt in directions(bundle.cfg.data)))
        raise ConfigError(
            f"{model_path}: cannot export to transformers: the model translates into {targets} by a tag before "
            "each source, which MarianTokenizer does not put there (export it to CTranslate2)"
        )
    marian = _marian_model(bundle.model, cfg, bundle.src_tok.vocab_size, bundle.tgt_tok.vocab_size)
    start = start_id(bundle.src_tok.vocab_size, bundle.tgt_tok.vocab_size)
    settings = generation_settings(bundle.cfg.decode, cfg.max_positions, start)
    marian.generation_config = transformers.GenerationConfig(**settings)
    manifest = transformers_manifest(checkpoint, bundle)

    def fill(directory: Path) -> None:
        _save_model(marian, directory)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Recommended: pip install sacremoses")  # it never normalises here
            _save_tokenizer(directory, bundle.src_tok, bundle.tgt_tok, cfg.max_positions)
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")

    transformers.utils.logging.disable_progress_bar()  # a bar for writing one small file is noise
    try:
        atomic_write_directory(out_dir, fill)
    finally:
        transformers.utils.logging.enable_progress_bar()
    return out_dir
