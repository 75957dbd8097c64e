"""Corpus scores through sacreBLEU, each with its signature so numbers stay comparable."""

from __future__ import annotations

from dataclasses import asdict, dataclass

METRICS = ("bleu", "chrf", "ter")


@dataclass(frozen=True)
class Score:
    name: str  # BLEU, chrF2, TER
    value: float
    signature: str
    details: str  # sacreBLEU's full score line (n-gram precisions, brevity penalty, ...)

    def to_dict(self) -> dict:
        return asdict(self)


def _metric(name: str, tokenize: str | None, lowercase: bool):
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name == "bleu":
        return BLEU(tokenize=tokenize, lowercase=lowercase)
    if name == "chrf":
        return CHRF(lowercase=lowercase)
    if name == "ter":
        return TER(case_sensitive=not lowercase)
    raise ValueError(f"unknown metric {name!r} (known: {', '.join(METRICS)})")


def score(
    hyps: list[str],
    refs: list[list[str]],
    metrics: tuple[str, ...] = ("bleu", "chrf"),
    tokenize: str | None = None,
    lowercase: bool = False,
) -> list[Score]:
    """Corpus-level scores of ``hyps`` against one or more reference streams, each as long as hyps."""
    for stream in refs:
        if len(stream) != len(hyps):
            raise ValueError(f"{len(hyps)} hypotheses but {len(stream)} references")
    results = []
    for name in metrics:
        metric = _metric(name, tokenize, lowercase)
        result = metric.corpus_score(hyps, refs)
        results.append(Score(result.name, float(result.score), str(metric.get_signature()), str(result)))
    return results


def bleu(hyps: list[str], refs: list[str]) -> Score:
    return score(hyps, [refs], ("bleu",))[0]
