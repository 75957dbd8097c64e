"""The gate every request passes: the API key, the request's number (X-Request-ID), one log line per request
in which what a client sent is escaped, a 500 that names only that number, each request counted in the server's
metrics, and the count of requests the shutdown cut off."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtkit.serving.metrics import OTHER, ServerMetrics
from mtkit.serving.openapi import UNKEYED_PATHS

log = logging.getLogger("mtkit")

# What needs no key: the health check, and the API's documentation for people (the page, its files, its OAuth2
# redirect and the schema it reads), whose own requests carry the key the page is given.
OPEN_PATHS = frozenset({"/health", *UNKEYED_PATHS})


@dataclass
class Tally:
    """What the server's requests came to, for its exit status: those cut off by the shutdown."""

    cut_off: int = 0


class Gatekeeper:
    """ASGI middleware around the application: the API key check on every path but ``OPEN_PATHS``, and one log line
    per request (its number, also sent as X-Request-ID, method, path, sentences, milliseconds, status; 499 for
    a client that went away), each request also counted in ``metrics`` under its route, one of ``routes`` (the
    application's paths) or ``OTHER``. An error inside the application is
    logged, with its traceback, under the request's number, and the client gets a 500 that says no more than
    that number.

    Plain ASGI rather than ``@app.middleware``, whose wrapping (a task group and a stream per request) took a
    third of the HTTP thread's time under load.

    ``refusals`` gives the 401's body for the paths of APIs that answer errors in their own shape (OpenAI's).
    A route of ``body_keyed`` paths may take the key in its body (as LibreTranslate's clients send it): a request
    to one without the right key in its Authorization header is let through with ``request.state.authorized``
    False, and the route checks the body's key (``key_matches``).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        tally: Tally,
        metrics: ServerMetrics,
        routes: frozenset[str],
        body_keyed: frozenset[str] = frozenset(),
        refusals: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.expected = f"Bearer {api_key}".encode()
        self.numbers = itertools.count(1)
        self.tally = tally
        self.metrics = metrics
        self.routes = routes
        self.body_keyed = body_keyed
        self.refusals = refusals or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        number, start, status = next(self.numbers), time.perf_counter(), 500
        state = scope.setdefault("state", {})  # what the handler's request.state writes to
        state["sentences"], state["number"], state["model"] = 0, number, ""
        state["authorized"] = not self.api_key or scope["path"] in OPEN_PATHS or self._authorized(scope)
        started = False

        async def send_numbered(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", str(number).encode())]
            await send(message)

        try:
            if not state["authorized"] and scope["path"] not in self.body_keyed:
                refusal = JSONResponse(
                    self.refusals.get(scope["path"], {"detail": "missing or wrong API key"}),
                    401,
                    headers={"WWW-Authenticate": 'Bearer realm="mtkit"'},
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
            route = scope["path"] if scope["path"] in self.routes else OTHER
            self.metrics.answered(state["model"], route, scope["method"], status, elapsed / 1000, state["sentences"])
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


def key_matches(api_key: str, given: str) -> bool:
    """Whether ``given`` is the server's ``api_key`` (any key when the server has none), in constant time."""
    return not api_key or hmac.compare_digest(given.encode("utf-8", "surrogatepass"), api_key.encode())


def printable(text: str) -> str:
    """``text`` as a log line may hold it: what would not print (a line break, a terminal's escape, a direction
    mark) and the backslash as Python escapes them, so that a client's bytes cannot forge or hide log lines."""
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)
