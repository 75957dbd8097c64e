"""The connection layer under the application: the listening socket, uvicorn's HTTP protocol with the bounds it
lacks (connections, the time and size of a request's head, the bytes after it), uvicorn's settings, and the
signals that stop the server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import resource
import signal
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mtkit.config import ServeConfig
from mtkit.runtime import RuntimeSetupError
from mtkit.serving.requests import RETRY_AFTER_S, body_limit

log = logging.getLogger("mtkit")

FILES_KEPT = 64  # descriptors left to the process (model files, logs, sockets) beside its connections
# A request's line and header fields are held in memory until the last has arrived; more is 431. h11's bound on
# them (uvicorn's too, with h11), and http.client's on the fields' number: an API client's head is far smaller.
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADER_FIELDS = 100
# The most bytes the HTTP parser is given at once. It tells no offset, so of a slice in which a request's head or the
# request ends, all counts against what follows: pipelined requests carry no uncounted bytes into the next head.
FEED_BYTES = 1024


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


class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's HTTP protocol (over httptools) with the bounds it lacks: a connection beyond ``max_connections``
    is answered 503 and closed; one whose request headers have not all arrived ``receive_timeout`` seconds after
    it opened (or after its last response) is closed, so that clients trickling bytes cannot hold descriptors;
    and, since httptools holds a header line of any length, a request head over ``MAX_HEAD_BYTES`` or
    ``MAX_HEADER_FIELDS`` is answered 431, and a request whose body and trailer fields (after a chunked body)
    run past ``max_body`` and a head's bytes ends its connection, each having grown the process by no more.
    ``guarded_protocol`` sets the three bounds."""

    max_connections: int
    receive_timeout: float
    max_body: int

    header_timer: asyncio.TimerHandle | None = None
    in_head = True  # the parser is reading a request's head (else its body and trailer fields)
    room = MAX_HEAD_BYTES  # bytes that part of the request may still take; none left at 0 or below
    feeding = 0  # bytes in the slice the parser is reading
    fields = 0  # header (and trailer) fields of the request now arriving
    refused = False  # a request over its bounds was answered or cut off: what the client sends after is dropped
    refusal: bytes | None = None  # a 431 waiting for the answers to the requests before it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
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
        self.in_head, self.room = False, self.max_body + MAX_HEAD_BYTES - self.feeding
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
        self.refused, limit = True, self.max_body + MAX_HEAD_BYTES
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
        self.header_timer = self.loop.call_later(self.receive_timeout, self._headers_due, cycle)

    def _headers_due(self, cycle: object) -> None:
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(max_connections: int, receive_timeout: float, max_body: int) -> type[asyncio.Protocol]:
    """``GuardedProtocol`` with its bounds: connections at most, seconds for a request's headers to arrive,
    and the bytes of a body the application takes."""
    bounds = {"max_connections": max_connections, "receive_timeout": receive_timeout, "max_body": max_body}
    return type("Guarded", (GuardedProtocol,), bounds)


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
def signals_stop(server: uvicorn.Server) -> Iterator[None]:
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
