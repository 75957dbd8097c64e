"""The server's Prometheus metrics (``GET /metrics``): requests by model, route, method and status, their seconds,
the sentences and tokens translated, each model's queue and the sentences in each of its search steps, the models
in memory, their loads and evictions. A registry of the application's own, so that two servers in one process count
apart.

Labels take few values whatever clients send: a model one of the server's, else "" (a request that reached no
model: unknown paths, refused keys, malformed bodies); a route one of the application's, else "other"; a method one
of HTTP's, else "other"; a status a number."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mtkit.data.tokenizer import Tokenizer

OTHER = "other"  # the label of a path that is no route, or a method that is none of HTTP's
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
# Seconds a request takes: from a health check's fraction of a millisecond to a timed-out translation's minute.
REQUEST_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Sentences in one search step: powers of two up to the largest batch the config allows and beyond.
BATCH_SENTENCES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    """The metrics of one application serving the models named ``models``."""

    def __init__(self, models: list[str]) -> None:
        self.models = frozenset(models)
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "mtkit_requests", "HTTP requests answered", ["model", "route", "method", "status"], registry=registry
        )
        self.request_seconds = Histogram(
            "mtkit_request_seconds", "Seconds from a request's arrival to its answer", ["model", "route"],
            buckets=REQUEST_SECONDS, registry=registry,
        )  # fmt: skip
        self.sentences = Counter(
            "mtkit_sentences", "Sentences (texts, or pairs scored) of the requests answered 200", ["model", "route"],
            registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "mtkit_tokens", "Tokens translated: the sources' and the best translations', without special tokens",
            ["model", "side"], registry=registry,
        )  # fmt: skip
        self.queue = Gauge(
            "mtkit_queue_sentences", "Sentences waiting in the model's queue or in its searches", ["model"],
            registry=registry,
        )  # fmt: skip
        self.batch = Histogram(
            "mtkit_batch_sentences", "Sentences in each search step (the batch's occupancy)", ["model"],
            buckets=BATCH_SENTENCES, registry=registry,
        )  # fmt: skip
        self.loaded = Gauge("mtkit_models_loaded", "Models in memory", registry=registry)
        self.loads = Counter("mtkit_model_loads", "Times a model was loaded", ["model"], registry=registry)
        self.load_seconds = Counter(
            "mtkit_model_load_seconds", "Seconds spent loading the model", ["model"], registry=registry
        )
        self.evictions = Counter(
            "mtkit_model_evictions", "Times the model was evicted to make room for another", ["model"],
            registry=registry,
        )  # fmt: skip

    def answered(self, model: str, route: str, method: str, status: int, seconds: float, sentences: int) -> None:
        """A request for ``model`` to ``route`` (a route's path, or ``OTHER``) answered with ``status`` after
        ``seconds``; its ``sentences`` count when it succeeded."""
        model = model if model in self.models else ""
        self.requests.labels(model, route, method if method in METHODS else OTHER, str(status)).inc()
        self.request_seconds.labels(model, route).observe(seconds)
        if status == 200 and sentences:
            self.sentences.labels(model, route).inc(sentences)

    def translated(
        self, model: str, tokenizers: tuple[Tokenizer, Tokenizer] | None, sources: list[str], targets: list[str]
    ) -> tuple[int, int] | None:
        """Counts the tokens of ``sources`` and of their translations ``targets`` by ``model``, as its ``tokenizers``
        cut them, and gives them back (source, target); none are counted for a model that has none."""
        if tokenizers is None:
            return None
        src_tok, tgt_tok = tokenizers
        counts = sum(map(len, src_tok.encode(sources))), sum(map(len, tgt_tok.encode(targets)))
        self.tokens.labels(model, "source").inc(counts[0])
        self.tokens.labels(model, "target").inc(counts[1])
        return counts

    def watch(self, model: str, pending: Callable[[], float]) -> None:
        """``model``'s queue gauge reads ``pending()`` at each scrape."""
        self.queue.labels(model).set_function(pending)

    def watch_loaded(self, loaded: Callable[[], float]) -> None:
        """The models-in-memory gauge reads ``loaded()`` at each scrape."""
        self.loaded.set_function(loaded)

    def stepped(self, model: str, sentences: int) -> None:
        """A search step of ``model`` of ``sentences`` sentences."""
        self.batch.labels(model).observe(sentences)

    def model_loaded(self, model: str, seconds: float) -> None:
        self.loads.labels(model).inc()
        self.load_seconds.labels(model).inc(seconds)

    def model_evicted(self, model: str) -> None:
        self.evictions.labels(model).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
