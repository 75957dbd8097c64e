"""The server's searches: a translator configured with a request's options, the search that requests of the same
options share (continuous where the translator allows it), the scoring of given translations, and the batcher that
runs them all. A request's options name its adapter too (None: the model's own), so requests for two adapters are
never searched or scored together."""

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
Translators = dict[str | None, LineTranslator]  # the served model's translator (None) and each adapter's, by name


@dataclass(frozen=True)
class Scoring:
    """The options of a request to score pairs (those of a request to translate are a tuple, ``configured``): the
    target language (None for the model's only one), whether each target token's log-probability is wanted, the
    adapter (None for the model's own) and the source language (None for the model's default)."""

    tgt_lang: str | None
    tokens: bool
    adapter: str | None = None
    src_lang: str | None = None


def aligning(translator: LineTranslator) -> LineTranslator:
    """``translator`` giving each best translation its word alignment, from its (first) model's cross-attention."""
    if not isinstance(translator, Translator):
        raise ValueError("only mtkit's engine gives word alignments")
    chosen = copy.copy(translator)
    chosen.aligner = aligner_of(translator.model)
    return chosen


def configured(translators: Translators, options: Hashable) -> LineTranslator:
    """The translator of a request's adapter with its options: (beam, nbest, alignments, target language or None,
    source language or None, adapter or None)."""
    beam, nbest, alignments, tgt_lang, src_lang, adapter = options
    chosen = translators[adapter].using(beam=beam, nbest=nbest).choosing(tgt_lang, src_lang)
    return aligning(chosen) if alignments else chosen


def translate_all(translators: Translators, lines: list[str], options: Hashable) -> list[list[Translation]]:
    """The translations of each line with a request's options, all at once."""
    return list(configured(translators, options).hypotheses(lines))


def score_all(translators: Translators, pairs: list[Pair], options: Scoring) -> list[PairScore]:
    """The score of each pair under the model (with the request's adapter), all at once."""
    sources, targets = [source for source, _ in pairs], [target for _, target in pairs]
    translator = translators[options.adapter]
    return list(translator.score(sources, targets, options.tgt_lang, options.tokens, options.src_lang))


def answer_all(translators: Translators, work: list[Work], options: Hashable) -> list[Answer]:
    """The answer to each of a request's texts or pairs, all at once: scores where its options are ``Scoring``,
    translations otherwise."""
    if isinstance(options, Scoring):
        return score_all(translators, work, options)
    return translate_all(translators, work, options)


def open_search(translators: Translators, continuous: bool, options: Hashable) -> Search[Work, Answer]:
    """The search that the requests of the same options share: continuous where the translator allows it; pairs
    to score are scored all at once."""
    if isinstance(options, Scoring):
        return WholeBatch(functools.partial(answer_all, translators), options)
    chosen = configured(translators, options)
    if continuous and LineSearch.accepts(chosen):
        return LineSearch(chosen)
    return WholeBatch(functools.partial(answer_all, translators), options)


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


def make_batcher(translators: Translators, cfg: ServeConfig) -> Batcher[Work, Answer]:
    """The batcher of the server's searches and scorings, as ``cfg`` sets it up: the one thread that uses the
    model, and its adapters."""
    return Batcher(
        functools.partial(answer_all, translators),
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        functools.partial(open_search, translators, cfg.continuous),
    )
