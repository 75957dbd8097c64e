"""COMET and CometKiwi beside sacreBLEU's metrics: the model each name loads, their results in the forms
mtkit.scoring.metrics gives sacreBLEU's (``Score``, ``SentenceScores``, ``PairedResult``), and the paired
bootstrap test over their segment scores.

A learned metric's corpus score is the mean of its segment scores, so sacreBLEU's own paired test runs on it as on
any of its metrics (``SegmentMean``): the same resamples for the same seed and number of segments, so a COMET row
and a BLEU row of one test are judged on the same resampled test sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtkit.config import ConfigError
from mtkit.scoring.comet_names import COMET_MODELS, CometPrecision
from mtkit.scoring.metrics import COMET_METRICS, PairedResult, Score, SentenceScores, paired_test

if TYPE_CHECKING:
    import sacrebleu.metrics.base

    from mtkit.scoring.comet import CometResult

DECIMALS = 4  # COMET's scores are near 0 to 1: the decimals printed where the command line gives none


@dataclass(frozen=True)
class CometSettings:
    """Which model a COMET metric loads and how it runs."""

    model: str | None = None  # a Hub id or a folder for the one COMET metric asked; None: COMET_MODELS' for its name
    revision: str | None = None  # a Hub commit, branch or tag; None: main
    device: str = "auto"  # auto: cuda when available, else cpu
    precision: CometPrecision = "fp32"
    batch_size: int = 16  # segments per forward pass; Comet.load checks it and the precision

    def model_for(self, name: str) -> str:
        return self.model or COMET_MODELS[name]


def check_names(names: Sequence[str], settings: CometSettings) -> None:
    """One --comet-model names the model of one COMET metric, never of both."""
    learned = [name for name in names if name in COMET_METRICS]
    if settings.model and len(learned) > 1:
        raise ConfigError(f"--comet-model names one model: ask for one of {', '.join(learned)} with it")


def learned_scores(
    names: Sequence[str],
    sources: list[str],
    systems: list[list[str]],
    references: list[list[str]],
    settings: CometSettings,
) -> dict[str, list[CometResult]]:
    """Per name of COMET_METRICS in ``names``, its CometResult for each system, in order. Each model is loaded
    once and scores every system together, so sources and references are embedded once."""
    from mtkit.scoring.comet import Comet

    results = {}
    for name in (name for name in names if name in COMET_METRICS):
        model = settings.model_for(name)
        comet = Comet.load(
            model,
            revision=settings.revision,
            device=settings.device,
            precision=settings.precision,
            batch_size=settings.batch_size,
        )
        if comet.needs_references and not references:
            raise ConfigError(f"{model} is a reference-based {comet.name} model: give references (REF or --ref FILE)")
        results[name] = comet.score(sources, systems, references if comet.needs_references else None)
    return results


def as_score(result: CometResult) -> Score:
    """A CometResult's system score as a corpus ``Score``."""
    return Score(result.name, result.system, result.signature, f"{result.name} = {result.system:.{DECIMALS}f}")


def as_sentence_scores(result: CometResult) -> SentenceScores:
    """A CometResult's segment scores as ``SentenceScores``."""
    return SentenceScores(result.name, result.signature, list(result.segments), verbose=[""] * len(result.segments))


def paired_bootstrap(systems: list[tuple[str, CometResult]], n: int = 1000, seed: int | None = None) -> PairedResult:
    """Each (name, CometResult) system against the first, the baseline, by sacreBLEU's paired bootstrap test of
    their segment scores. ``seed`` None: $SACREBLEU_SEED (``none``: unseeded), else 12345, as
    ``metrics.paired_bootstrap``."""
    baseline = systems[0][1]
    segments = [(name, result.segments) for name, result in systems]
    return paired_test(segments, SegmentMean(baseline.name, baseline.signature), n, seed)


class SegmentMean:
    """A corpus score that is the mean of its segment scores, as sacreBLEU's paired test reads a Metric: the
    "hypotheses" it is given are the segment scores, and each segment's statistics are its score and a count of
    one, so the sum over any resample gives that resample's mean."""

    def __init__(self, name: str, signature: str) -> None:
        self.name, self.signature = name, signature

    def _extract_corpus_statistics(self, segments: Sequence[float], references: None) -> list[list[float]]:
        return [[value, 1.0] for value in segments]

    def _compute_score_from_stats(self, stats: Sequence[float]) -> sacrebleu.metrics.base.Score:
        from sacrebleu.metrics.base import Score as SacreScore

        return SacreScore(self.name, float(stats[0]) / float(stats[1]))

    def _aggregate_and_compute(self, stats: list[list[float]]) -> sacrebleu.metrics.base.Score:
        return self._compute_score_from_stats([sum(value for value, _ in stats), len(stats)])

    def get_signature(self) -> _TestSignature:
        return _TestSignature(self.signature)


class _TestSignature:
    """A COMET signature to which sacreBLEU's test adds its resamples and seed, printed as ``...|bs:N|seed:S``."""

    def __init__(self, base: str) -> None:
        self.base, self.info = base, {}

    def update(self, key: str, value: object) -> None:
        self.info[key] = value

    def __str__(self) -> str:
        return "|".join([self.base, *(f"{key}:{self.info[key]}" for key in ("bs", "seed") if key in self.info)])
