"""What a request to the translate and score API may be and how its answer reads: the bodies and their checks, the
size of body the server reads, what an error repeats of a request's values, each text's rendered translations and
each pair's score."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from mtkit.config import ServeConfig
from mtkit.decoding.line_translator import PairScore, Translation

RETRY_AFTER_S = 1  # what a 503 asks the client to wait: a full queue drains in about a batch's time
ECHO_CHARS = 40  # of a request's value that an error message repeats; of a longer one, the start and its length
SRC_LANG_HELP = (
    "The language of the texts, for a model told its languages by tokens (an imported NLLB-200 or M2M100: one of "
    "/v1/models' between), which needs it unless it has a default source language; other models check it against "
    "their directions."
)
MODEL_HELP = (
    "The served model, by its name (/v1/models lists them); none: the server's only model, or the first that "
    "translates src_lang into tgt_lang."
)
ADAPTER_HELP = (
    "The LoRA adapter to use, by the name the server gave it (`mtkit serve --adapter NAME=PATH`; /v1/models lists "
    "them); none: the model without an adapter."
)


class TranslateRequest(BaseModel):
    """The body of ``POST /v1/translate``; what it does not give follows the model's saved decode settings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] = Field(
        description="A text, or a list of texts; each is one segment, as one input line is to `mtkit translate`."
    )
    beam: int | None = Field(None, ge=1, description="Beam size; 1 is greedy. Default: the model's.")
    nbest: int = Field(1, ge=1, description="Up to this many translations per text, best first; at most the beam.")
    scores: bool = Field(False, description="Each translation as {text, score, logprob} rather than a string.")
    alignments: bool = Field(
        False,
        description="Each translation as {text, alignment}: its word alignment in Pharaoh format ('i-j': source "
        "word i, target word j, from 0), from the model's cross-attention. With the best translation only.",
    )
    tgt_lang: str | None = Field(
        None,
        description="The language to translate into, one of /v1/models' directions (or of its between); needed by "
        "a model of several target languages.",
    )
    src_lang: str | None = Field(None, description=SRC_LANG_HELP)
    model: str | None = Field(None, description=MODEL_HELP)
    adapter: str | None = Field(None, description=ADAPTER_HELP)

    @model_validator(mode="after")
    def _within_the_beam(self, info: ValidationInfo) -> TranslateRequest:
        """The model chosen; the beam against the server's limit, nbest against the beam (the model's when not
        given), and alignments against what the engine can give."""
        context = chosen_model(self, info)
        max_beam, beam = context["max_beam"], self.beam or context["beam"]
        if self.beam is not None and self.beam > max_beam:
            raise ValueError(f"beam {self.beam} is over this server's limit of {max_beam}")
        if self.nbest > beam:
            raise ValueError(f"nbest {self.nbest} needs a beam of at least {self.nbest} (the beam is {beam})")
        if self.alignments and self.nbest > 1:
            raise ValueError("alignments go with the best translation only, not with nbest")
        if self.alignments and not context["aligns"]:
            raise ValueError("this model's engine gives no word alignments")
        check_languages(self.tgt_lang, self.src_lang, context)
        check_adapter(self.adapter, context["adapters"])
        return self

    def texts(self) -> list[str]:
        """The texts, NUL characters replaced by spaces as `mtkit translate` does."""
        return segments(self.text)


class ScoreRequest(BaseModel):
    """The body of ``POST /v1/score``: translations given with their sources, each scored under the model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    source: str | list[str] = Field(
        description="A source text, or a list of them; each is one segment, as one input line is to `mtkit translate`."
    )
    target: str | list[str] = Field(
        description="The translation to score of the source: one text, or a list of one per source, in order."
    )
    tokens: bool = Field(False, description="Each score with the log-probability of each target token, eos last.")
    tgt_lang: str | None = Field(
        None,
        description="The targets' language, one of /v1/models' directions (or of its between); needed by a model of "
        "several target languages.",
    )
    src_lang: str | None = Field(None, description=SRC_LANG_HELP)
    model: str | None = Field(None, description=MODEL_HELP)
    adapter: str | None = Field(None, description=ADAPTER_HELP)

    @model_validator(mode="after")
    def _paired(self, info: ValidationInfo) -> ScoreRequest:
        """One target per source, the model chosen, and the languages and adapter against the model's."""
        sources, targets = texts_in(self.source), texts_in(self.target)
        if sources != targets:
            raise ValueError(f"{sources:,} sources but {targets:,} targets: give one target per source")
        context = chosen_model(self, info)
        check_languages(self.tgt_lang, self.src_lang, context)
        check_adapter(self.adapter, context["adapters"])
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) pairs, NUL characters replaced by spaces as in a text to translate."""
        return list(zip(segments(self.source), segments(self.target)))


def chosen_model(query: TranslateRequest | ScoreRequest, info: ValidationInfo) -> dict[str, Any]:
    """What checking ``query`` needs to know of the model it goes to, which the server's pool of models
    (``info.context["pool"]``) chooses: by the model it names, else by its languages. ``query.model`` becomes
    that model's name."""
    pool = info.context["pool"]
    query.model = pool.choose(query.model, query.src_lang, query.tgt_lang)
    return {**pool.cards[query.model].context, "max_beam": info.context["max_beam"]}


def texts_in(text: str | list[str]) -> int:
    """How many texts a request's text or list of texts is, without copying them."""
    return 1 if isinstance(text, str) else len(text)


