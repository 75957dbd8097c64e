"""The server's searches: a translator configured with a request's options, the search that requests of the same
options share (continuous where the translator allows it), the scoring of given translations, and the batcher that
runs them all. A request's options name its model and its adapter too (None: the model's own), so requests for two
models or two adapters are never searched or scored together, and each model's requests queue apart."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mtkit.config import ServeConfig
from mtkit.decoding.continuous import LineSearch
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import LineTranslator, PairScore, Translation, Translator, aligner_of
from mtkit.serving.batcher import Admit, Batcher, Search, WholeBatch

Pair = tuple[str, str]  # a source and a translation of it, to score
Work = str | Pair  # what the server's batcher takes of a request: each text to translate, or each pair to score
Answer = list[Translation] | PairScore  # what it gives back for each: the text's translations, or the pair's score
Translators = dict[str | None, LineTranslator]  # a served model's translator (None) and each adapter's, by name
TranslatorsOf = Callable[[str], Translators]  # a served model's translators by its name, loaded when it is not


class Translating(NamedTuple):
    """The options of a request to translate: the served model (by name), beam, nbest, whether word alignments are
    wanted, the target language (None for the model's only one), the source language (None for the model's
    default) and the adapter (None for the model's own)."""

    model: str
    beam: int
    nbest: int = 1
    alignments: bool = False
    tgt_lang: str | None = None
    src_lang: str | None = None
    adapter: str | None = None


@dataclass(frozen=True)
class Scoring:
    """The options of a request to score pairs: the served model (by name), the target language (None for the
    model's only one), whether each target token's log-probability is wanted, the adapter (None for the model's own)
    and the source language (None for the model's default)."""

    model: str
    tgt_lang: str | None
    tokens: bool
    adapter: str | None = None
    src_lang: str | None = None


Options = Translating | Scoring


def aligning(translator: LineTranslator) -> LineTranslator:
    """``translator`` giving each best translation its word alignment, from its (first) model's cross-attention."""
    if not isinstance(translator, Translator):
        raise ValueError("only mtkit's engine gives word alignments")
    chosen = copy.copy(translator)
    chosen.aligner = aligner_of(translator.model)
    return chosen


def configured(translators: Translators, options: Translating) -> LineTranslator:
    """The translator of a request's adapter with its options."""
    chosen = translators[options.adapter].using(beam=options.beam, nbest=options.nbest)
    chosen = chosen.choosing(options.tgt_lang, options.src_lang)
    return aligning(chosen) if options.alignments else chosen


def translate_all(translators: Translators, lines: list[str], options: Translating) -> list[list[Translation]]:
    """The translations of each line with a request's options, all at once."""
    return list(configured(translators, options).hypotheses(lines))


def score_all(translators: Translators, pairs: list[Pair], options: Scoring) -> list[PairScore]:
    """The score of each pair under the model (with the request's adapter), all at once."""
    sources, targets = [source for source, _ in pairs], [target for _, target in pairs]
    translator = translators[options.adapter]
    return list(translator.score(sources, targets, options.tgt_lang, options.tokens, options.src_lang))


def answer_all(translators_of: TranslatorsOf, work: list[Work], options: Hashable) -> list[Answer]:
    """The answer to each of a request's texts or pairs, all at once: scores where its options are ``Scoring``,
    translations otherwise."""
    translators = translators_of(options.model)
    if isinstance(options, Scoring):
        return score_all(translators, work, options)
    return translate_all(translators, work, options)


def open_search(translators_of: TranslatorsOf, continuous: bool, options: Hashable) -> Search[Work, Answer]:
    """The search that the requests of the same options share: continuous where the translator allows it; pairs
    to score are scored all at once. Its model is loaded now, in the batcher's thread, never by a step that
    ``ModelSteps`` runs in a thread of its pool."""
    if isinstance(options, Scoring):
        translators_of(options.model)
        return WholeBatch(functools.partial(answer_all, translators_of), options)
    chosen = configured(translators_of(options.model), options)
    if continuous and LineSearch.accepts(chosen):
        return LineSearch(chosen)
    return WholeBatch(functools.partial(answer_all, translators_of), options)


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


class ModelSteps:
    """The steps of several models' searches at once, each model's in a thread of a small pool, torch on one
    thread in each: on a 2-core CPU, three searches stepped at once on one torch thread each went 1.4 times as fast as
    one thread stepping them in turn on two (docs/benchmarks.md, "Several models in one server"). The steps of one
    model alone stay in the batcher's thread, on all of torch's threads, as a server of one model runs them."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or max(2, os.cpu_count() or 1)
        self.pool: ThreadPoolExecutor | None = None

    def __call__(self, steps: list[Callable[[], None]]) -> None:
        if len(steps) == 1:
            steps[0]()
            return
        if self.pool is None:
            torch.get_num_threads()  # this thread settles its own torch threads before the pool's set theirs to one
            self.pool = ThreadPoolExecutor(self.threads, "mtkit-search", initializer=_one_torch_thread)
        for done in [self.pool.submit(step) for step in steps]:
            done.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _one_torch_thread() -> None:
    torch.get_num_threads()  # settles this thread's torch threads, as its first parallel work would, before ...
    torch.set_num_threads(1)  # ... this sets them (and the default of threads that start later) to one


def make_batcher(translators_of: TranslatorsOf, cfg: ServeConfig, admit: Admit | None = None) -> Batcher[Work, Answer]:
    """The batcher of the server's searches and scorings, as ``cfg`` sets it up: the one thread that decides what
    is searched, a queue for each model (``--max-queue`` sentences each), whose jobs start as ``admit`` (the pool of
    models) lets them, and several models' search steps run at once (``ModelSteps``)."""
    return Batcher(
        functools.partial(answer_all, translators_of),
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        functools.partial(open_search, translators_of, cfg.continuous),
        queue_of=model_of,
        admit=admit,
        step_queues=ModelSteps(),
    )


def model_of(options: Hashable) -> str:
    """The served model a job's options name: its queue."""
    return options.model
