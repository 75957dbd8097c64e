"""Translation over HTTP (`mtkit serve`): a FastAPI application over the translator `mtkit.load` gives.

    POST /v1/translate  {"text": "A dog." | ["A dog.", ...], "beam": 5, "nbest": 1, "scores": false,
                         "alignments": false, "tgt_lang": "de", "src_lang": "en", "adapter": "legal"}
                        -> {"translations": [...]}: one per text, in order
    POST /v1/score      {"source": "A dog." | [...], "target": "Ein Hund." | [...], "tokens": false, "tgt_lang": "de",
                         "src_lang": "en", "adapter": "legal"}
                        -> {"scores": [{"logprob": -3.2, "tokens": 4}, ...]}: one per pair, in order
    GET  /health        -> 200 once the model is loaded (the server listens only then)
    GET  /metrics       -> the server's metrics in Prometheus' text format (``metrics``)
    GET  /v1/models     -> the model's name, languages, directions (or the languages it translates between),
                           precision, batching, decode settings, tokenizer hashes and LoRA adapters; mtkit's version

One base model may serve several LoRA adapters (``adapters``), each named by the requests that want it, over
the base's weights held once; requests for different adapters are never searched together.

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

``create_app`` puts the routes (``routes``) behind the gate (``gate``: the API key, request numbers, log lines);
``serve`` answers HTTP with it through bounded connections (``connections``) while this thread runs the searches
(``searches``). Needs the ``serve`` extra (fastapi, uvicorn); only `mtkit serve` imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.routing import Route

from mtkit.config import ServeConfig
from mtkit.decoding.line_translator import LineTranslator
from mtkit.serving.adapters import ServedAdapter, load_adapters
from mtkit.serving.batcher import Batcher
from mtkit.serving.connections import bind, signals_stop, uvicorn_config
from mtkit.serving.gate import Gatekeeper, Tally
from mtkit.serving.metrics import ServerMetrics
from mtkit.serving.requests import ScoreAnswer, ScoreRequest, TranslateRequest
from mtkit.serving.routes import MetricsRoute, ModelsRoute, ScoreRoute, TranslateRoute, health
from mtkit.serving.searches import Answer, Translators, Work, batching, make_batcher
from mtkit.translation.engines import load_translator
from mtkit.version import __version__

log = logging.getLogger("mtkit")


@contextlib.asynccontextmanager
async def batcher_running(batcher: Batcher[Work, Answer], own: bool, app: FastAPI) -> AsyncIterator[None]:
    """The application's lifespan: its own batcher started with it; any batcher closed at its end, once the
    work queued before has been done."""
    if own:
        batcher.start()
    try:
        yield
    finally:
        await asyncio.to_thread(batcher.close)


def create_app(
    translator: LineTranslator,
    cfg: ServeConfig,
    name: str,
    batcher: Batcher[Work, Answer] | None = None,
    adapters: dict[str, ServedAdapter] | None = None,
) -> FastAPI:
    """The application; ``name`` is what /v1/models calls the model, ``adapters`` the LoRA adapters requests may
    name. ``batcher``: one whose ``run`` the caller runs; by default the application runs its own in a thread that
    starts with it. At shutdown the batcher finishes the work queued before it closes. ``app.state.tally`` counts
    the requests the shutdown cut off, ``app.state.metrics`` what /metrics tells."""
    adapters = adapters or {}
    own = batcher is None
    batcher = batcher or make_batcher(translators(translator, adapters), cfg)
    app = FastAPI(title="mtkit", version=__version__, lifespan=functools.partial(batcher_running, batcher, own))
    names = list(adapters)
    metrics = ServerMetrics(name)
    translate = TranslateRoute(translator, cfg, batcher, names, metrics)
    app.add_api_route(
        "/v1/translate", translate.translate, methods=["POST"], openapi_extra={"requestBody": body(TranslateRequest)}
    )
    app.add_api_route(
        "/v1/score",
        ScoreRoute(translator, cfg, batcher, names).score,
        methods=["POST"],
        openapi_extra={"requestBody": body(ScoreRequest)},
        response_model=ScoreAnswer,
        response_model_exclude_none=True,
    )
    app.add_api_route("/health", health, methods=["GET"])
    records = {adapter: served.record for adapter, served in adapters.items()}
    app.add_api_route("/v1/models", ModelsRoute(translator, cfg, name, records).models, methods=["GET"])
    app.add_api_route("/metrics", MetricsRoute(metrics).metrics_text, methods=["GET"], include_in_schema=False)
    metrics.watch_queue(batcher.pending)
    batcher.watch_steps(metrics.stepped)
    app.state.tally, app.state.metrics = Tally(), metrics
    routes = frozenset(route.path for route in app.routes if isinstance(route, Route))
    app.add_middleware(Gatekeeper, api_key=cfg.api_key, tally=app.state.tally, metrics=metrics, routes=routes)
    return app


def translators(translator: LineTranslator, adapters: dict[str, ServedAdapter]) -> Translators:
    """The translator of the model (None) and of each adapter by name, as the searches choose among them."""
    return {None: translator, **{adapter: served.translator for adapter, served in adapters.items()}}


def body(request: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads and checks its body itself (``routes``): ``request``'s."""
    return {"content": {"application/json": {"schema": request.model_json_schema()}}, "required": True}


def serve(model: str | Path, cfg: ServeConfig, adapters: dict[str, Path] | None = None, **load: Any) -> int:
    """Serve ``model`` (what `mtkit.load` takes, with its ``load`` options: device, precision, engine, threads) and
    its LoRA ``adapters`` (by name) until SIGINT or SIGTERM; the port is taken before the model loads. The exit
    status: 0, or 1 when the shutdown cut requests off (a second signal, or requests still running past the
    shutdown's bound).

    The searches run in this thread, which loaded the model, and uvicorn answers HTTP in another: torch's
    CPU kernels run slower in a thread other than the one whose OpenMP threads did the loading
    (docs/benchmarks.md, "Serving under load").
    """
    sock = bind(cfg.host, cfg.port)
    try:
        translator = load_translator(model, **load)
        served = load_adapters(model, translator, adapters or {})
        batcher = make_batcher(translators(translator, served), cfg)
        app = create_app(translator, cfg, model_name(model), batcher, served)
        host, port = sock.getsockname()[:2]
        where = f"[{host}]" if ":" in host else host
        precision = translator.precision or {}
        log.info(
            "serving %s at http://%s:%d in %s (%s; searches of up to %d sentences, %s; an idle one waits up to %g ms)",
            model, where, port, precision.get("precision"), precision.get("reason"), cfg.max_batch_size,
            batching(translator, cfg.continuous), cfg.max_wait_ms,
        )  # fmt: skip
        for adapter, adapted in served.items():
            record = adapted.record
            log.info(
                "adapter %s: rank %d, alpha %g, on %s", adapter, record["rank"], record["alpha"],
                ", ".join(record["targets"]),
            )  # fmt: skip
        server = uvicorn.Server(uvicorn_config(app, cfg))

        def answer_http() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                batcher.close()  # uvicorn has ended (its shutdown closed the batcher, or it failed to start)

        http = threading.Thread(target=answer_http, name="mtkit-http")
        with signals_stop(server):
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