def segments(text: str | list[str]) -> list[str]:
    """A request's text or list of texts as a list, NUL characters replaced by spaces as `mtkit translate` does."""
    return [segment.replace("\0", " ") for segment in ([text] if isinstance(text, str) else text)]


def check_target(tgt_lang: str | None, targets: list[str]) -> None:
    """ValueError unless ``tgt_lang`` is one of the model's ``targets``, or is None for a model of one."""
    if tgt_lang is None and len(targets) > 1:
        raise ValueError(f"this model translates into {', '.join(targets)}: say which with tgt_lang")
    if tgt_lang is not None and tgt_lang not in targets:
        raise ValueError(
            f"this model does not translate into {echoed(tgt_lang)}; tgt_lang is one of {', '.join(targets)}"
        )


def check_languages(tgt_lang: str | None, src_lang: str | None, context: dict[str, Any]) -> None:
    """ValueError naming the field unless the request's languages are the model's: for a model told its languages
    by tokens (``context["languages"]``), each one of them, or left out where the model has a default
    (``context["defaults"]``, source and target); for another, a target of its ``context["targets"]`` and a source
    of its ``context["directions"]`` into it."""
    languages = context["languages"]
    if not languages:
        check_target(tgt_lang, context["targets"])
        if src_lang is None or not context["targets"]:  # an export of no known directions: nothing to check
            return
        target = tgt_lang or context["targets"][0]
        sources = [src for src, tgt in context["directions"] if tgt == target]
        if src_lang not in sources:
            raise ValueError(
                f"this model does not translate {echoed(src_lang)} into {target}; src_lang is one of "
                f"{', '.join(sources)}"
            )
        return
    for field, lang, default in (
        ("tgt_lang", tgt_lang, context["defaults"][1]),
        ("src_lang", src_lang, context["defaults"][0]),
    ):
        if lang is None and default is None:
            raise ValueError(f"this model translates between {len(languages):,} languages: say which with {field}")
        if lang is not None and lang not in languages:
            raise ValueError(
                f"{echoed(lang)} is not one of this model's {len(languages):,} languages ({field}: one of /v1/models' "
                "between)"
            )


def check_adapter(adapter: str | None, adapters: list[str]) -> None:
    """ValueError unless ``adapter`` is None or one of the server's ``adapters``."""
    if adapter is not None and adapter not in adapters:
        served = f"it serves {', '.join(adapters)}" if adapters else "it serves none"
        raise ValueError(f"this server has no adapter {echoed(adapter)}; {served}")


class ScoredPair(BaseModel):
    """How ``POST /v1/score`` answers for one pair."""

    logprob: float = Field(description="The log-probability of the target given the source, eos included.")
    tokens: int = Field(description="The target tokens scored, eos included.")
    token_logprobs: list[float] | None = Field(
        None, description="The log-probability of each target token, eos last; only when the request asks for it."
    )


class ScoreAnswer(BaseModel):
    """The answer of ``POST /v1/score``."""

    scores: list[ScoredPair] = Field(description="One per pair, in order.")


def body_limit(cfg: ServeConfig) -> int:
    """The most bytes a request within the limits can take: JSON spells a character in up to 12 bytes
    (a surrogate pair of \\u escapes), plus quotes and a comma per text and the options."""
    return 12 * cfg.max_chars + 4 * cfg.max_texts + 1024


def rendered(translations: list[Translation], query: TranslateRequest) -> Any:
    """One text's answer, as `mtkit translate` prints it: the best translation; with ``scores`` that with its
    length-normalised score and log-probability, with ``alignments`` with its word alignment; with ``nbest``
    > 1 a list of those, best first."""
    if not (query.scores or query.alignments or query.nbest > 1):
        return translations[0].text
    entries = []
    for t in translations:
        entry: dict[str, Any] = {"text": t.text}
        if query.scores or query.nbest > 1:
            entry |= {"score": t.score, "logprob": t.logprob}
        if query.alignments:
            entry["alignment"] = t.alignment
        entries.append(entry)
    return entries if query.nbest > 1 else entries[0]


def scored(score: PairScore) -> dict[str, Any]:
    """One pair's answer: its log-probability and tokens; each token's log-probability where the request asked."""
    entry: dict[str, Any] = {"logprob": score.logprob, "tokens": score.tokens}
    if score.token_logprobs is not None:
        entry["token_logprobs"] = list(score.token_logprobs)
    return entry


def problems(err: ValidationError) -> str:
    """A validation error in one line: where and what, for each problem; a field's name as long as a body may
    be is repeated only in part."""
    return "; ".join(
        f"{'.'.join(clipped(str(part)) for part in e['loc']) or 'body'}: {e['msg']}"
        for e in err.errors(include_url=False)
    )


def clipped(text: str, shown: Callable[[str], str] = str) -> str:
    """``text`` as ``shown`` writes it, or of a longer one its first ``ECHO_CHARS`` characters so written and its
    length: what an answer repeats of a request stays short whatever the request holds."""
    if len(text) <= ECHO_CHARS:
        return shown(text)
    return f"{shown(text[:ECHO_CHARS])}... ({len(text):,} characters)"


def echoed(value: str) -> str:
    """``value`` quoted as an error message repeats it: in full when short, else its start and its length."""
    return clipped(value, repr)
