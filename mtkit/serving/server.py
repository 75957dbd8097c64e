"""Translation over HTTP (`mtkit serve`): a FastAPI application over the translator `mtkit.load` gives.

    POST /v1/translate  {"text": "A dog." | ["A dog.", ...], "beam": 5, "nbest": 1, "scores": false,
                         "alignments": false, "tgt_lang": "de"}
                        -> {"translations": [...]}: one per text, in order
    GET  /health        -> 200 once the model is loaded (the server listens only then)
    GET  /v1/models     -> the model's name, languages, directions, precision, batching, decode settings
                           and tokenizer hashes; mtkit's version

The sentences of concurrent requests are searched together (``mtkit.serving.batcher``). Every answer is
bounded: too much text is 413 (up front when Content-Length says so), a full queue 503 with
Retry-After, a request that waits past the timeout 504 and leaves its search, a body slower than the
receive timeout 408, a malformed request 422 (which repeats no more than the start of a long value); a
request that breaks the search is 500, and only that request. A client that goes away withdraws its
request. Connections are bounded in number and in the time their headers may take; a request's headers
are bounded in size and in number (431), before the API key is checked. The log escapes what a client
sent that would not print (a path's ``%0A`` is ``\\n`` there), so a request cannot forge log lines. The
client learns no server path and no exception text: a 500 names the request's number (X-Request-ID),
under which the log holds the details. SIGINT or SIGTERM stops taking connections, finishes the
requests in flight, and exits 0; a second one stops at once and, if that cut requests off, exits 1.

Needs the ``serve`` extra (fastapi, uvicorn); only `mtkit serve` imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hmac
import itertools
import json
import logging
import math
import resource
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mtkit.config import ServeConfig
from mtkit.data.directions import directions
from mtkit.decoding.continuous import LineSearch
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.translate import LineTranslator, Translation, Translator, aligner_of
from mtkit.runtime import RuntimeSetupError
from mtkit.serving.batcher import Batcher, Refused, Search, WholeBatch
from mtkit.translation.engines import load_translator
from mtkit.version import __version__

log = logging.getLogger("mtkit")

RETRY_AFTER_S = 1  # what a 503 asks the client to wait: a full queue drains in about a batch's time
CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's; nothing is sent)
FILES_KEPT = 64  # descriptors left to the process (model files, logs, sockets) beside its connections
# A request's line and header fields are held in memory until the last has arrived; more is 431. h11's bound on
# them (uvicorn's too, with h11), and http.client's on the fields' number: an API client's head is far smaller.
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADER_FIELDS = 100
# The most bytes the HTTP parser is given at once. It tells no offset, so of a slice in which a request's head or the
# request ends, all counts against what follows: pipelined requests carry no uncounted bytes into the next head.
FEED_BYTES = 1024
ECHO_CHARS = 40  # of a request's value that an error message repeats; of a longer one, the start and its length


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
        description="The language to translate into, one of /v1/models' directions; needed by a model of several "
        "target languages.",
    )

    @model_validator(mode="after")
    def _within_the_beam(self, info: ValidationInfo) -> TranslateRequest:
        """The beam against the server's limit, nbest against the beam (the model's when not given), and
        alignments against what the engine can give."""
        max_beam, beam = info.context["max_beam"], self.beam or info.context["beam"]
        if self.beam is not None and self.beam > max_beam:
            raise ValueError(f"beam {self.beam} is over this server's limit of {max_beam}")
        if self.nbest > beam:
            raise ValueError(f"nbest {self.nbest} needs a beam of at least {self.nbest} (the beam is {beam})")
        if self.alignments and self.nbest > 1:
            raise ValueError("alignments go with the best translation only, not with nbest")
        if self.alignments and not info.context["aligns"]:
            raise ValueError("this server's engine gives no word alignments")
        targets = info.context["targets"]
        if self.tgt_lang is None and len(targets) > 1:
            raise ValueError(f"this model translates into {', '.join(targets)}: say which with tgt_lang")
        if self.tgt_lang is not None and self.tgt_lang not in targets:
            raise ValueError(
                f"this model does not translate into {echoed(self.tgt_lang)}; tgt_lang is one of {', '.join(targets)}"
            )
        return self

    def texts(self) -> list[str]:
        """The texts, NUL characters replaced by spaces as `mtkit translate` does."""
        return [text.replace("\0", " ") for text in ([self.text] if isinstance(self.text, str) else self.text)]


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


def aligning(translator: LineTranslator) -> LineTranslator:
    """``translator`` giving each best translation its word alignment, from its (first) model's cross-attention."""
    if not isinstance(translator, Translator):
        raise ValueError("only mtkit's engine gives word alignments")
    chosen = copy.copy(translator)
    chosen.aligner = aligner_of(translator.model)
    return chosen


