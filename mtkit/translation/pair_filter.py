"""Dual conditional cross-entropy filtering of parallel text (Junczys-Dowmunt, 2018, "Dual Conditional
Cross-Entropy Filtering of Noisy Parallel Corpora", WMT18).

A forward model A (x->y) and a reverse model B (y->x) score each pair as cross-entropies per token,
H_A = -log p_A(y|x) / |y| and H_B = -log p_B(x|y) / |x|, each length counted in the tokens of the side scored as the
model reads them, eos included (``LineTranslator.score``). The pair's score is |H_A - H_B| + (H_A + H_B) / 2: low
when both models find the pair probable and agree on how probable, so a pair that is fluent on one side only, or
not a translation at all, scores high. The paper's adequacy is exp(-score).

Files are read in chunks twice, once to score and once to write the pairs kept, so a corpus of any length takes
memory for one chunk of text and one number per pair. The pairs kept stay in their order, line-aligned.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import TypeVar

import numpy as np

from mtkit.config import ConfigError, DataConfig, PairFilterConfig
from mtkit.data.directions import directions
from mtkit.data.parallel import DataError, iter_lines, reading
from mtkit.decoding.line_translator import CHUNK_LINES, LineTranslator, PairScore, paired_chunks
from mtkit.files import atomic_write, file_sha256
from mtkit.model.checkpoint import CheckpointError, weights_file
from mtkit.model.loading import resolve
from mtkit.runtime import pick_device, resolve_precision
from mtkit.translation.engines import load_translator
from mtkit.translation.resumable import writing

T = TypeVar("T")
UNNAMED = (DataConfig.src_lang, DataConfig.tgt_lang)  # the language codes of a model whose config named none


@dataclass(frozen=True)
class DualScore:
    """One pair's cross-entropies per token under each model, and the score that ranks it (lower is better)."""

    forward: float  # H_A(y|x)
    reverse: float  # H_B(x|y)

    @property
    def score(self) -> float:
        return abs(self.forward - self.reverse) + (self.forward + self.reverse) / 2


def cross_entropy(pair: PairScore) -> float:
    """-log p / tokens: the cross-entropy per token of a scored side; a score that is not a number counts as the
    worst (infinite), so that it is never kept over a real one."""
    value = -pair.logprob / pair.tokens
    return value if math.isfinite(value) else math.inf


def dual_scores(
    forward: LineTranslator, reverse: LineTranslator, sources: Iterable[str], targets: Iterable[str]
) -> Iterator[DualScore]:
    """The DualScore of each (source, target) pair, in order, streamed in chunks: ``forward`` scores each target
    given its source, ``reverse`` each source given its target. Each translator must already translate into its
    side's language (``into``); PairMismatch as soon as one side runs out before the other."""
    forward.check_target()
    reverse.check_target()
    first_line = 1
    for src, tgt in paired_chunks(sources, targets, CHUNK_LINES):
        there = forward.score_chunk(src, tgt, first_line, tokens=False)
        back = reverse.score_chunk(tgt, src, first_line, tokens=False)
        for a, b in zip(there, back, strict=True):
            yield DualScore(cross_entropy(a), cross_entropy(b))
        first_line += len(src)


def load_scorer(
    models: Path | list[Path],
    src_lang: str,
    tgt_lang: str,
    role: str,
    device: str = "auto",
    precision: str = "auto",
    engine: str = "mtkit",
    threads: int = 0,
) -> LineTranslator:
    """The model(s) that score targets in ``tgt_lang`` given sources in ``src_lang``: ConfigError, naming ``role``
    ("the forward model"), for a model trained on other languages. A model whose config named no languages is taken
    at its word; one told its languages by tokens (NLLB-200, M2M100) scores between any two of them."""
    scorer = load_translator(models, device, precision, engine, threads=threads)
    if scorer.data is None:
        return scorer.into(None)
    if scorer.data.languages:
        return scorer.into(tgt_lang, src_lang)
    trained = directions(scorer.data)
    if (src_lang, tgt_lang) in trained:
        return scorer.into(tgt_lang)
    if trained == [UNNAMED]:
        return scorer.into(None)
    named = ", ".join(f"{s}->{t}" for s, t in trained)
    given = ", ".join(map(str, models)) if isinstance(models, list) else models
    raise ConfigError(f"{role} {given} translates {named}, not {src_lang}->{tgt_lang}")


@dataclass(frozen=True)
class FilterSummary:
    """What a filtering did: the pairs read, kept, and dropped by each rule (a pair over ``max_score`` counts
    there, even if ``keep`` would have dropped it too)."""

    pairs: int
    kept: int
    over_max_score: int
    beyond_keep: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def kept_mask(scores: np.ndarray, keep: float, max_score: float) -> tuple[np.ndarray, FilterSummary]:
    """Which pairs are kept: the ``keep`` fraction of lowest score (the nearest whole number of pairs, the earlier
    line first on a tie), less any scored above ``max_score`` (0: no limit)."""
    n = len(scores)
    count = math.floor(keep * n + 0.5)
    ranked = np.zeros(n, bool)
    ranked[np.argsort(scores, kind="stable")[:count]] = True
    over = scores > max_score if max_score > 0 else np.zeros(n, bool)
    keep_mask = ranked & ~over
    summary = FilterSummary(n, int(keep_mask.sum()), int(over.sum()), int((~ranked & ~over).sum()))
    return keep_mask, summary


