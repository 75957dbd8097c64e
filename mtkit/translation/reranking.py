"""N-best reranking: of the candidates a search gives each line, the one another judge prefers.

- ``channel``: the noisy channel (Yee et al., 2019, "Simple and Effective Noisy Channel Modeling for Neural Machine
  Translation"): each candidate y of source x ranked by log p(y|x) / |y| + λ · log p(x|y) / |x|, the direct model's
  log-probability of the candidate per candidate token plus the channel's, a reverse model scoring the source given
  the candidate, per source token, as the paper divides them; each log-probability and length as `mtkit score`
  gives them (teacher-forced, eos included), whatever length penalty the search ranked by. The paper's language
  model term, λ · log p(y) / |x|, is left out: mtkit has no target-side language model. With λ = 0 the candidate of
  highest log p(y|x) / |y| wins, which is the beam's best only where the search ranked by that too.
- ``mbr``: minimum Bayes risk: each candidate's expected utility against the other candidates as pseudo-references,
  the utility sacreBLEU's sentence chrF or COMET (``Comet.pairwise``); the highest wins.
- ``qe``: quality estimation: each candidate scored by a reference-free COMET model (CometKiwi) given its source.

A tie goes to the candidate the search ranked higher. Lines with one candidate (an empty line's, or a search that
found one) are left as they are.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from mtkit.config import MAX_BEAM, ConfigError
from mtkit.errors import MtkitError

if TYPE_CHECKING:  # imported by `mtkit translate`'s options, which load no torch before they run
    from mtkit.decoding.line_translator import LineTranslator, Translation
    from mtkit.scoring.comet import Comet

log = logging.getLogger("mtkit")

RerankMethod = Literal["channel", "mbr", "qe"]
MbrUtility = Literal["chrf", "comet"]
MAX_CHANNEL_WEIGHT = 100.0  # λ: the paper tunes it near 1; far beyond, the direct model no longer counts


class Reranker(ABC):
    """A judge of each line's candidates: a utility per candidate, higher is better."""

    @abstractmethod
    def utilities(
        self, sources: list[str], candidates: list[list[str]], scores: list[list[float]]
    ) -> list[list[float]]:
        """The utility of each candidate of each line; ``scores``: the search's own (length-normalised) score of
        each. Every line has at least two candidates."""

    def choose(self, sources: list[str], hypotheses: list[list[Translation]]) -> list[Translation]:
        """The candidate of highest utility of each line (the search's better-ranked one on a tie)."""
        todo = [i for i, hyps in enumerate(hypotheses) if len(hyps) > 1]
        chosen = [hyps[0] for hyps in hypotheses]
        if not todo:
            return chosen
        texts = [[h.text for h in hypotheses[i]] for i in todo]
        scores = [[h.score for h in hypotheses[i]] for i in todo]
        for i, values in zip(todo, self.utilities([sources[i] for i in todo], texts, scores), strict=True):
            best = max(range(len(values)), key=lambda k: (values[k], -k))
            chosen[i] = hypotheses[i][best]
        return chosen


class NoisyChannel(Reranker):
    """log p(y|x) / |y| under the direct model plus ``weight`` times log p(x|y) / |x| under the channel. The direct
    model scores each candidate again rather than reuse the search's score, which a length penalty may have divided
    otherwise."""

    def __init__(self, direct: LineTranslator, channel: LineTranslator, weight: float) -> None:
        self.direct, self.channel, self.weight = direct, channel, weight

    def utilities(
        self, sources: list[str], candidates: list[list[str]], scores: list[list[float]]
    ) -> list[list[float]]:
        flat_sources = [source for source, cands in zip(sources, candidates) for _ in cands]
        flat_candidates = [text for cands in candidates for text in cands]
        direct = self.direct.score(flat_sources, flat_candidates)
        channel = self.channel.score(flat_candidates, flat_sources)
        values = iter(
            there.logprob / there.tokens + self.weight * back.logprob / back.tokens
            for there, back in zip(direct, channel, strict=True)
        )
        return [list(islice(values, len(cands))) for cands in candidates]


class MbrChrf(Reranker):
    """Minimum Bayes risk with sacreBLEU's sentence chrF: each candidate's mean chrF against each other one."""

    def utilities(
        self, sources: list[str], candidates: list[list[str]], scores: list[list[float]]
    ) -> list[list[float]]:
        from sacrebleu.metrics import CHRF

        chrf = CHRF()
        return [
            [
                sum(chrf.sentence_score(hyp, [ref]).score for j, ref in enumerate(cands) if j != i) / (len(cands) - 1)
                for i, hyp in enumerate(cands)
            ]
            for cands in candidates
        ]


class MbrComet(Reranker):
    """Minimum Bayes risk with a reference-based COMET model: each candidate's mean score with each other one as its
    reference."""

    def __init__(self, comet: Comet) -> None:
        if not comet.needs_references:
            raise ConfigError(f"--mbr-utility comet needs a reference-based COMET model; {comet.name} takes none")
        self.comet = comet

    def utilities(
        self, sources: list[str], candidates: list[list[str]], scores: list[list[float]]
    ) -> list[list[float]]:
        matrices = [matrix.double() for matrix in self.comet.pairwise(sources, candidates)]
        return [((matrix.sum(1) - matrix.diagonal()) / (len(matrix) - 1)).tolist() for matrix in matrices]


