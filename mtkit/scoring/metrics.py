"""Scores through sacreBLEU, each with its signature so numbers stay comparable.

Every number comes from sacreBLEU's own metric objects (corpus and sentence scores, paired bootstrap
resampling, standard test sets), so it equals what the ``sacrebleu`` tool prints for the same files
and options; mtkit only picks the objects and keeps each signature beside its number.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtkit.config import ConfigError
from mtkit.scoring.comet_names import COMET_MODELS

METRICS = ("bleu", "chrf", "chrf++", "ter")
COMET_METRICS = tuple(COMET_MODELS)  # learned metrics beside sacreBLEU's (mtkit.scoring.learned_metrics)
EVAL_METRICS = METRICS + COMET_METRICS  # what `mtkit eval -m` and mtkit.evaluate take
DEFAULT_METRICS = ("bleu", "chrf")  # mtkit's: the library, `mtkit eval --hyp`
SACREBLEU_DEFAULT_METRICS = ("bleu",)  # the sacrebleu tool's, kept by `mtkit eval` in its sacreBLEU dialect
REPORT_METRICS = ("bleu", "chrf", "ter")  # the test set's scores in the report of `mtkit run`

DEFAULT_SEED = "12345"  # sacreBLEU's resampling seed when $SACREBLEU_SEED is not set

# Papers often report BLEU on tokenized, lowercased text (multi-bleu.perl -lc), which runs higher than sacreBLEU
# and is not comparable with it. mtkit's one definition: sacreBLEU's BLEU with the 13a tokenizer and lowercasing,
# which equals multi-bleu.perl -lc (BLEU with tokenize=none) on text tokenized by 13a.
PAPER_STYLE = "BLEU (paper-style: tokenized 13a + lowercase; not sacreBLEU)"

# sacreBLEU downloads test sets and tokenizer models with urlopen and no timeout: a network that drops
# packets would hang eval for good. This bounds each socket operation, not the whole download.
DOWNLOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class Options:
    """How every metric of one evaluation compares text."""

    tokenize: str | None = None  # BLEU's tokenizer; None: 13a, or what sacreBLEU picks for trg_lang
    lowercase: bool = False  # case-insensitive BLEU, and chrF unless its own setting says otherwise
    trg_lang: str = ""  # from --langpair: sacreBLEU then picks zh, ja-mecab or ko-mecab for BLEU, as its CLI does
    chrf_lowercase: bool | None = None  # None: as ``lowercase``
    ter_case_sensitive: bool = False  # as sacreBLEU's TER, which ignores case unless asked (its signature: case:lc)
    chrf_word_order: int = 0  # word n-grams of the "chrf" metric (2 is chrF++); "chrf++" always has 2

    def __post_init__(self) -> None:
        if self.tokenize is None:
            return  # keeps importing mtkit.scoring.metrics (and its default Options()) free of sacreBLEU
        from sacrebleu.metrics import BLEU

        if self.tokenize not in BLEU.TOKENIZERS:
            raise ConfigError(f"--tokenize must be one of {', '.join(BLEU.TOKENIZERS)}, got {self.tokenize!r}")


@dataclass(frozen=True)
class Score:
    name: str  # BLEU, chrF2, chrF2++, TER, or PAPER_STYLE
    value: float
    signature: str
    details: str  # sacreBLEU's full score line (n-gram precisions, brevity penalty, ...)
    comparable: bool = True  # False for the paper-style BLEU
    verbose: str = ""  # what sacreBLEU prints after the score: BLEU's n-gram precisions and brevity penalty

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SentenceScores:
    name: str
    signature: str
    values: list[float]  # one per segment, in input order
    comparable: bool = True
    verbose: list[str] = field(default_factory=list)  # per segment, as Score.verbose

    def to_dict(self) -> dict:
        return {"name": self.name, "signature": self.signature, "values": self.values, "comparable": self.comparable}


@dataclass(frozen=True)
class SystemResult:
    system: str
    score: float
    mean: float  # bootstrap estimate of the true score
    ci: float  # half-width of the 95% confidence interval around ``mean``
    p_value: float | None  # against the baseline; None for the baseline itself


@dataclass(frozen=True)
class PairedResult:
    name: str
    signature: str  # includes the number of resamples (bs:) and the seed
    systems: list[SystemResult]  # the baseline first
    comparable: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Scorer:
    metric: object  # a sacrebleu.metrics Metric
    label: str | None = None  # replaces sacreBLEU's name for the paper-style BLEU
    comparable: bool = True


def _metric(name: str, options: Options, sentence: bool, references: list[list[str]] | None):
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name == "bleu":
        try:
            with _download_timeout():  # flores101/flores200/spBLEU-1K fetch a model on first use
                # Sentence BLEU counts only the n-gram orders a segment has, as sacrebleu -sl does.
                return BLEU(
                    lowercase=options.lowercase,
                    tokenize=options.tokenize,
                    effective_order=sentence,
                    trg_lang=options.trg_lang,
                    references=references,
                )
        except (RuntimeError, OSError) as err:  # ja-mecab/ko-mecab not installed; a model could not be downloaded
            tokenizer = options.tokenize or f"(sacreBLEU's choice for {options.trg_lang})"
            raise ConfigError(f"--tokenize {tokenizer}: {' '.join(str(err).split())}") from None
    if name in ("chrf", "chrf++"):
        lowercase = options.lowercase if options.chrf_lowercase is None else options.chrf_lowercase
        word_order = 2 if name == "chrf++" else options.chrf_word_order
        return CHRF(word_order=word_order, lowercase=lowercase, references=references)
    if name == "ter":
        return TER(case_sensitive=options.ter_case_sensitive, references=references)
    raise ConfigError(f"unknown metric {name!r} (known: {', '.join(METRICS)})")


def _scorers(
    names: tuple[str, ...], options: Options, paper_style: bool, sentence: bool = False, references=None
) -> list[_Scorer]:
    """sacreBLEU metrics for ``names``; with ``paper_style`` the paper-style BLEU follows the sacreBLEU one."""
    if paper_style and "bleu" not in names:
        names = ("bleu", *names)  # never report the paper-style number without the comparable one
    scorers = []
    for name in names:
        scorers.append(_Scorer(_metric(name, options, sentence, references)))
        if name == "bleu" and paper_style:
            paper = Options(tokenize="13a", lowercase=True, trg_lang=options.trg_lang)
            scorers.append(_Scorer(_metric("bleu", paper, sentence, references), PAPER_STYLE, comparable=False))
    return scorers


def _check_lengths(hyps: list[str], refs: list[list[str]]) -> None:
    if not hyps:
        raise ValueError("no hypotheses to score")
    for stream in refs:
        if len(stream) != len(hyps):
            raise ValueError(f"{len(hyps)} hypotheses but {len(stream)} references")


def corpus_scores(
    hyps: list[str],
    refs: list[list[str]],
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    options: Options = Options(),
    paper_style: bool = False,
) -> list[Score]:
    """Corpus-level scores of ``hyps`` against one or more reference streams, each as long as hyps."""
    _check_lengths(hyps, refs)
    results = []
    for scorer in _scorers(metrics, options, paper_style):
        result = scorer.metric.corpus_score(hyps, refs)
        name = scorer.label or result.name
        details = name + str(result)[len(result.name) :]
        signature = str(scorer.metric.get_signature())
        results.append(Score(name, float(result.score), signature, details, scorer.comparable, _verbose(result)))
    return results


def bleu(hyps: list[str], refs: list[str]) -> Score:
    return corpus_scores(hyps, [refs], ("bleu",))[0]


def sentence_scores(
    hyps: list[str],
    refs: list[list[str]],
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    options: Options = Options(),
    paper_style: bool = False,
) -> list[SentenceScores]:
    """Each segment's score by sacreBLEU's ``sentence_score``, one list per metric."""
    _check_lengths(hyps, refs)
    results = []
    for scorer in _scorers(metrics, options, paper_style, sentence=True):
        scores = [scorer.metric.sentence_score(hyp, list(seg_refs)) for hyp, *seg_refs in zip(hyps, *refs)]
        name = scorer.label or scores[0].name
        signature = str(scorer.metric.get_signature())
        values = [float(s.score) for s in scores]
        results.append(SentenceScores(name, signature, values, scorer.comparable, [_verbose(s) for s in scores]))
    return results


def _verbose(result) -> str:
    """The text sacreBLEU prints after a score: its line (``NAME = 12.34 VERBOSE``) less the name and score."""
    return str(result)[len(f"{result.name} = {result.score:.2f}") :].strip()


def paired_bootstrap(
    systems: list[tuple[str, list[str]]],
    refs: list[list[str]],
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    options: Options = Options(),
    paper_style: bool = False,
    n: int = 1000,
    seed: int | None = None,
) -> list[PairedResult]:
    """Each (name, hypotheses) system against the first, the baseline, by sacreBLEU's paired bootstrap test.

    The same resamples as ``sacrebleu --paired-bs`` with SACREBLEU_SEED=seed (None: that variable, else
    12345), so the numbers match; each metric is tested alone, so the paper-style BLEU can run beside BLEU.
    """
    for _, hyps in systems:
        _check_lengths(hyps, refs)
    return [
        paired_test(systems, scorer.metric, n, seed, scorer.label, scorer.comparable)
        for scorer in _scorers(metrics, options, paper_style, references=refs)
    ]


def paired_test(
    systems: list[tuple[str, list]],
    metric,
    n: int,
    seed: int | None,
    label: str | None = None,
    comparable: bool = True,
) -> PairedResult:
    """sacreBLEU's paired bootstrap test of each (name, hypotheses) system against the first under ``metric``, a
    sacreBLEU Metric with its references given, or any object answering its statistics methods as sacreBLEU's
    test calls them. ``seed`` None: $SACREBLEU_SEED, else 12345."""
    from sacrebleu.significance import PairedTest

    with _bootstrap_seed(seed):
        signatures, table = PairedTest(systems, {"metric": metric}, None, test_type="bs", n_samples=n)()
    (name,) = signatures  # sacreBLEU keys its results by the score's name
    rows = [
        SystemResult(system, float(r.score), float(r.mean), float(r.ci), r.p_value)
        for system, r in zip(table["System"], table[name])
    ]
    return PairedResult(label or name, str(signatures[name]), rows, comparable)


@contextmanager
def _bootstrap_seed(seed: int | None) -> Iterator[None]:
    """sacreBLEU reads its resampling seed only from $SACREBLEU_SEED; set it for the duration, once it is known to be
    one sacreBLEU seeds every resample with (it draws a system's unseeded for 0)."""
    previous = os.environ.get("SACREBLEU_SEED")
    chosen = (previous or DEFAULT_SEED) if seed is None else str(seed)
    if chosen.lower() != "none" and not (chosen.isascii() and chosen.isdigit() and int(chosen) > 0):
        origin = "$SACREBLEU_SEED" if seed is None else "the bootstrap seed"
        raise ConfigError(f"{origin} must be a positive whole number or none (unseeded), got {chosen[:40]!r}")
    os.environ["SACREBLEU_SEED"] = chosen
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = previous


@contextmanager
def _download_timeout() -> Iterator[None]:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


class _Collect(logging.Handler):
    """Keeps sacreBLEU's warnings and errors, so a failed download becomes one line instead of several."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def reference_files(test_set: str, langpair: str) -> list[Path]:
    """The reference files of a sacreBLEU test set, downloaded into sacreBLEU's cache if they are not there.

    The cache is $SACREBLEU, else ~/.sacrebleu, read when sacreBLEU is imported.
    """
    from sacrebleu.dataset import DATASETS

    from mtkit.data.parallel import DataError  # here: the command line reads this module's defaults without torch

    dataset = DATASETS.get(test_set)
    if dataset is None:
        raise ConfigError(f"unknown test set {test_set!r} (`sacrebleu --list` shows them)")
    if langpair not in dataset.langpairs:
        raise ConfigError(
            f"test set {test_set} has no language pair {langpair!r}; it has {', '.join(dataset.langpairs)}"
        )
    logger = logging.getLogger("sacrebleu")
    collect = _Collect()
    logger.addHandler(collect)
    try:
        with _download_timeout():
            return [Path(path) for path in dataset.get_reference_files(langpair)]
    except (OSError, SystemExit) as err:  # URLError is an OSError; sacreBLEU exits after an SSL or checksum error
        reason = "; ".join(collect.messages) or str(err)
    finally:
        logger.removeHandler(collect)
    # Where sacreBLEU keeps the archive; it unpacks it only after downloading it itself.
    archives = " and ".join(
        f"{url} to {Path(dataset._rawdir) / dataset._get_tarball_filename(url)}" for url in dataset.data
    )
    raise DataError(
        f"test set {test_set} {langpair} is not in sacreBLEU's cache and could not be downloaded ({reason}): "
        f"download {archives} and unpack it there, or set SACREBLEU to a cache folder that has it"
    )
