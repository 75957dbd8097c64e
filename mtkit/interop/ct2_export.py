"""Export a trained model to CTranslate2; ct2_translator.py translates with the export.

CTranslate2 runs Transformer inference in C++ with float32, float16, int16 or int8 weights, usually
several times faster than PyTorch on CPU. ``export_ctranslate2`` fills its ``TransformerSpec`` straight
from mtkit's modules, so each of mtkit's choices is mapped here, where a reviewer can check it:

- token embeddings are scaled by sqrt(D) before positions are added (``scale_embeddings``). The
  position table is exported as weights, for sinusoidal positions too: CTranslate2's built-in
  sinusoids put sin and cos in two halves, mtkit interleaves them; fairseq's (an imported NLLB-200's or
  M2M100's) are a table from position 2, whose row 0 is the first token's. Rotary positions have no table:
  CTranslate2 rotates queries and keys in self-attention as mtkit does (two halves, not interleaved
  pairs), and neither rotates in cross-attention.
- post-norm LN(x + f(x)) or pre-norm x + f(LN(x)) with the final LayerNorm pre-norm stacks end with;
  LayerNorm epsilon is the model's own (torch's 1e-5, where CTranslate2 would assume 1e-6).
- the feed-forward activation is the model's (ReLU, erf GELU or swish); the output projection's
  bias, where the model has one, is the projection's bias.
- CTranslate2 wants one fused projection for q, k and v in self-attention, and for k and v in
  cross-attention: the separate mtkit projections are stacked along their output dimension.
- the vocabulary is the SentencePiece pieces in id order, so embedding rows keep their meaning;
  the source gets the eos mtkit appends (``add_source_eos``) and decoding starts from bos, or from eos where
  the model's decoder reads eos there (``model.decoder_start`` eos, as fairseq trained NLLB-200 and M2M100).
- a model told its languages by tokens (``data.languages``) translates between any two of them: the manifest
  records the languages and the piece of their tokens (``language_token``), not every direction, and the
  translator puts the tokens in place (ct2_translator.py).

An export directory holds CTranslate2's files (model.bin, config.json, vocabularies), the tokenizer
model(s) and ``mtkit.json`` (tokenizer file names, positions, decoding defaults, and the SHA-256 and step
of the weights it came from, never a path on the exporter's machine), so ``CTranslate2Translator.from_dir``
(ct2_translator.py) needs nothing else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtkit import untrusted
from mtkit.config import MAX_CORPORA, MAX_LANGUAGES, MAX_POSITIONS, ConfigError, DataConfig, ModelConfig, from_dict
from mtkit.data.directions import data_of, directions, source_prefix
from mtkit.data.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer
from mtkit.decoding.shortlist import load_shortlist, vocabulary_map
from mtkit.files import atomic_write_directory
from mtkit.interop.export_folder import MANIFEST, MANIFEST_FORMAT, check_replaceable, provenance, vocabulary
from mtkit.model.attention import MultiHeadAttention
from mtkit.model.checkpoint import TOKENIZER_NAMES, CheckpointError
from mtkit.model.loading import load_for_inference, resolve
from mtkit.model.positions import ROTARY_BASE
from mtkit.model.transformer import Decoder, Embedder, Encoder, FeedForward, Transformer
from mtkit.version import __version__

VMAP = "vmap.txt"  # CTranslate2's name for a vocabulary map in a model folder


def import_ctranslate2() -> Any:
    """The ctranslate2 module, imported on first use so that mtkit runs without it."""
    try:
        import ctranslate2
        import ctranslate2.specs
    except ImportError:
        raise CheckpointError(
            "CTranslate2 export and decoding needs the ctranslate2 package: pip install ctranslate2"
        ) from None
    return ctranslate2


# -- the specification ----------------------------------------------------------------------


def _array(t: torch.Tensor):
    return t.detach().to("cpu", torch.float32).numpy()


def _fill_linear(spec, *linears: nn.Linear) -> None:
    """One projection whose output is the outputs of ``linears`` stacked (how CTranslate2 fuses q, k, v)."""
    spec.weight = _array(torch.cat([linear.weight for linear in linears]))
    if linears[0].bias is not None:
        spec.bias = _array(torch.cat([linear.bias for linear in linears]))


def _fill_norm(spec, norm: nn.LayerNorm) -> None:
    spec.gamma = _array(norm.weight)
    spec.beta = _array(norm.bias)


def _fill_attention(spec, attn: MultiHeadAttention, norm: nn.LayerNorm, self_attention: bool) -> None:
    """Self-attention: linear = [qkv, out]; cross-attention: [q, kv, out]. ``norm`` is the sublayer's LayerNorm."""
    if self_attention:
        _fill_linear(spec.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
    else:
        _fill_linear(spec.linear[0], attn.q_proj)
        _fill_linear(spec.linear[1], attn.k_proj, attn.v_proj)
    _fill_linear(spec.linear[-1], attn.out_proj)
    _fill_norm(spec.layer_norm, norm)


def _fill_ffn(spec, ffn: FeedForward, norm: nn.LayerNorm) -> None:
    _fill_linear(spec.linear_0, ffn.up)
    _fill_linear(spec.linear_1, ffn.down)
    _fill_norm(spec.layer_norm, norm)


def _fill_inputs(tokens_spec, positions_spec, embed: Embedder) -> None:
    """Token embeddings, and the position table where positions are absolute (rotary ones have none)."""
    tokens_spec.weight = _array(embed.tokens.weight)
    table = embed.learned.weight if embed.learned is not None else embed.table  # (max_positions, D)
    if table is not None:
        positions_spec.encodings = _array(table)


def _fill_encoder(spec, encoder: Encoder) -> None:
    _fill_inputs(spec.embeddings[0], getattr(spec, "position_encodings", None), encoder.embed)
    for layer_spec, layer in zip(spec.layer, encoder.layers):
        _fill_attention(layer_spec.self_attention, layer.self_attn, layer.res_attn.norm, self_attention=True)
        _fill_ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    if isinstance(encoder.final_norm, nn.LayerNorm):
        _fill_norm(spec.layer_norm, encoder.final_norm)


def _fill_decoder(spec, decoder: Decoder, output: nn.Linear) -> None:
    _fill_inputs(spec.embeddings, getattr(spec, "position_encodings", None), decoder.embed)
    for layer_spec, layer in zip(spec.layer, decoder.layers):
        _fill_attention(layer_spec.self_attention, layer.self_attn, layer.res_self.norm, self_attention=True)
        _fill_attention(layer_spec.attention, layer.cross_attn, layer.res_cross.norm, self_attention=False)
        _fill_ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    if isinstance(decoder.final_norm, nn.LayerNorm):
        _fill_norm(spec.layer_norm, decoder.final_norm)
    _fill_linear(spec.projection, output)  # tied weights are stored once: CTranslate2 aliases equal tensors


def build_spec(model: Transformer, cfg: ModelConfig, src_tok: Tokenizer, tgt_tok: Tokenizer):
    """A validated ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (float32, unquantized)."""
    specs = import_ctranslate2().specs
    activation = {"relu": specs.Activation.RELU, "gelu": specs.Activation.GELU, "swish": specs.Activation.SWISH}
    layers = {"num_heads": cfg.heads, "pre_norm": cfg.norm == "pre", "activation": activation[cfg.activation]}
    if cfg.positions == "rotary":  # mtkit rotates the two halves of each head (GPT-NeoX), not interleaved pairs
        layers.update(rotary_dim=cfg.d_model // cfg.heads, rotary_interleave=False, rotary_base=ROTARY_BASE)
    encoder = specs.TransformerEncoderSpec(cfg.encoder_layers, **layers)
    decoder = specs.TransformerDecoderSpec(cfg.decoder_layers, **layers)
    if cfg.positions == "rotary":
        del encoder.position_encodings  # the decoder spec leaves it out for rotary; the encoder spec does not
    spec = specs.TransformerSpec(encoder, decoder)
    _fill_encoder(spec.encoder, model.encoder)
    _fill_decoder(spec.decoder, model.decoder, model.output)
    spec.register_source_vocabulary(vocabulary(src_tok))
    spec.register_target_vocabulary(vocabulary(tgt_tok))
    special = tgt_tok.sp.id_to_piece([UNK_ID, BOS_ID, EOS_ID])
    if src_tok.sp.id_to_piece([UNK_ID, BOS_ID, EOS_ID]) != special:
        raise CheckpointError(
            f"{src_tok.path} and {tgt_tok.path} name unk/bos/eos differently; CTranslate2 needs one name"
        )
    config = spec.config
    config.unk_token, config.bos_token, config.eos_token = special
    config.decoder_start_token = config.eos_token if cfg.decoder_start == "eos" else config.bos_token
    config.add_source_bos, config.add_source_eos = False, True
    config.layer_norm_epsilon = next(m.eps for m in model.modules() if isinstance(m, nn.LayerNorm))
    spec.validate()
    return spec


# -- export ---------------------------------------------------------------------------------


def export_ctranslate2(
    model_path: Path,
    out_dir: Path,
    quantization: str | None = None,
    shortlist: Path | None = None,
    adapter: Path | None = None,
) -> Path:
    """Write ``out_dir``: the model of ``model_path`` (run directory, checkpoint or .safetensors) for CTranslate2,
    with a LoRA ``adapter`` (or a LoRA run's own) merged into its weights; the manifest records the adapter.

    ``quantization`` is the stored weight type (int8, int8_float16, int16, float16, bfloat16, float32...);
    None keeps float32. ``shortlist`` (a file `mtkit shortlist` wrote) goes with it as CTranslate2's
    vocabulary map (``VMAP``), which ``translate_batch(..., use_vmap=True)`` applies. An existing
    export in ``out_dir`` is replaced whole; any other existing folder that is not empty is refused,
    so a mistyped ``-o`` cannot delete someone's files.
    """
    out_dir = Path(out_dir)
    accepted = import_ctranslate2().specs.model_spec.ACCEPTED_MODEL_TYPES
    if quantization is not None and quantization not in accepted:
        raise ConfigError(f"--quantization must be one of {', '.join(accepted)}, got {quantization!r}")
    check_replaceable(out_dir)
    checkpoint = resolve(model_path)
    bundle = load_for_inference(checkpoint, torch.device("cpu"), adapter=adapter, merge=True)
    positions, window = bundle.cfg.model.positions, bundle.cfg.model.attention_window
    if positions not in ("sinusoidal", "learned", "rotary", "fairseq") or window:
        raise ConfigError(
            f"{model_path}: the CTranslate2 export takes sinusoidal, learned, rotary or fairseq positions and no "
            f"attention window; this model has model.positions {positions} and model.attention_window {window}"
        )
    vmap = None
    if shortlist is not None:
        lexical = load_shortlist(Path(shortlist), bundle.src_tok, bundle.tgt_tok)
        vmap = vocabulary_map(lexical, vocabulary(bundle.src_tok), vocabulary(bundle.tgt_tok))
    spec = build_spec(bundle.model, bundle.cfg.model, bundle.src_tok, bundle.tgt_tok)
    for path in {bundle.src_tok.path, bundle.tgt_tok.path}:
        spec.register_file(str(path), path.name)
    spec.optimize(quantization=quantization)
    manifest = {
        "format": MANIFEST_FORMAT,
        "mtkit_version": __version__,
        **provenance(checkpoint, bundle),
        "quantization": quantization or "float32",
        "tokenizer": {"src": bundle.src_tok.path.name, "tgt": bundle.tgt_tok.path.name},
        "max_positions": bundle.cfg.model.max_positions,
        "decode": asdict(bundle.cfg.decode),
        # what the model translates, and the tag each target language needs before the source tokens
        "directions": [list(pair) for pair in directions(bundle.cfg.data)],
        "source_tags": {tgt: source_prefix(bundle.cfg.data, tgt).strip() for _, tgt in directions(bundle.cfg.data)},
    }
    if bundle.cfg.data.languages:  # any two of them; "directions" holds the default one
        manifest |= {"languages": list(bundle.cfg.data.languages), "language_token": bundle.cfg.data.language_token}

    def fill(directory: Path) -> None:
        spec.save(str(directory))
        if vmap is not None:
            (directory / VMAP).write_text(vmap, encoding="utf-8")
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")

    atomic_write_directory(out_dir, fill)
    return out_dir


def read_manifest(ct2_dir: Path) -> dict[str, Any]:
    """The export's ``mtkit.json``, checked: tokenizer file names, max positions, decode settings, the directions
    and the languages told by tokens (``data``, a DataConfig, where it records them).

    The tokenizer names may only be those mtkit gives tokenizer files, never a path.
    """
    path = Path(ct2_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{ct2_dir}: not an mtkit CTranslate2 export (no {MANIFEST}; make one with `mtkit export`)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSON, UTF-8 or nesting
        raise CheckpointError(f"{path}: not readable JSON ({str(err)[:200]})") from None
    if isinstance(manifest, dict) and manifest.get("runtime", "ctranslate2") != "ctranslate2":
        raise CheckpointError(f"{ct2_dir}: an export for {untrusted.shown(manifest['runtime'])}, not for CTranslate2")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{path}: export format {untrusted.shown(found)} is not supported by mtkit {__version__}")
    try:
        untrusted.mapping(manifest, "it", required=("tokenizer", "max_positions", "decode"))
        names = untrusted.mapping(manifest["tokenizer"], "tokenizer", required=("src", "tgt"), optional=())
        for side in ("src", "tgt"):
            untrusted.one_of(names[side], f"tokenizer.{side}", TOKENIZER_NAMES)
        untrusted.integer(manifest["max_positions"], "max_positions", low=8, high=MAX_POSITIONS)
        untrusted.mapping(manifest["decode"], "decode")
        manifest["decode"] = from_dict({"decode": manifest["decode"]}).decode
        if "directions" in manifest:  # none in exports made before they were recorded
            pairs = manifest["directions"]
            if not isinstance(pairs, list) or not 1 <= len(pairs) <= MAX_CORPORA:
                raise untrusted.Malformed(f"directions must be a list of 1 to {MAX_CORPORA} [source, target] pairs")
            for i, pair in enumerate(pairs):
                if not isinstance(pair, list) or len(untrusted.strings(pair, f"directions[{i}]")) != 2:
                    raise untrusted.Malformed(f"directions[{i}] must be a [source, target] pair")
            manifest["data"] = data_of([tuple(pair) for pair in pairs])  # checks the language codes
        if "languages" in manifest:  # a model told its languages by tokens; none in older exports
            manifest["data"] = _with_languages(manifest)
    except (untrusted.Malformed, ConfigError) as err:
        raise CheckpointError(f"{path}: malformed export manifest: {err}") from None
    return manifest


def _with_languages(manifest: dict[str, Any]) -> DataConfig:
    """The data section of a manifest of a model told its languages by tokens: its languages (a bounded list of
    language codes), the piece of their tokens and its default direction, all checked as a config's are."""
    languages, token = manifest["languages"], manifest.get("language_token")
    if not isinstance(languages, list) or not 1 <= len(languages) <= MAX_LANGUAGES:
        raise untrusted.Malformed(f"languages must be a list of 1 to {MAX_LANGUAGES:,} language codes")
    if not isinstance(token, str):
        raise untrusted.Malformed(f"language_token must be a string, got {untrusted.shown(token)}")
    default = manifest.get("data")
    if default is None or default.corpora:
        raise untrusted.Malformed("directions must hold the one default [source, target] pair of its languages")
    return replace(default, languages=tuple(untrusted.strings(languages, "languages")), language_token=token)