def filter_pair_files(
    forward: LineTranslator,
    reverse: LineTranslator,
    source: Path,
    target: Path,
    out_source: Path,
    out_target: Path,
    settings: PairFilterConfig,
    scores_tsv: Path | None = None,
) -> FilterSummary:
    """Write the pairs of ``source`` and ``target`` that ``settings`` keep (``kept_mask``) to ``out_source`` and
    ``out_target``, in order, each file whole or not at all; with ``scores_tsv``, one line per pair read:
    'SCORE<tab>H_FORWARD<tab>H_REVERSE<tab>KEPT (1 or 0)<tab>SOURCE<tab>TARGET' (tabs inside a text become spaces).
    The outputs may be the inputs, replaced once they are written. DataError for files of unequal lengths."""
    with reading(source), reading(target):
        found = array("d")
        for pair in dual_scores(
            forward, reverse, iter_lines(source, allow_nul=True), iter_lines(target, allow_nul=True)
        ):
            found.append(pair.score)
            found.append(pair.forward)
            found.append(pair.reverse)
    table = np.frombuffer(found, dtype=np.float64).reshape(-1, 3)
    keep, summary = kept_mask(table[:, 0], settings.keep, settings.max_score)
    if scores_tsv is not None:
        _write_scores(scores_tsv, table, keep, source, target)
    staged = [path.with_name(f".{path.name}.filtered") for path in (out_source, out_target)]
    _write_kept(keep, source, target, *staged)
    for done, path in zip(staged, (out_source, out_target)):
        done.replace(path)
    return summary


_ENDED = object()  # what zip_longest gives in place of a line of a file that ended


def _read_again(rows: Iterable[T], source: Path, target: Path) -> Iterator[tuple[T, str, str]]:
    """Each of ``rows`` (one per pair scored, in order) with its source and target line read again; DataError if the
    files no longer hold one pair per row: one changed since it was scored. Errors of writing what is read here are
    the caller's: they never pass through this generator, so they are never blamed on the inputs."""
    lines = zip_longest(rows, iter_lines(source, allow_nul=True), iter_lines(target, allow_nul=True), fillvalue=_ENDED)
    for row, line, translation in lines:
        if row is _ENDED or line is _ENDED or translation is _ENDED:
            raise DataError(f"{source}, {target}: changed while they were filtered (not the pairs scored)")
        yield row, line, translation


def _write_kept(keep: np.ndarray, source: Path, target: Path, out_source: Path, out_target: Path) -> None:
    """The kept pairs, read again in step with ``keep``."""

    def write_sources(src_file) -> None:
        def write_targets(tgt_file) -> None:
            for kept, line, translation in _read_again(keep, source, target):
                if kept:
                    with writing(out_source):
                        src_file.write((line + "\n").encode("utf-8"))
                    with writing(out_target):
                        tgt_file.write((translation + "\n").encode("utf-8"))

        atomic_write(out_target, write_targets)

    atomic_write(out_source, write_sources)


def _write_scores(path: Path, table: np.ndarray, keep: np.ndarray, source: Path, target: Path) -> None:
    def write(f) -> None:
        for ((score, there, back), kept), line, translation in _read_again(zip(table, keep), source, target):
            texts = "\t".join(text.replace("\t", " ") for text in (line, translation))
            with writing(path):
                f.write(f"{score:.6f}\t{there:.6f}\t{back:.6f}\t{int(kept)}\t{texts}\n".encode())

    atomic_write(path, write)


class PreparedFilter:
    """`mtkit prepare`'s filter of its cleaned training split (mtkit.data.preparation.TrainFilter): both models
    given (``settings.forward`` and ``settings.reverse``), loaded only when a split is filtered, on ``device`` in
    ``precision`` (``auto`` resolved here). What the split depends on: the models' weights' SHA-256, the settings,
    and the device and precision, since bf16 and fp32 (or a GPU and a CPU) score a pair a little differently."""

    def __init__(
        self, settings: PairFilterConfig, langs: tuple[str, str], device: str = "auto", precision: str = "auto"
    ) -> None:
        self.config, self.langs = settings, langs
        self.device = pick_device(device)
        self.precision = resolve_precision(precision, self.device).precision

    def settings(self) -> dict:
        digests = {role: model_digest(Path(getattr(self.config, role))) for role in ("forward", "reverse")}
        return {**asdict(self.config), "device": self.device.type, "precision": self.precision, "sha256": digests}

    def __call__(self, source: Path, target: Path) -> dict[str, int]:
        src, tgt = self.langs
        device, precision = str(self.device), self.precision
        forward = load_scorer(Path(self.config.forward), src, tgt, "the forward model", device, precision)
        reverse = load_scorer(Path(self.config.reverse), tgt, src, "the reverse model", device, precision)
        table = source.with_name(f"{source.name.partition('.')[0]}.scores.tsv") if self.config.scores else None
        return filter_pair_files(forward, reverse, source, target, source, target, self.config, table).to_dict()


def model_digest(model: Path) -> str:
    """The SHA-256 of a model's weights file (a run directory's best/): what a filtered corpus depends on."""
    path = weights_file(resolve(model))
    if not path.is_file():
        raise CheckpointError(f"{model}: no model weights there")
    return file_sha256(path)