def configured(translator: LineTranslator, options: Hashable) -> LineTranslator:
    """``translator`` with a request's options: (beam, nbest, alignments, target language or None)."""
    beam, nbest, alignments, tgt_lang = options
    chosen = translator.using(beam=beam, nbest=nbest)
    chosen = chosen.into(tgt_lang) if tgt_lang is not None else chosen
    return aligning(chosen) if alignments else chosen


def translate_all(translator: LineTranslator, lines: list[str], options: Hashable) -> list[list[Translation]]:
    """The translations of each line with a request's options, all at once."""
    return list(configured(translator, options).hypotheses(lines))


def open_search(translator: LineTranslator, continuous: bool, options: Hashable) -> Search[list[Translation]]:
    """The search that the requests of the same options share: continuous where the translator allows it."""
    chosen = configured(translator, options)
    if continuous and LineSearch.accepts(chosen):
        return LineSearch(chosen)
    return WholeBatch(functools.partial(translate_all, translator), options)


def batching(translator: LineTranslator, continuous: bool) -> str:
    """How the server searches, as its log and /v1/models say: continuously, or in whole batches and why."""
    if not continuous:
        return "whole batches (--no-continuous)"
    if LineSearch.accepts(translator):
        return "continuous"
    if not isinstance(translator, Translator):
        return "whole batches (the ctranslate2 engine batches its own searches)"
    if isinstance(translator.model, Ensemble):
        return "whole batches (an ensemble)"
    return "whole batches"


def make_batcher(translator: LineTranslator, cfg: ServeConfig) -> Batcher[list[Translation]]:
    """The batcher of the server's searches, as ``cfg`` sets it up."""
    return Batcher(
        functools.partial(translate_all, translator),
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        functools.partial(open_search, translator, cfg.continuous),
    )


@dataclass
class Tally:
    """What the server's requests came to, for its exit status: those cut off by the shutdown."""

    cut_off: int = 0


