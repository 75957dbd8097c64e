"""The routes of the translate API: ``POST /v1/translate`` and ``POST /v1/score`` (a request read, checked, bounded,
queued, awaited and rendered), ``GET /v1/models``, ``GET /metrics`` and ``GET /health``, each a handler ``create_app``
adds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from mtkit.config import ServeConfig
from mtkit.data.directions import default_languages, directions
from mtkit.data.tokenizer import Tokenizer
from mtkit.decoding.line_translator import LineTranslator, Translator
from mtkit.serving.batcher import Batcher, Refused
from mtkit.serving.metrics import ServerMetrics
from mtkit.serving.requests import (
    RETRY_AFTER_S,
    ScoreRequest,
    TranslateRequest,
    body_limit,
    problems,
    rendered,
    scored,
)
from mtkit.serving.searches import Answer, Scoring, Work, batching
from mtkit.version import __version__

log = logging.getLogger("mtkit")

CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's; nothing is sent)

Query = TypeVar("Query", bound=BaseModel)


def language_pairs(translator: LineTranslator) -> list[tuple[str, str]]:
    """The (source, target) directions ``translator``'s model translates; one pair, empty where unknown, for an
    export of no known directions; for a model told its languages by tokens, which translates between any two of
    them (``told_languages``), its default direction where it has one."""
    data = translator.data
    if data is None:
        return [translator.languages or ("", "")]
    if data.languages:
        src, tgt = default_languages(data)
        return [(src, tgt)] if src and tgt else []
    return directions(data)


def told_languages(translator: LineTranslator) -> tuple[str, ...]:
    """The languages of a model told its languages by tokens (an imported NLLB-200 or M2M100); none for others."""
    return translator.data.languages if translator.data is not None else ()


class BatchedRoute:
    """What the routes whose work the batcher does share, one method a step: a request's body read, checked,
    bounded, queued and awaited. Each step that can end the request early raises its answer: 408 or 413 while
    reading, 422 while checking, 413 while bounding, 503 while queueing, 504 or 500 while waiting; a client
    that went away while reading or waiting is a ``ClientDisconnect``, logged as 499 with nothing sent."""

    answer: str  # what the route gives, as its 504 names it
    work: str  # what it does, as its 500 names it

    def __init__(
        self, translator: LineTranslator, cfg: ServeConfig, batcher: Batcher[Work, Answer], adapters: list[str]
    ) -> None:
        self.translator = translator
        self.cfg = cfg
        self.batcher = batcher
        pairs = language_pairs(translator)
        self.context: dict[str, Any] = {  # what checking a request needs to know of the server
            "targets": list(dict.fromkeys(tgt for _, tgt in pairs if tgt)),
            "directions": pairs,
            "languages": frozenset(told_languages(translator)),
            "defaults": default_languages(translator.data) if translator.data is not None else (None, None),
            "adapters": adapters,
        }

    async def _body(self, request: Request) -> bytes:
        """The request's body: 408 unless it arrives within the receive timeout, 413 if over the body limit."""
        try:
            return await asyncio.wait_for(_read_body(request, body_limit(self.cfg)), self.cfg.receive_timeout)
        except asyncio.TimeoutError:
            raise HTTPException(408, f"the body did not arrive within {self.cfg.receive_timeout:g} s") from None

    def _checked(self, body: bytes, kind: type[Query]) -> Query:
        """The body as a request of ``kind``, or 422 saying what is wrong with it."""
        try:
            return kind.model_validate_json(body, context=self.context)
        except ValidationError as err:
            raise HTTPException(422, problems(err)) from None

    def _bounded(self, texts: list[str], request: Request, sentences: int) -> None:
        """413 if more texts or characters than the server takes; the request's ``sentences`` counted for its
        log line."""
        request.state.sentences = sentences
        if len(texts) > self.cfg.max_texts:
            raise HTTPException(
                413, f"{len(texts):,} texts; this server takes at most {self.cfg.max_texts:,} a request"
            )
        chars = sum(map(len, texts))
        if chars > self.cfg.max_chars:
            raise HTTPException(
                413, f"{chars:,} characters; this server takes at most {self.cfg.max_chars:,} a request"
            )

    def _queued(self, work: list[Work], options: Hashable) -> Future[list[Answer]]:
        """``work`` in the batcher's queue with the request's options; 503 with Retry-After when it is full."""
        try:
            return self.batcher.submit(work, options)
        except Refused as err:
            raise HTTPException(503, str(err), headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def _answered(self, request: Request, future: Future[list[Answer]]) -> list[Answer]:
        """The answers ``future`` brings. Past the timeout, or once the client has gone away, the request
        leaves its search: 504, or ``ClientDisconnect``. 500 if its search failed."""
        answer = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({answer, gone}, timeout=self.cfg.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            self.batcher.withdraw(future)
            answer.cancel()
            if gone.done() and not gone.cancelled():
                raise ClientDisconnect
            raise HTTPException(504, f"no {self.answer} within {self.cfg.timeout:g} s; the server is busy")
        if answer.exception() is not None:  # its search failed: the batcher logged the traceback
            number = request.state.number
            log.error("request %d: %s failed: %s", number, self.work, answer.exception())
            raise HTTPException(500, f"{self.work} failed; the server's log has the details of request {number}")
        return answer.result()


class TranslateRoute(BatchedRoute):
    """``POST /v1/translate``: a request read, checked, bounded, queued in the batcher's searches, awaited and
    rendered; its texts' tokens and their best translations' counted in ``metrics``."""

    answer = work = "translation"

    def __init__(
        self,
        translator: LineTranslator,
        cfg: ServeConfig,
        batcher: Batcher[Work, Answer],
        adapters: list[str],
        metrics: ServerMetrics,
    ) -> None:
        super().__init__(translator, cfg, batcher, adapters)
        self.metrics = metrics
        self.tokenizers = tokenizers(translator)
        self.context |= {
            "max_beam": cfg.max_beam,
            "beam": translator.decode.beam,
            "aligns": isinstance(translator, Translator),
        }

    async def translate(self, request: Request) -> Any:
        """Translate one text or a list of texts: one translation per text, in order."""
        try:
            query = self._checked(await self._body(request), TranslateRequest)
            texts = query.texts()
            self._bounded(texts, request, len(texts))
            if not texts:
                return {"translations": []}
            beam = query.beam or self.translator.decode.beam
            options = (beam, query.nbest, query.alignments, query.tgt_lang, query.src_lang, query.adapter)
            results = await self._answered(request, self._queued(texts, options))
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        if self.tokenizers is not None:
            self.metrics.translated(*self.tokenizers, texts, [result[0].text if result else "" for result in results])
        return {"translations": [rendered(r, query) for r in results]}


class ScoreRoute(BatchedRoute):
    """``POST /v1/score``: given translations scored under the model, each pair's log-probability.

    Scoring goes through the batcher as translating does, as a job whose options are ``Scoring``: the pairs
    of concurrent requests of the same options are scored together in a whole batch, which the batcher's one
    thread runs between the steps of its searches. So the model is never used by two threads at once, and
    the queue's bound, the timeout and a client going away bound scoring as they bound translating; pairs
    count as sentences in a search and in the queue. Its texts are its sources and targets together."""

    answer = "scores"
    work = "scoring"

    async def score(self, request: Request) -> Any:
        """Score each target as a translation of its source: one score per pair, in order."""
        try:
            query = self._checked(await self._body(request), ScoreRequest)
            pairs = query.pairs()
            self._bounded([text for pair in pairs for text in pair], request, len(pairs))
            if not pairs:
                return {"scores": []}
            options = Scoring(query.tgt_lang, query.tokens, query.adapter, query.src_lang)
            results = await self._answered(request, self._queued(pairs, options))
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return {"scores": [scored(result) for result in results]}


class ModelsRoute:
    """``GET /v1/models``: what the server serves and the limits it keeps."""

    def __init__(
        self, translator: LineTranslator, cfg: ServeConfig, name: str, adapters: dict[str, dict[str, Any]]
    ) -> None:
        self.translator = translator
        self.name = name
        self.adapters = [{"name": adapter, **record} for adapter, record in adapters.items()]
        self.pairs = language_pairs(translator)
        self.between = list(told_languages(translator))
        self.mode = batching(translator, cfg.continuous)
        self.limits = {"max_texts": cfg.max_texts, "max_chars": cfg.max_chars, "max_beam": cfg.max_beam}

    async def models(self) -> dict[str, Any]:
        """The model served: its languages (null for a model of several target languages), the directions it
        translates (a request's tgt_lang chooses among them), the languages a model told its languages by tokens
        translates between (``between``: any two, a request's src_lang and tgt_lang; its default direction is its
        languages and directions, where it has one), precision (and why), decode settings, tokenizer hashes and
        the LoRA adapters a request may name (each one's rank, alpha, targets and file SHA-256); the request
        limits."""
        translator, languages = self.translator, self.translator.languages
        if self.between:
            languages = self.pairs[0] if self.pairs else None
        model = {
            "name": self.name,
            "languages": {"source": languages[0], "target": languages[1]} if languages else None,
            "directions": [{"source": src, "target": tgt} for src, tgt in self.pairs if src and tgt],
            "between": self.between,
            "precision": translator.precision,
            "batching": self.mode,
            "decode": asdict(translator.decode),
            "tokenizers": {"source": translator.src_tok.sha256, "target": translator.tgt_tok.sha256},
            "adapters": self.adapters,
        }
        return {"mtkit_version": __version__, "models": [model], "limits": self.limits}


def tokenizers(translator: LineTranslator) -> tuple[Tokenizer, Tokenizer] | None:
    """The source and target tokenizers that count a translator's tokens; None for one that has none (one that
    answers without a model, as a test's does)."""
    src_tok, tgt_tok = getattr(translator, "src_tok", None), getattr(translator, "tgt_tok", None)
    return (src_tok, tgt_tok) if src_tok is not None and tgt_tok is not None else None


class MetricsRoute:
    """``GET /metrics``: the server's metrics in Prometheus' text format."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def metrics_text(self) -> Response:
        """What a Prometheus scrape reads."""
        content, media_type = self.metrics.exposition()
        return Response(content, media_type=media_type)


async def health() -> dict[str, str]:
    """200 while the server answers; it listens only once the model is loaded."""
    return {"status": "ok"}


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes: a larger one is 413 whatever its Content-Length says,
    and at once, before any of it is read, when its Content-Length says so."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the body is over {limit:,} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"the body is over {limit:,} bytes")
    return bytes(body)


async def _client_gone(request: Request) -> None:
    """Returns once the client has gone away: with the body read, the next message can only be a disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
