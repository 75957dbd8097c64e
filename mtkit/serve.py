"""Translation over HTTP (`mtkit serve`): a FastAPI application over the translator `mtkit.load` gives.

    POST /v1/translate  {"text": "A dog." | ["A dog.", ...], "beam": 5, "nbest": 1, "scores": false}
                        -> {"translations": [...]}: one per text, in order
    GET  /health        -> 200 once the model is loaded (the server listens only then)
    GET  /v1/models     -> the model's languages, precision, decode settings and tokenizer hashes; mtkit's version

The sentences of concurrent requests are searched together (``mtkit.batcher``). Every answer is
bounded: too much text is 413, a full queue 503 with Retry-After, a request that waits past the
timeout 504, a malformed one 422; a request that breaks the search is 500, and only that request.
SIGINT or SIGTERM stops taking connections, finishes the requests in flight, and exits 0.

Needs the ``serve`` extra (fastapi, uvicorn); only `mtkit serve` imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Hashable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtkit import __version__
from mtkit.batcher import Batcher, Refused, Search, WholeBatch
from mtkit.config import ServeConfig
from mtkit.continuous import LineSearch
from mtkit.runtime import RuntimeSetupError
from mtkit.translate import LineTranslator, Translation, load_translator

log = logging.getLogger("mtkit")

RETRY_AFTER_S = 1  # what a 503 asks the client to wait: a full queue drains in about a batch's time


class TranslateRequest(BaseModel):
    """The body of ``POST /v1/translate``; what it does not give follows the model's saved decode settings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] = Field(
        description="A text, or a list of texts; each is one segment, as one input line is to `mtkit translate`."
    )
    beam: int | None = Field(None, ge=1, description="Beam size; 1 is greedy. Default: the model's.")
    nbest: int = Field(1, ge=1, description="Up to this many translations per text, best first; at most the beam.")
    scores: bool = Field(False, description="Each translation as {text, score, logprob} rather than a string.")

    @model_validator(mode="after")
    def _within_the_beam(self, info: ValidationInfo) -> TranslateRequest:
        """The beam against the server's limit, and nbest against the beam (the model's when not given)."""
        max_beam, beam = info.context["max_beam"], self.beam or info.context["beam"]
        if self.beam is not None and self.beam > max_beam:
            raise ValueError(f"beam {self.beam} is over this server's limit of {max_beam}")
        if self.nbest > beam:
            raise ValueError(f"nbest {self.nbest} needs a beam of at least {self.nbest} (the beam is {beam})")
        return self

    def texts(self) -> list[str]:
        """The texts, NUL characters replaced by spaces as `mtkit translate` does."""
        return [text.replace("\0", " ") for text in ([self.text] if isinstance(self.text, str) else self.text)]


def body_limit(cfg: ServeConfig) -> int:
    """The most bytes a request within the limits can take: JSON spells a character in up to 12 bytes
    (a surrogate pair of \\u escapes), plus quotes and a comma per text and the options."""
    return 12 * cfg.max_chars + 4 * cfg.max_texts + 1024


def rendered(translations: list[Translation], nbest: int, scores: bool) -> Any:
    """One text's answer, as `mtkit translate` prints it: the best translation; with ``scores`` that with its
    length-normalised score and log-probability; with ``nbest`` > 1 a list of those, best first."""
    entries = [{"text": t.text, "score": t.score, "logprob": t.logprob} for t in translations]
    if nbest > 1:
        return entries
    return entries[0] if scores else translations[0].text


def search(translator: LineTranslator, lines: list[str], options: Hashable) -> list[list[Translation]]:
    """The ``nbest`` translations of each line at one beam, all at once."""
    beam, nbest = options
    return list(translator.hypotheses(lines, beam=beam, nbest=nbest))


def open_search(translator: LineTranslator, continuous: bool, options: Hashable) -> Search[list[Translation]]:
    """The search that the requests of one beam and nbest share: continuous where the translator allows it."""
    beam, nbest = options
    chosen = translator.using(beam=beam, nbest=nbest)
    if continuous and LineSearch.accepts(chosen):
        return LineSearch(chosen)
    return WholeBatch(functools.partial(search, translator), options)


def make_batcher(translator: LineTranslator, cfg: ServeConfig) -> Batcher[list[Translation]]:
    """The batcher of the server's searches, as ``cfg`` sets it up."""
    return Batcher(
        functools.partial(search, translator),
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        functools.partial(open_search, translator, cfg.continuous),
    )


