"""Translation over HTTP (`mtkit serve`): a FastAPI application over the models a pool holds (``models``).

    POST /v1/translate  {"text": "A dog." | ["A dog.", ...], "beam": 5, "nbest": 1, "scores": false,
                         "alignments": false, "tgt_lang": "de", "src_lang": "en", "model": "en-de",
                         "adapter": "legal"}
                        -> {"translations": [...]}: one per text, in order
    POST /v1/score      {"source": "A dog." | [...], "target": "Ein Hund." | [...], "tokens": false, "tgt_lang": "de",
                         "src_lang": "en", "model": "en-de", "adapter": "legal"}
                        -> {"scores": [{"logprob": -3.2, "tokens": 4}, ...]}: one per pair, in order
    GET  /health        -> 200 once the server listens (with one model, once it is loaded)
    GET  /metrics       -> the server's metrics in Prometheus' text format (``metrics``)
    GET  /v1/models     -> each model's name, languages, directions (or the languages it translates between),
                           decode settings, adapters and whether it is in memory (then its precision, batching and
                           tokenizer hashes); mtkit's version; OpenAI's list of the models' names
    POST /translate, GET /languages       -> LibreTranslate's API (``libretranslate``)
    POST /v1/chat/completions             -> OpenAI's chat completions: the last user message translated
                                             (``chat_completions``)
    GET  /docs, /openapi.json             -> the API's documentation (``openapi``), which needs no key

A request names its model, or is routed by its languages to the first model that translates them. Models load at
their first request (one model alone, before the server listens) and, beyond ``--max-loaded``, the least recently
used idle one is evicted (``models``). One base model may serve several LoRA adapters (``adapters``), each named by
the requests that want it, over the base's weights held once.

The sentences of concurrent requests for the same model and options are searched together (``mtkit.serving.batcher``);
each model's requests queue apart. Every answer is
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
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.routing import Route

from mtkit.config import ServeConfig
from mtkit.serving.batcher import Batcher
from mtkit.serving.chat_completions import add_chat_routes
from mtkit.serving.connections import bind, signals_stop, uvicorn_config
from mtkit.serving.gate import Gatekeeper, Tally
from mtkit.serving.libretranslate import add_libretranslate_routes
from mtkit.serving.metrics import ServerMetrics
from mtkit.serving.models import ModelPool, ModelSpec, loader, read_card
from mtkit.serving.openapi import add_docs_routes, document
from mtkit.serving.requests import ScoreAnswer, ScoreRequest, TranslateRequest
from mtkit.serving.routes import MetricsRoute, ModelsRoute, ScoreRoute, TranslateRoute, health
from mtkit.serving.searches import Answer, Work, make_batcher
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


def create_app(pool: ModelPool, cfg: ServeConfig, batcher: Batcher[Work, Answer] | None = None) -> FastAPI:
    """The application over ``pool``'s models. ``batcher``: one whose ``run`` the caller runs; by default the
    application runs its own in a thread that starts with it. At shutdown the batcher finishes the work queued
    before it closes. ``app.state.tally`` counts the requests the shutdown cut off, ``app.state.metrics`` what
    /metrics tells."""
    own = batcher is None
    batcher = batcher or make_batcher(pool.translators, cfg, pool.admit)
    app = FastAPI(
        title="mtkit",
        version=__version__,
        docs_url=None,  # add_docs_routes: Swagger UI from a local copy, not a CDN
        redoc_url=None,
        lifespan=functools.partial(batcher_running, batcher, own),
    )
    metrics = ServerMetrics(list(pool.cards))
    app.add_api_route(
        "/v1/translate",
        TranslateRoute(pool, cfg, batcher, metrics).translate,
        methods=["POST"],
        openapi_extra={"requestBody": body(TranslateRequest)},
    )
    app.add_api_route(
        "/v1/score",
        ScoreRoute(pool, cfg, batcher, metrics).score,
        methods=["POST"],
        openapi_extra={"requestBody": body(ScoreRequest)},
        response_model=ScoreAnswer,
        response_model_exclude_none=True,
    )
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", ModelsRoute(pool, cfg).models, methods=["GET"])
    app.add_api_route("/metrics", MetricsRoute(metrics).metrics_text, methods=["GET"], include_in_schema=False)
    refusals = add_chat_routes(app, pool, cfg, batcher, metrics)
    body_keyed = add_libretranslate_routes(app, pool, cfg, batcher, metrics)
    add_docs_routes(app)
    document(app, keyed=bool(cfg.api_key))
    for name in pool.cards:
        metrics.watch(name, functools.partial(batcher.pending, name))
    metrics.watch_loaded(lambda: len(pool.loaded))
    pool.on_load, pool.on_evict = metrics.model_loaded, metrics.model_evicted
    batcher.watch_steps(metrics.stepped)
    app.state.tally, app.state.metrics = Tally(), metrics
    routes = frozenset(route.path for route in app.routes if isinstance(route, Route))
    app.add_middleware(
        Gatekeeper, api_key=cfg.api_key, tally=app.state.tally, metrics=metrics, routes=routes,
        body_keyed=body_keyed, refusals=refusals,
    )  # fmt: skip
    return app


def body(request: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads and checks its body itself (``routes``): ``request``'s."""
    return {"content": {"application/json": {"schema": request.model_json_schema()}}, "required": True}


def serve(specs: list[ModelSpec], cfg: ServeConfig, max_loaded: int = 0, **load: Any) -> int:
    """Serve the models ``specs`` name (what `mtkit.load` takes, with its ``load`` options: device, precision,
    engine, threads), each with its LoRA adapters, until SIGINT or SIGTERM; at most ``max_loaded`` of them in memory
    at once (0: no bound). The port is taken before anything is read; every model's card is read before the server
    listens, and a server of one model loads it first too. The exit status: 0, or 1 when the shutdown cut requests
    off (a second signal, or requests still running past the shutdown's bound).

    The searches, and the loading of models, run in this thread, and uvicorn answers HTTP in another: torch's
    CPU kernels run slower in a thread other than the one whose OpenMP threads did the loading
    (docs/benchmarks.md, "Serving under load"). Only while several models have searches running are their steps
    run at once, in a small pool's threads on one torch thread each (``searches.ModelSteps``).
    """
    sock = bind(cfg.host, cfg.port)
    try:
        engine = load.get("engine", "mtkit")
        cards = [read_card(spec, engine) for spec in specs]
        pool = ModelPool(specs, cards, loader(cfg.continuous, **load), max_loaded)
        batcher = make_batcher(pool.translators, cfg, pool.admit)
        app = create_app(pool, cfg, batcher)
        if len(specs) == 1:
            pool.translators(specs[0].name)
        host, port = sock.getsockname()[:2]
        where = f"[{host}]" if ":" in host else host
        bound = f"at most {max_loaded} in memory" if max_loaded else "all may be in memory"
        log.info(
            "serving %s at http://%s:%d (searches of up to %d sentences; an idle one waits up to %g ms; %s)",
            ", ".join(spec.name for spec in specs), where, port, cfg.max_batch_size, cfg.max_wait_ms, bound,
        )  # fmt: skip
        for name, loaded in pool.loaded.items():
            precision = loaded.translator.precision or {}
            log.info("%s in %s (%s), %s", name, precision.get("precision"), precision.get("reason"), loaded.batching)
            for record in loaded.adapters:
                log.info(
                    "adapter %s: rank %d, alpha %g, on %s", record["name"], record["rank"], record["alpha"],
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
