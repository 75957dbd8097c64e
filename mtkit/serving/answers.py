"""What the core routes answer, as models for the API's documentation (``openapi``): the handlers build plain dicts on
the hot path, and these models only describe them, so an answer is never validated against them at run time."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Hypothesis(BaseModel):
    """One translation of a text as an object: what a request asking for scores, alignments or nbest gets."""

    text: str = Field(description="The translation.")
    score: float | None = Field(
        None, description="Its length-normalised log-probability, which the beam ranks by; with scores or nbest."
    )
    logprob: float | None = Field(
        None, description="The log-probability of the whole translation, eos included; with scores or nbest."
    )
    alignment: str | None = Field(
        None,
        description="Its word alignment in Pharaoh format ('i-j': source word i, target word j, from 0); with "
        "alignments.",
    )


class TranslateAnswer(BaseModel):
    """The answer of ``POST /v1/translate``."""

    translations: list[str | Hypothesis | list[Hypothesis]] = Field(
        description="One per text, in order: the best translation as a string; as an object with scores or "
        "alignments; with nbest > 1 a list of up to nbest objects, best first."
    )


class Direction(BaseModel):
    """A model's one direction."""

    source: str = Field(description="The language it translates from ('' where unknown).")
    target: str = Field(description="The language it translates into ('' where unknown).")


class TokenizerHashes(BaseModel):
    """The SHA-256 of a model's tokenizer models, which tell a client whether two servers cut text alike."""

    source: str = Field(description="The source tokenizer's.")
    target: str = Field(description="The target tokenizer's.")


class AdapterInfo(BaseModel):
    """A LoRA adapter a request may name; what its file holds is told once its model is loaded."""

    name: str = Field(description="What a request's adapter names it by.")
    rank: int | None = Field(None, description="Its rank; once its model is loaded.")
    alpha: float | None = Field(
        None, description="Its scale numerator (its update is (alpha / rank) B A x); once its model is loaded."
    )
    targets: list[str] | None = Field(None, description="The linear layers it adapts; once its model is loaded.")
    sha256: str | None = Field(None, description="The SHA-256 of its file; once its model is loaded.")


class ModelInfo(BaseModel):
    """A served model, as ``GET /v1/models`` describes it."""

    name: str = Field(description="What requests name it by; never a path on the server.")
    languages: Direction | None = Field(
        description="Its one direction; null for a model of several target languages, or of languages unknown."
    )
    directions: list[Direction] = Field(
        description="The (source, target) directions it translates; a model told its languages by tokens gives its "
        "default direction here, where it has one."
    )
    between: list[str] = Field(
        description="The languages of a model told its languages by tokens (an imported NLLB-200 or M2M100), any "
        "two of which a request names as src_lang and tgt_lang; empty for other models."
    )
    precision: dict[str, str] | None = Field(
        description="The number format it computes in and why: {precision, reason}; null until it is loaded, or "
        "where the engine does not say."
    )
    batching: str | None = Field(
        description="How its requests are searched together: continuous, or whole batches and why; null until it is "
        "loaded."
    )
    decode: dict[str, Any] = Field(description="The decode settings saved with it, which a request's options override.")
    tokenizers: TokenizerHashes | None = Field(description="Its tokenizers' hashes; null until it is loaded.")
    adapters: list[AdapterInfo] = Field(description="The LoRA adapters a request may name with this model.")
    loaded: bool = Field(description="Whether it is in memory now; a request for one that is not loads it first.")


class RequestLimits(BaseModel):
    """What one request may hold."""

    max_texts: int = Field(description="Texts in one request; more is 413.")
    max_chars: int = Field(description="Characters of a request's texts together; more is 413.")
    max_beam: int = Field(description="The largest beam a request may ask for; more is 422.")


class ListedModel(BaseModel):
    """A served model as OpenAI's model list names it."""

    id: str = Field(description="The model's name.")
    object: str = Field(description="model")
    created: int = Field(description="0: not known")
    owned_by: str = Field(description="mtkit")


class ModelsAnswer(BaseModel):
    """The answer of ``GET /v1/models``: mtkit's, with OpenAI's model list beside it (``object`` and ``data``) for
    the clients of the chat completions route."""

    mtkit_version: str = Field(description="The version of mtkit that serves.")
    models: list[ModelInfo] = Field(description="Every served model, in the order the operator gave them.")
    limits: RequestLimits
    object: str = Field(description="list")
    data: list[ListedModel] = Field(description="Every served model's name, as OpenAI's clients list models.")


class HealthAnswer(BaseModel):
    """The answer of ``GET /health``: the server answers requests."""

    status: str = Field(description="ok")


class ErrorMessage(BaseModel):
    """What a request that gets no answer is told instead."""

    detail: str = Field(
        description="What went wrong, in one line; it repeats no more than the start of a long value, and of a "
        "failure inside the server only the request's number, under which the server's log holds the details."
    )
