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
from mtkit.serving.batcher import Batcher, Refused
from mtkit.serving.metrics import ServerMetrics
from mtkit.serving.models import ModelCard, ModelPool
from mtkit.serving.requests import (
    RETRY_AFTER_S,
    ScoreRequest,
    TranslateRequest,
    body_limit,
    check_languages,
    problems,
    rendered,
    scored,
)
from mtkit.serving.searches import Answer, Scoring, Translating, Work
from mtkit.version import __version__

log = logging.getLogger("mtkit")

CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's; nothing is sent)

Query = TypeVar("Query", bound=BaseModel)


class BatchedRoute:
    """What the routes whose work the batcher does share, one method a step: a request's body read, checked,
    bounded, queued and awaited. Each step that can end the request early raises its answer: 408 or 413 while
    reading, 422 while checking, 413 while bounding, 503 while queueing, 504 or 500 while waiting; a client
    that went away while reading or waiting is a ``ClientDisconnect``, logged as 499 with nothing sent.
    ``metrics`` counts the sentences and tokens translated."""

    answer: str = "translation"  # what the route gives, as its 504 names it
    work: str = "translation"  # what it does, as its 500 names it

    def __init__(
        self, pool: ModelPool, cfg: ServeConfig, batcher: Batcher[Work, Answer], metrics: ServerMetrics
    ) -> None:
        self.pool = pool
        self.cfg = cfg
        self.batcher = batcher
        self.metrics = metrics
        self.context: dict[str, Any] = {"pool": pool, "max_beam": cfg.max_beam}  # what checking a request needs

    async def best_translations(
        self, request: Request, name: str, texts: list[str], tgt_lang: str | None, src_lang: str | None
    ) -> list[str]:
        """The best translation of each text by the served model ``name`` with its saved decode settings, for the
        routes of other APIs: 422 for languages the model does not translate, then bounded, queued and awaited as
        a translation request is (``ClientDisconnect`` when the client went away). The tokens counted for the
        metrics, (source, target), are ``request.state.tokens`` (None for a model of no tokenizers), counted with
        the card the model's load renewed (the one read before may have had none yet)."""
        card = self.pool.cards[name]
        try:
            check_languages(tgt_lang, src_lang, card.context)
        except ValueError as err:
            raise HTTPException(422, str(err)) from None
        request.state.model = name
        self._bounded(texts, request, len(texts))
        if not texts:
            return []
        options = Translating(name, card.decode.beam, tgt_lang=tgt_lang, src_lang=src_lang)
        results = await self._answered(request, self._queued(texts, options))
        best = [result[0].text if result else "" for result in results]
        request.state.tokens = self.metrics.translated(name, self.pool.cards[name].tokenizers, texts, best)
        return best

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
    """``POST /v1/translate``: a request read, checked, bounded, queued in the batcher's searches of its model,
    awaited and rendered; its texts' tokens and their best translations' counted in ``metrics``."""

    async def translate(self, request: Request) -> Any:
        """Translate one text or a list of texts: one translation per text, in order."""
        try:
            query = self._checked(await self._body(request), TranslateRequest)
            request.state.model = name = query.model
            texts = query.texts()
            self._bounded(texts, request, len(texts))
            if not texts:
                return {"translations": []}
            card = self.pool.cards[name]
            options = Translating(
                name, query.beam or card.decode.beam, query.nbest, query.alignments, query.tgt_lang, query.src_lang,
                query.adapter,
            )  # fmt: skip
            results = await self._answered(request, self._queued(texts, options))
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        self.metrics.translated(
            name, self.pool.cards[name].tokenizers, texts, [result[0].text if result else "" for result in results]
        )
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
            request.state.model = query.model
            pairs = query.pairs()
            self._bounded([text for pair in pairs for text in pair], request, len(pairs))
            if not pairs:
                return {"scores": []}
            options = Scoring(query.model, query.tgt_lang, query.tokens, query.adapter, query.src_lang)
            results = await self._answered(request, self._queued(pairs, options))
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return {"scores": [scored(result) for result in results]}


class ModelsRoute:
    """``GET /v1/models``: what the server serves and the limits it keeps."""

    def __init__(self, pool: ModelPool, cfg: ServeConfig) -> None:
        self.pool = pool
        self.limits = {"max_texts": cfg.max_texts, "max_chars": cfg.max_chars, "max_beam": cfg.max_beam}

    async def models(self) -> dict[str, Any]:
        """Each model served, in the operator's order: its name, languages (null for a model of several target
        languages), the directions it translates (a request's tgt_lang chooses among them), the languages a model
        told its languages by tokens translates between (``between``: any two, a request's src_lang and tgt_lang;
        its default direction is its languages and directions, where it has one), its decode settings, its LoRA
        adapters' names, and whether it is in memory; for one in memory, its precision (and why), how it is
        searched, its tokenizers' hashes and its adapters' rank, alpha, targets and file SHA-256. The request
        limits. Beside them, OpenAI's model list of their names (``object``, ``data``)."""
        names = list(self.pool.cards)
        return {
            "mtkit_version": __version__,
            "models": [self._model(card) for card in self.pool.cards.values()],
            "limits": self.limits,
            "object": "list",  # OpenAI's model list, which its clients read
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "mtkit"} for name in names],
        }

    def _model(self, card: ModelCard) -> dict[str, Any]:
        loaded = self.pool.loaded.get(card.name)
        one_target = len({tgt for _, tgt in card.pairs}) == 1
        languages = card.pairs[0] if one_target and all(card.pairs[0]) else None
        translator = loaded.translator if loaded is not None else None
        return {
            "name": card.name,
            "languages": {"source": languages[0], "target": languages[1]} if languages else None,
            "directions": [{"source": src, "target": tgt} for src, tgt in card.pairs if src and tgt],
            "between": list(card.between),
            "decode": asdict(card.decode),
            "loaded": loaded is not None,
            "precision": translator.precision if translator is not None else None,
            "batching": loaded.batching if loaded is not None else None,
            "tokenizers": {"source": translator.src_tok.sha256, "target": translator.tgt_tok.sha256}
            if translator is not None and card.tokenizers is not None
            else None,
            "adapters": loaded.adapters if loaded is not None else [{"name": name} for name in card.adapters],
        }


class MetricsRoute:
    """``GET /metrics``: the server's metrics in Prometheus' text format."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def metrics_text(self) -> Response:
        """What a Prometheus scrape reads."""
        content, media_type = self.metrics.exposition()
        return Response(content, media_type=media_type)


async def health() -> dict[str, str]:
    """200 while the server answers: a server of one model listens once it is loaded, one of several before any
    is."""
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