def create_app(
    translator: LineTranslator, cfg: ServeConfig, name: str, batcher: Batcher[list[Translation]] | None = None
) -> FastAPI:
    """The application; ``name`` is what /v1/models calls the model. ``batcher``: one whose ``run`` the caller
    runs; by default the application runs its own in a thread that starts with it. At shutdown the batcher
    finishes the work queued before it closes. ``app.state.tally`` counts the requests the shutdown cut off."""
    own = batcher is None
    batcher = batcher or make_batcher(translator, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if own:
            batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.close)

    app = FastAPI(title="mtkit", version=__version__, lifespan=lifespan)
    limits = {"max_texts": cfg.max_texts, "max_chars": cfg.max_chars, "max_beam": cfg.max_beam}
    pairs = directions(translator.data) if translator.data is not None else [translator.languages or ("", "")]
    context = {
        "max_beam": cfg.max_beam,
        "beam": translator.decode.beam,
        "aligns": isinstance(translator, Translator),
        "targets": list(dict.fromkeys(tgt for _, tgt in pairs if tgt)),
    }
    schema = {"content": {"application/json": {"schema": TranslateRequest.model_json_schema()}}, "required": True}
    mode = batching(translator, cfg.continuous)

    @app.post("/v1/translate", openapi_extra={"requestBody": schema})
    async def translate(request: Request) -> Any:
        """Translate one text or a list of texts: one translation per text, in order."""
        try:
            body = await asyncio.wait_for(_read_body(request, body_limit(cfg)), cfg.receive_timeout)
        except asyncio.TimeoutError:
            raise HTTPException(408, f"the body did not arrive within {cfg.receive_timeout:g} s") from None
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        try:
            query = TranslateRequest.model_validate_json(body, context=context)
        except ValidationError as err:
            raise HTTPException(422, _problems(err)) from None
        texts = query.texts()
        request.state.sentences = len(texts)
        if len(texts) > cfg.max_texts:
            raise HTTPException(413, f"{len(texts):,} texts; this server takes at most {cfg.max_texts:,} a request")
        chars = sum(map(len, texts))
        if chars > cfg.max_chars:
            raise HTTPException(413, f"{chars:,} characters; this server takes at most {cfg.max_chars:,} a request")
        if not texts:
            return {"translations": []}
        try:
            options = (query.beam or translator.decode.beam, query.nbest, query.alignments, query.tgt_lang)
            future = batcher.submit(texts, options)
        except Refused as err:
            raise HTTPException(503, str(err), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        answer = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({answer, gone}, timeout=cfg.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            batcher.withdraw(future)
            answer.cancel()
            if gone.done() and not gone.cancelled():
                return Response(status_code=CLIENT_GONE)
            raise HTTPException(504, f"no translation within {cfg.timeout:g} s; the server is busy")
        if answer.exception() is not None:  # its search failed: the batcher logged the traceback
            number = request.state.number
            log.error("request %d: translation failed: %s", number, answer.exception())
            raise HTTPException(500, f"translation failed; the server's log has the details of request {number}")
        return {"translations": [rendered(r, query) for r in answer.result()]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        """200 while the server answers; it listens only once the model is loaded."""
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The model served: its languages (null for a model of several target languages), the directions it
        translates (a request's tgt_lang chooses among them), precision (and why), decode settings and tokenizer
        hashes; the request limits."""
        languages = translator.languages
        model = {
            "name": name,
            "languages": {"source": languages[0], "target": languages[1]} if languages else None,
            "directions": [{"source": src, "target": tgt} for src, tgt in pairs if src and tgt],
            "precision": translator.precision,
            "batching": mode,
            "decode": asdict(translator.decode),
            "tokenizers": {"source": translator.src_tok.sha256, "target": translator.tgt_tok.sha256},
        }
        return {"mtkit_version": __version__, "models": [model], "limits": limits}

    app.state.tally = Tally()
    app.add_middleware(Gatekeeper, api_key=cfg.api_key, tally=app.state.tally)
    return app


class Gatekeeper:
    """ASGI middleware around the application: the API key check on every path but /health, and one log line
    per request (its number, also sent as X-Request-ID, method, path, sentences, milliseconds, status; 499 for
    a client that went away). An error inside the application is logged, with its traceback, under the
    request's number, and the client gets a 500 that says no more than that number.

    Plain ASGI rather than ``@app.middleware``, whose wrapping (a task group and a stream per request) took a
    third of the HTTP thread's time under load.
    """

    def __init__(self, app: ASGIApp, api_key: str, tally: Tally) -> None:
        self.app = app
        self.api_key = api_key
        self.expected = f"Bearer {api_key}".encode()
        self.numbers = itertools.count(1)
        self.tally = tally

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        number, start, status = next(self.numbers), time.perf_counter(), 500
        state = scope.setdefault("state", {})  # what the handler's request.state writes to
        state["sentences"], state["number"] = 0, number
        started = False

        async def send_numbered(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", str(number).encode())]
            await send(message)

        try:
            if self.api_key and scope["path"] != "/health" and not self._authorized(scope):
                refusal = JSONResponse(
                    {"detail": "missing or wrong API key"}, 401, headers={"WWW-Authenticate": 'Bearer realm="mtkit"'}
                )
                await refusal(scope, receive, send_numbered)
            else:
                await self.app(scope, receive, send_numbered)
        except asyncio.CancelledError:
            self.tally.cut_off += 1
            raise
        except Exception:
            log.exception("request %d failed", number)
            if not started:
                failed = JSONResponse(
                    {"detail": f"internal error; the server's log has the details of request {number}"}, 500
                )
                await failed(scope, receive, send_numbered)
        finally:
            elapsed = (time.perf_counter() - start) * 1000
            method, path = printable(scope["method"]), printable(scope["path"])
            fields = {
                "request": number, "method": method, "path": path,
                "sentences": state["sentences"], "ms": round(elapsed, 1), "status": status,
            }  # fmt: skip
            log.info(
                "request %d %s %s: %d sentences, %.1f ms, status %d",
                number, method, path, state["sentences"], elapsed, status, extra={"fields": fields},
            )  # fmt: skip

    def _authorized(self, scope: Scope) -> bool:
        """The Authorization header's bytes against the key's, in constant time."""
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


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


def _problems(err: ValidationError) -> str:
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


def printable(text: str) -> str:
    """``text`` as a log line may hold it: what would not print (a line break, a terminal's escape, a direction
    mark) and the backslash as Python escapes them, so that a client's bytes cannot forge or hide log lines."""
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` but not yet listening, so a port in use is an error before the model
    loads, and clients are refused rather than kept waiting while it does."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # or each response's body waits 40 ms (delayed ACK)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RuntimeSetupError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def guarded_protocol(max_connections: int, receive_timeout: float, max_body: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (over httptools) with the bounds it lacks: a connection beyond ``max_connections``
    is answered 503 and closed; one whose request headers have not all arrived ``receive_timeout`` seconds after
    it opened (or after its last response) is closed, so that clients trickling bytes cannot hold descriptors;
    and, since httptools holds a header line of any length, a request head over ``MAX_HEAD_BYTES`` or
    ``MAX_HEADER_FIELDS`` is answered 431, and a request whose body and trailer fields (after a chunked body)
    run past ``max_body`` and a head's bytes ends its connection, each having grown the process by no more."""

    class Guarded(HttpToolsProtocol):  # type: ignore[misc]
        header_timer: asyncio.TimerHandle | None = None
        in_head = True  # the parser is reading a request's head (else its body and trailer fields)
        room = MAX_HEAD_BYTES  # bytes that part of the request may still take; none left at 0 or below
        feeding = 0  # bytes in the slice the parser is reading
        fields = 0  # header (and trailer) fields of the request now arriving
        refused = False  # a request over its bounds was answered or cut off: what the client sends after is dropped
        refusal: bytes | None = None  # a 431 waiting for the answers to the requests before it

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n"
                    b"retry-after: %d\r\n\r\n" % RETRY_AFTER_S
                )
                transport.close()
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            """Give the parser no more of a request's head, or of what follows it, than its room, in slices of
            ``FEED_BYTES``."""
            view, start = memoryview(data), 0
            while start < len(view) and not self.refused and not self.transport.is_closing():
                if self.room <= 0 and self.in_head:
                    self._refuse_head(f"is over {MAX_HEAD_BYTES:,} bytes")
                    return
                if self.room <= 0:
                    self._refuse_body()
                    return
                part = view[start : start + min(self.room, FEED_BYTES)]
                start += len(part)
                self.feeding = len(part)
                self.room -= len(part)  # before the parser runs: the end of the head or of the request sets it anew
                super().data_received(part)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.fields = 0

        def on_header(self, name: bytes, value: bytes) -> None:
            self.fields += 1
            if self.fields <= MAX_HEADER_FIELDS:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            # a body the application takes, and trailers; the slice being read may be all of them
            self.in_head, self.room = False, max_body + MAX_HEAD_BYTES - self.feeding
            if self.fields > MAX_HEADER_FIELDS:
                self._refuse_head(f"has over {MAX_HEADER_FIELDS} fields")
            else:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.refused:  # what follows is the next request's head, and the slice being read may be all of it
                self.in_head, self.room = True, MAX_HEAD_BYTES - self.feeding
                super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.refusal is not None and self.cycle.response_complete and not self.transport.is_closing():
                self._answer_431()
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def _refuse_head(self, why: str) -> None:
            """Answer 431, once the requests before it on the connection have their answers."""
            self.refused = True
            log.warning("a request refused (431): its head %s", why)
            body = json.dumps({"detail": f"the request's head (its line and header fields) {why}"}).encode()
            self.refusal = (
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            if self.cycle is None or self.cycle.response_complete:
                self._answer_431()

        def _answer_431(self) -> None:
            """Send the 431 and end the connection's sending side; what the client still sends is read and dropped
            until it closes or the header timeout closes the connection, so that no reset loses the answer."""
            self.transport.write(self.refusal)
            self.refusal = None
            self.transport.write_eof()

        def _refuse_body(self) -> None:
            """End a request whose body and trailer fields run on past what the application takes: its connection
            closes, or, where it has had its answer (413 for a body too large), the rest is read and dropped."""
            self.refused, limit = True, max_body + MAX_HEAD_BYTES
            if self.cycle is not None and not self.cycle.response_complete:
                log.warning("a connection closed: its request's body and trailer fields are over %d bytes", limit)
                self.transport.close()
            else:
                self.transport.write_eof()

        def _await_headers(self) -> None:
            """Close the connection unless a new request's headers are complete (a new cycle) in time."""
            if self.header_timer is not None:
                self.header_timer.cancel()
            cycle = self.cycle
            self.header_timer = self.loop.call_later(receive_timeout, self._headers_due, cycle)

        def _headers_due(self, cycle: object) -> None:
            idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if idle and not self.transport.is_closing():
                self.transport.close()

    return Guarded


def uvicorn_config(app: FastAPI, cfg: ServeConfig) -> uvicorn.Config:
    """uvicorn's settings for ``app``: connections bounded in number and in the time a request may take to
    arrive, and a shutdown that waits for the requests in flight no longer than they may take."""
    connections = connection_limit(cfg.max_connections)
    return uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on",
        http=guarded_protocol(connections, cfg.receive_timeout, body_limit(cfg)),
        # in flight at a signal: a body still arriving, then its translation; past that, cut off
        timeout_graceful_shutdown=math.ceil(cfg.receive_timeout + cfg.timeout) + 1,
    )  # fmt: skip


def connection_limit(wanted: int) -> int:
    """``wanted``, or fewer where the process may not open that many descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and wanted > soft - FILES_KEPT:
        log.warning("%d connections at most: the process may open %d files (ulimit -n)", soft - FILES_KEPT, soft)
        return max(1, soft - FILES_KEPT)
    return wanted


@contextlib.contextmanager
def _signals_stop(server: uvicorn.Server) -> Iterator[None]:
    """SIGINT and SIGTERM ask ``server`` to shut down gracefully, a second one to stop at once, as uvicorn's own
    handlers do; they are this process's while it serves, and the stop that was asked for exits with status 0."""

    def stop(signum: int, frame: object) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(model: str | Path, cfg: ServeConfig, **load: Any) -> int:
    """Serve ``model`` (what `mtkit.load` takes, with its ``load`` options: device, precision, engine, threads) until
    SIGINT or SIGTERM; the port is taken before the model loads. The exit status: 0, or 1 when the shutdown
    cut requests off (a second signal, or requests still running past the shutdown's bound).

    The searches run in this thread, which loaded the model, and uvicorn answers HTTP in another: torch's
    CPU kernels run slower in a thread other than the one whose OpenMP threads did the loading
    (docs/benchmarks.md, "Serving under load").
    """
    sock = bind(cfg.host, cfg.port)
    try:
        translator = load_translator(model, **load)
        batcher = make_batcher(translator, cfg)
        app = create_app(translator, cfg, model_name(model), batcher)
        host, port = sock.getsockname()[:2]
        where = f"[{host}]" if ":" in host else host
        precision = translator.precision or {}
        log.info(
            "serving %s at http://%s:%d in %s (%s; searches of up to %d sentences, %s; an idle one waits up to %g ms)",
            model, where, port, precision.get("precision"), precision.get("reason"), cfg.max_batch_size,
            batching(translator, cfg.continuous), cfg.max_wait_ms,
        )  # fmt: skip
        server = uvicorn.Server(uvicorn_config(app, cfg))

        def answer_http() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                batcher.close()  # uvicorn has ended (its shutdown closed the batcher, or it failed to start)

        http = threading.Thread(target=answer_http, name="mtkit-http")
        with _signals_stop(server):
            http.start()
            try:
                batcher.run()
            finally:
                server.should_exit = True
                http.join()
    finally:
        sock.close()
    cut_off = app.state.tally.cut_off
    if cut_off:
        log.error("stopped with %d requests unanswered", cut_off)
    return 1 if cut_off else 0


def model_name(model: str | Path) -> str:
    """What clients see the model called: its folder's or file's name (best/ and last/ by their run's), never
    the path on the server."""
    path = Path(model)
    return path.parent.name if path.name in ("best", "last") and path.parent.name else path.name
