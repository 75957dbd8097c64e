"""The routes of the translate API: ``POST /v1/translate`` (a request read, checked, bounded, queued, awaited and
rendered), ``GET /v1/models`` and ``GET /health``, each a handler ``create_app`` adds."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from mtkit.config import ServeConfig
from mtkit.data.directions import directions
from mtkit.decoding.line_translator import LineTranslator, Translation, Translator
from mtkit.serving.batcher import Batcher, Refused
from mtkit.serving.requests import RETRY_AFTER_S, TranslateRequest, body_limit, problems, rendered
from mtkit.serving.searches import batching
from mtkit.version import __version__

log = logging.getLogger("mtkit")

CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's; nothing is sent)


def language_pairs(translator: LineTranslator) -> list[tuple[str, str]]:
    """The (source, target) directions ``translator``'s model translates; one pair, empty where unknown, for an
    export of no known directions."""
    return directions(translator.data) if translator.data is not None else [translator.languages or ("", "")]


class TranslateRoute:
    """``POST /v1/translate``: a request read, checked, bounded, queued in the batcher's searches, awaited and
    rendered, one method a step. Each step that can end the request early raises its answer: 408 or 413 while
    reading, 422 while checking, 413 while bounding, 503 while queueing, 504 or 500 while waiting; a client
    that went away while reading or waiting is a ``ClientDisconnect``, logged as 499 with nothing sent."""

    def __init__(self, translator: LineTranslator, cfg: ServeConfig, batcher: Batcher[list[Translation]]) -> None:
        self.translator = translator
        self.cfg = cfg
        self.batcher = batcher
        self.context = {  # what checking a request needs to know of the server
            "max_beam": cfg.max_beam,
            "beam": translator.decode.beam,
            "aligns": isinstance(translator, Translator),
            "targets": list(dict.fromkeys(tgt for _, tgt in language_pairs(translator) if tgt)),
        }

    async def translate(self, request: Request) -> Any:
        """Translate one text or a list of texts: one translation per text, in order."""
        try:
            query = self._checked(await self._body(request))
            texts = self._bounded(query, request)
            if not texts:
                return {"translations": []}
            results = await self._answered(request, self._queued(texts, query))
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return {"translations": [rendered(r, query) for r in results]}

    async def _body(self, request: Request) -> bytes:
        """The request's body: 408 unless it arrives within the receive timeout, 413 if over the body limit."""
        try:
            return await asyncio.wait_for(_read_body(request, body_limit(self.cfg)), self.cfg.receive_timeout)
        except asyncio.TimeoutError:
            raise HTTPException(408, f"the body did not arrive within {self.cfg.receive_timeout:g} s") from None

    def _checked(self, body: bytes) -> TranslateRequest:
        """The body as a request, or 422 saying what is wrong with it."""
        try:
            return TranslateRequest.model_validate_json(body, context=self.context)
        except ValidationError as err:
            raise HTTPException(422, problems(err)) from None

    def _bounded(self, query: TranslateRequest, request: Request) -> list[str]:
        """The request's texts, counted for its log line; 413 if more texts or characters than the server takes."""
        texts = query.texts()
        request.state.sentences = len(texts)
        if len(texts) > self.cfg.max_texts:
            raise HTTPException(
                413, f"{len(texts):,} texts; this server takes at most {self.cfg.max_texts:,} a request"
            )
        chars = sum(map(len, texts))
        if chars > self.cfg.max_chars:
            raise HTTPException(
                413, f"{chars:,} characters; this server takes at most {self.cfg.max_chars:,} a request"
            )
        return texts

    def _queued(self, texts: list[str], query: TranslateRequest) -> Future[list[list[Translation]]]:
        """``texts`` in the batcher's queue with the request's options; 503 with Retry-After when it is full."""
        options = (query.beam or self.translator.decode.beam, query.nbest, query.alignments, query.tgt_lang)
        try:
            return self.batcher.submit(texts, options)
        except Refused as err:
            raise HTTPException(503, str(err), headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def _answered(self, request: Request, future: Future[list[list[Translation]]]) -> list[list[Translation]]:
        """The translations ``future`` brings. Past the timeout, or once the client has gone away, the request
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
            raise HTTPException(504, f"no translation within {self.cfg.timeout:g} s; the server is busy")
        if answer.exception() is not None:  # its search failed: the batcher logged the traceback
            number = request.state.number
            log.error("request %d: translation failed: %s", number, answer.exception())
            raise HTTPException(500, f"translation failed; the server's log has the details of request {number}")
        return answer.result()


class ModelsRoute:
    """``GET /v1/models``: what the server serves and the limits it keeps."""

    def __init__(self, translator: LineTranslator, cfg: ServeConfig, name: str) -> None:
        self.translator = translator
        self.name = name
        self.pairs = language_pairs(translator)
        self.mode = batching(translator, cfg.continuous)
        self.limits = {"max_texts": cfg.max_texts, "max_chars": cfg.max_chars, "max_beam": cfg.max_beam}

    async def models(self) -> dict[str, Any]:
        """The model served: its languages (null for a model of several target languages), the directions it
        translates (a request's tgt_lang chooses among them), precision (and why), decode settings and tokenizer
        hashes; the request limits."""
        translator, languages = self.translator, self.translator.languages
        model = {
            "name": self.name,
            "languages": {"source": languages[0], "target": languages[1]} if languages else None,
            "directions": [{"source": src, "target": tgt} for src, tgt in self.pairs if src and tgt],
            "precision": translator.precision,
            "batching": self.mode,
            "decode": asdict(translator.decode),
            "tokenizers": {"source": translator.src_tok.sha256, "target": translator.tgt_tok.sha256},
        }
        return {"mtkit_version": __version__, "models": [model], "limits": self.limits}


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
