"""The server's searches: a translator configured with a request's options, the search that requests of the same
options share (continuous where the translator allows it), and the batcher that runs them."""

from __future__ import annotations

import copy
import functools
from collections.abc import Hashable

from mtkit.config import ServeConfig
from mtkit.decoding.continuous import LineSearch
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import LineTranslator, Translation, Translator, aligner_of
from mtkit.serving.batcher import Batcher, Search, WholeBatch


def aligning(translator: LineTranslator) -> LineTranslator:
    """``translator`` giving each best translation its word alignment, from its (first) model's cross-attention."""
    if not isinstance(translator, Translator):
        raise ValueError("only mtkit's engine gives word alignments")
    chosen = copy.copy(translator)
    chosen.aligner = aligner_of(translator.model)
    return chosen


def configured(translator: LineTranslator, options: Hashable) -> LineTranslator:
    """``translator`` with a request's options: (beam, nbest, alignments, target language or None)."""
    beam, nbest, alignments, tgt_lang = options
    chosen = translator.using(beam=beam, nbest=nbest)
    chosen = chosen.into(tgt_lang) if tgt_lang is not None else chosen
    return aligning(chosen) if alignments else chosen


def translate_all(translator: LineTranslator, lines: list[str], options: Hashable) -> list[list[Translation]]:
    """The translations of each line with a request's options, all at once."""
    return list(configured(translator, options).hypotheses(lines))


def open_search(translator: LineTranslator, continuous: bool, options: Hashable) -> Search[list[Translation]]:
    """The search that the requests of the same options share: continuous where the translator allows it."""
    chosen = configured(translator, options)
    if continuous and LineSearch.accepts(chosen):
        return LineSearch(chosen)
    return WholeBatch(functools.partial(translate_all, translator), options)


def batching(translator: LineTranslator, continuous: bool) -> str:
    """How the server searches, as its log and /v1/models say: continuously, or in whole batches and why."""
    if not continuous:
        return "whole batches (--no-continuous)"
    if LineSearch.accepts(translator):
        return "continuous"
    if not isinstance(translator, Translator):
        return "whole batches (the ctranslate2 engine batches its own searches)"
    if isinstance(translator.model, Ensemble):
        return "whole batches (an ensemble)"
    return "whole batches"


def make_batcher(translator: LineTranslator, cfg: ServeConfig) -> Batcher[list[Translation]]:
    """The batcher of the server's searches, as ``cfg`` sets it up."""
    return Batcher(
        functools.partial(translate_all, translator),
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        functools.partial(open_search, translator, cfg.continuous),
    )
