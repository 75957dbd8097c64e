"""Which engine translates: mtkit's own search (mtkit.decoding) or CTranslate2 over an export
(mtkit.interop), both behind ``LineTranslator``; ``mtkit.load`` is ``load_translator``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtkit.config import ConfigError, Engine, InferenceConfig, InferencePrecision, SamplingConfig
from mtkit.data.directions import default_languages, tags_targets
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import LineTranslator, Translator, aligner_of, with_overrides
from mtkit.decoding.shortlist import load_shortlist
from mtkit.model.checkpoint import CheckpointError
from mtkit.model.loading import load_for_inference

# What each engine cannot do: option -> how `mtkit translate` names it. CTranslate2 runs its own search
# over one export: no forced prefix, no sampling, no word alignments, its own rule for when a search ends,
# and a shortlist only as the vocabulary map an export made with one carries.
REFUSED_OPTIONS: dict[str, dict[str, str]] = {
    "mtkit": {},
    "ctranslate2": {
        "sampling": "--sample",
        "prefix": "--prefix",
        "alignments": "--alignments",
        "no_early_stop": "--no-early-stop",
        "ensemble": "an ensemble",
        "shortlist": "--shortlist (an export made with --shortlist carries CTranslate2's use_vmap map)",
        "adapter": "--adapter (`mtkit export --adapter` merges one into the export)",
    },
}


def refused_options(engine: str, asked: dict[str, bool]) -> list[str]:
    """The options ``engine`` cannot do among those ``asked`` for (option: whether asked), in REFUSED_OPTIONS's
    order."""
    return [option for option in REFUSED_OPTIONS.get(engine, {}) if asked.get(option)]


def load_translator(
    models: str | Path | Sequence[str | Path],
    device: str = InferenceConfig.device,
    precision: InferencePrecision = InferenceConfig.precision,
    engine: Engine = InferenceConfig.engine,
    nbest: int = 1,
    sampling: SamplingConfig | None = None,
    alignments: bool = False,
    shortlist: str | Path | None = None,
    tgt_lang: str | None = None,
    threads: int = InferenceConfig.threads,
    src_lang: str | None = None,
    adapter: str | Path | None = None,
    **decode: Any,
) -> LineTranslator:
    """A translator over ``models``: run directories (their best/), checkpoints or .safetensors files,
    several of them an ensemble that averages their log-probabilities; with ``engine="ctranslate2"``,
    one folder that `mtkit export` wrote.

    Decoding follows the settings saved with the (first) model, then ``decode`` (``beam=4``,
    ``lenpen=0.6``, ...). Weights are cast to ``precision`` once (``auto``: bf16 where the device computes it
    natively, else fp32; ``int8``: the linear layers' weights and activations in int8, on the CPU; with
    CTranslate2, ``auto`` is the export's own weight type); ``alignments`` adds word alignments
    from the first model's cross-attention; ``sampling`` draws tokens instead of searching;
    ``shortlist``, a file `mtkit shortlist` wrote, limits each batch's outputs to its candidates;
    ``tgt_lang`` the language to translate into, one the model was trained for (a model of several target
    languages takes it here or in each ``translate`` call; ConfigError listing its directions otherwise);
    ``src_lang`` the source language, which a model told its languages by tokens (an imported NLLB-200 or
    M2M100) needs unless its config names a default; ``adapter`` a LoRA adapter of the one model (an adapter
    file, or a LoRA run or checkpoint), kept beside its weights (mtkit.model.loading);
    ``threads`` the CPU threads this process translates on (0: OMP_NUM_THREADS where set, else torch's default of
    one per core; with CTranslate2 its ``intra_threads``), set before the model loads.
    """
    from mtkit.runtime import pick_device, resolve_precision, set_threads

    models = [Path(m) for m in ([models] if isinstance(models, (str, Path)) else models)]
    dev = pick_device(device)
    asked = {
        "ensemble": len(models) != 1,
        "sampling": sampling is not None,
        "alignments": alignments,
        "shortlist": shortlist is not None,
        "adapter": adapter is not None,
    }
    if unsupported := refused_options(engine, asked):
        raise ConfigError(f"the {engine} engine takes one model and no {', '.join(unsupported)}")
    if threads < 0:
        raise ConfigError(f"threads must be >= 0 (0: the default), got {threads}")
    set_threads(threads)
    if engine == "ctranslate2":
        from mtkit.interop.ct2_translator import CTranslate2Translator

        if precision == "auto":
            compute_type, chosen = "default", {"precision": "auto", "reason": "the export's own weight type"}
        else:
            compute_type = {"fp32": "default", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}[precision]
            chosen = resolve_precision(precision, dev).to_dict()
        engine_translator = CTranslate2Translator.from_dir(
            models[0], decode, dev.type, compute_type, nbest, threads=threads
        )
        engine_translator.precision = chosen
        return _choose_target(engine_translator, tgt_lang, src_lang)
    if engine != "mtkit":
        raise ConfigError(f"engine must be mtkit or ctranslate2, got {engine!r}")
    choice = resolve_precision(precision, dev)
    if adapter is not None and len(models) > 1:
        raise ConfigError("an adapter adapts one model, not an ensemble")
    bundles = [load_for_inference(path, dev, choice.precision, adapter) for path in models]
    first = bundles[0]
    for path, other in zip(models[1:], bundles[1:]):
        if (other.src_tok.sha256, other.tgt_tok.sha256) != (first.src_tok.sha256, first.tgt_tok.sha256):
            raise CheckpointError(f"{path}: its tokenizers differ from those of {models[0]}; cannot ensemble them")
    network = Ensemble([b.model for b in bundles]) if len(bundles) > 1 else first.model
    aligner = aligner_of(network) if alignments else None
    settings = with_overrides(first.cfg.decode, decode)
    lexical = load_shortlist(Path(shortlist), first.src_tok, first.tgt_tok) if shortlist is not None else None
    translator = Translator(
        network, first.src_tok, first.tgt_tok, settings, dev, nbest, sampling, aligner, shortlist=lexical
    )
    translator.data = first.cfg.data
    translator.precision = choice.to_dict()
    return _choose_target(translator, tgt_lang, src_lang)


def _choose_target(translator: LineTranslator, tgt_lang: str | None, src_lang: str | None) -> LineTranslator:
    """``translator`` into ``tgt_lang`` (from ``src_lang``), or into the model's one target language; a model of
    several (or one told its languages by tokens, without a default direction) is left to each call to choose,
    unless the languages given do."""
    data = translator.data
    if data is not None and tgt_lang is None and src_lang is None:
        if tags_targets(data) or (data.languages and None in default_languages(data)):
            return translator
    return translator.into(tgt_lang, src_lang)