class QualityEstimation(Reranker):
    """A reference-free COMET model's score of each candidate given its source."""

    def __init__(self, comet: Comet) -> None:
        if comet.needs_references:
            raise ConfigError(
                f"--rerank qe needs a reference-free model such as cometkiwi; {comet.name} needs references"
            )
        self.comet = comet

    def utilities(
        self, sources: list[str], candidates: list[list[str]], scores: list[list[float]]
    ) -> list[list[float]]:
        flat_sources = [source for source, cands in zip(sources, candidates) for _ in cands]
        flat_candidates = [text for cands in candidates for text in cands]
        (result,) = self.comet.score(flat_sources, [flat_candidates])
        segments = iter(result.segments)
        return [list(islice(segments, len(cands))) for cands in candidates]


@dataclass(frozen=True)
class RerankSettings:
    """How `mtkit translate --rerank` chooses: the method, how many candidates, and each method's judge."""

    method: RerankMethod
    candidates: int = 8  # n-best of a beam at least this wide, or this many samples
    reverse_model: Path | None = None  # channel: the model of the other direction
    channel_weight: float = 1.0  # channel: λ
    mbr_utility: MbrUtility = "chrf"
    comet_model: str | None = None  # qe: "cometkiwi"; mbr with comet: "comet"; a name, Hub id or folder

    def check(self, sampling: bool, beam: int | None) -> None:
        """ConfigError, in one line, for settings that do not go together."""
        if not 2 <= self.candidates <= MAX_BEAM:
            raise ConfigError(f"--candidates must be between 2 and {MAX_BEAM:,}, got {self.candidates:,}")
        if beam is not None and not sampling and beam < self.candidates:
            raise ConfigError(f"--candidates {self.candidates} needs a beam of at least {self.candidates}, not {beam}")
        channel = self.method == "channel"
        if not (0.0 <= self.channel_weight <= MAX_CHANNEL_WEIGHT):
            raise ConfigError(
                f"--channel-weight must be between 0 and {MAX_CHANNEL_WEIGHT:g}, got {self.channel_weight:g}"
            )
        if channel and sampling:
            raise ConfigError("--rerank channel reranks the direct model's beam: drop --sample")
        if channel and self.reverse_model is None:
            raise ConfigError("--rerank channel needs --reverse-model, the model of the other direction")
        if not channel and self.reverse_model is not None:
            raise ConfigError(f"--reverse-model is for --rerank channel, not {self.method}")
        if not channel and self.channel_weight != RerankSettings.channel_weight:
            raise ConfigError(f"--channel-weight is for --rerank channel, not {self.method}")
        if self.mbr_utility != "chrf" and self.method != "mbr":
            raise ConfigError(f"--mbr-utility is for --rerank mbr, not {self.method}")
        uses_comet = self.method == "qe" or (self.method == "mbr" and self.mbr_utility == "comet")
        if self.comet_model is not None and not uses_comet:
            raise ConfigError("--comet-model is for --rerank qe and --rerank mbr --mbr-utility comet")


def load_reranker(
    settings: RerankSettings,
    direct: LineTranslator,
    device: str,
    precision: str,
    engine: str = "mtkit",
    threads: int = 0,
) -> Reranker:
    """The judge ``settings`` name, its models loaded on ``device``: a channel translating into ``direct``'s source
    language, in ``precision`` as ``direct`` translates, or a COMET model, in fp32 as `mtkit eval` scores by default,
    whatever ``precision`` (fp16 is for translation on CUDA; a COMET model in bf16 scores a little otherwise)."""
    if settings.method == "channel":
        from mtkit.translation.engines import load_translator
        from mtkit.translation.pair_filter import load_scorer

        assert settings.reverse_model is not None  # RerankSettings.check
        if direct.languages is None:  # an export of no known languages: the channel taken at its word
            channel = load_translator(settings.reverse_model, device, precision, engine, threads=threads).into(None)
        else:
            src, tgt = direct.languages
            channel = load_scorer(
                settings.reverse_model, tgt, src, "the --reverse-model", device, precision, engine, threads
            )
        return NoisyChannel(direct, channel, settings.channel_weight)
    if settings.method == "mbr" and settings.mbr_utility == "chrf":
        return MbrChrf()
    from mtkit.scoring.comet import Comet

    model = settings.comet_model or ("cometkiwi" if settings.method == "qe" else "comet")
    try:
        comet = Comet.load(model, device=device, precision="fp32", threads=threads)
    except MtkitError as err:
        raise ConfigError(f"--rerank {settings.method}: {err}") from err
    return QualityEstimation(comet) if settings.method == "qe" else MbrComet(comet)


def reranked(
    translator: LineTranslator, reranker: Reranker, chunks: Iterable[list[str]], prefixes: Iterable[str] | None = None
) -> Iterator[list[Translation]]:
    """The chosen translation of each line of each chunk (a list of one), in order, as ``translator.stream`` gives
    each chunk's candidates (its ``nbest``): each chunk is reranked as a whole. An empty chunk gives nothing, so it
    is never handed to the stream, whose lines are paired with the chunks they came from."""
    pending: deque[list[str]] = deque()

    def remembered() -> Iterator[list[str]]:
        for chunk in chunks:
            if chunk:
                pending.append(chunk)
                yield chunk

    results = translator.stream(remembered()) if prefixes is None else translator.stream(remembered(), prefixes)
    while (first := next(results, None)) is not None:
        chunk = pending.popleft()  # the stream read a chunk whole before it gave its first line
        hypotheses = [first, *islice(results, len(chunk) - 1)]
        yield from ([chosen] for chosen in reranker.choose(chunk, hypotheses))
