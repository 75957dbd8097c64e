"""The server's searches: a translator configured with a request's options, the search that requests of the same
options share (continuous where the translator allows it), the scoring of given translations, and the batcher that
runs them all."""

from __future__ import annotations

import copy
import functools
from collections.abc import Hashable
from dataclasses import dataclass

from mtkit.config import ServeConfig
from mtkit.decoding.continuous import LineSearch
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import LineTranslator, PairScore, Translation, Translator, aligner_of
from mtkit.serving.batcher import Batcher, Search, WholeBatch

Pair = tuple[str, str]  # a source and a translation of it, to score
Work = str | Pair  # what the server's batcher takes of a request: each text to translate, or each pair to score
Answer = list[Translation] | PairScore  # what it gives back for each: the text's translations, or the pair's score


@dataclass(frozen=True)
class Scoring:
    """The options of a request to score pairs (those of a request to translate are a tuple, ``configured``): the
    target language (None for the model's only one) and whether each target token's log-probability is wanted."""

    tgt_lang: str | None
    tokens: bool


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


def score_all(translator: LineTranslator, pairs: list[Pair], options: Scoring) -> list[PairScore]:
    """The score of each pair under the model, all at once."""
    sources, targets = [source for source, _ in pairs], [target for _, target in pairs]
    return list(translator.score(sources, targets, options.tgt_lang, options.tokens))


def answer_all(translator: LineTranslator, work: list[Work], options: Hashable) -> list[Answer]:
    """The answer to each of a request's texts or pairs, all at once: scores where its options are ``Scoring``,
    translations otherwise."""
    if isinstance(options, Scoring):
        return score_all(translator, work, options)
    return translate_all(translator, work, options)


def open_search(translator: LineTranslator, continuous: bool, options: Hashable) -> Search[Work, Answer]:
    """The search that the requests of the same options share: continuous where the translator allows it; pairs
    to score are scored all at once."""
    if isinstance(options, Scoring):
        return WholeBatch(functools.partial(answer_all, translator), options)
    chosen = configured(translator, options)
    if continuous and LineSearch.accepts(chosen):
        return LineSearch(chosen)
    return WholeBatch(functools.partial(answer_all, translator), options)


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


def make_batcher(translator: LineTranslator, cfg: ServeConfig) -> Batcher[Work, Answer]:
    """The batcher of the server's searches and scorings, as ``cfg`` sets it up: the one thread that uses the
    model."""
    return Batcher(
        functools.partial(answer_all, translator),
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        functools.partial(open_search, translator, cfg.continuous),
    )