def create_app(
    translator: LineTranslator, cfg: ServeConfig, name: str, batcher: Batcher[list[Translation]] | None = None
) -> FastAPI:
    """The application. ``batcher``: one whose ``run`` the caller runs; by default the application runs its own
    in a thread that starts with it. At shutdown the batcher finishes the work queued before it closes."""
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
    context = {"max_beam": cfg.max_beam, "beam": translator.decode.beam}
    schema = {"content": {"application/json": {"schema": TranslateRequest.model_json_schema()}}, "required": True}

    @app.post("/v1/translate", openapi_extra={"requestBody": schema})
    async def translate(request: Request) -> dict[str, list[Any]]:
        """Translate one text or a list of texts: one translation per text, in order."""
        body = await _read_body(request, body_limit(cfg))
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
            future = batcher.submit(texts, (query.beam or translator.decode.beam, query.nbest))
        except Refused as err:
            raise HTTPException(503, str(err), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            results = await asyncio.wait_for(asyncio.wrap_future(future), cfg.timeout)
        except asyncio.TimeoutError:
            raise HTTPException(504, f"no translation within {cfg.timeout:g} s; the server is busy") from None
        except Exception as err:  # its search failed (logged with its traceback by the batcher)
            raise HTTPException(500, f"translation failed: {type(err).__name__}: {err}") from None
        return {"translations": [rendered(r, query.nbest, query.scores) for r in results]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        """200 while the server answers; it listens only once the model is loaded."""
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The model served: its languages, precision (and why), decode settings and tokenizer hashes; the
        request limits."""
        languages = translator.languages
        model = {
            "name": name,
            "languages": {"source": languages[0], "target": languages[1]} if languages else None,
            "precision": translator.precision,
            "decode": asdict(translator.decode),
            "tokenizers": {"source": translator.src_tok.sha256, "target": translator.tgt_tok.sha256},
        }
        return {"mtkit_version": __version__, "models": [model], "limits": limits}

    app.add_middleware(Gatekeeper, api_key=cfg.api_key)
    return app


class Gatekeeper:
    """ASGI middleware around the application: the API key check on every path but /health, and one log line
    per request (its number, also sent as X-Request-ID, method, path, sentences, milliseconds, status).

    Plain ASGI rather than ``@app.middleware``, whose wrapping (a task group and a stream per request) took a
    third of the HTTP thread's time under load.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key
        self.expected = f"Bearer {api_key}".encode()
        self.numbers = itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        number, start, status = next(self.numbers), time.perf_counter(), 500
        state = scope.setdefault("state", {})  # what the handler's request.state writes to
        state["sentences"] = 0

        async def send_numbered(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
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
        finally:
            log.info(
                "request %d %s %s: %d sentences, %.1f ms, status %d",
                number, scope["method"], scope["path"], state["sentences"], (time.perf_counter() - start) * 1000,
                status,
            )  # fmt: skip

    def _authorized(self, scope: Scope) -> bool:
        """The Authorization header's bytes against the key's, in constant time."""
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes: a larger one is 413 whatever its Content-Length says."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"the body is over {limit:,} bytes")
    return bytes(body)


def _problems(err: ValidationError) -> str:
    """A validation error in one line: where and what, for each problem."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors(include_url=False))


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


def serve(model: str | Path, cfg: ServeConfig, **load: Any) -> None:
    """Serve ``model`` (what `mtkit.load` takes, with its ``load`` options: device, precision, engine) until
    SIGINT or SIGTERM; the port is taken before the model loads.

    The searches run in this thread, which loaded the model, and uvicorn answers HTTP in another: torch's
    CPU kernels run about 20% slower in a thread other than the one whose OpenMP threads did the loading.
    """
    sock = bind(cfg.host, cfg.port)
    try:
        translator = load_translator(model, **load)
        batcher = make_batcher(translator, cfg)
        app = create_app(translator, cfg, str(model), batcher)
        host, port = sock.getsockname()[:2]
        where = f"[{host}]" if ":" in host else host
        precision = translator.precision or {}
        log.info(
            "serving %s at http://%s:%d in %s (%s; searches of up to %d sentences, %s; an idle one waits up to %g ms)",
            model, where, port, precision.get("precision"), precision.get("reason"), cfg.max_batch_size,
            "continuous" if cfg.continuous else "whole batches", cfg.max_wait_ms,
        )  # fmt: skip
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))

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
