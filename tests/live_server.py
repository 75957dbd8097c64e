"""Live servers the serving tests share: `mtkit serve` in a child process, the application under uvicorn in a
thread of the test's own, scripted translators that need no model, and a search stepped by the test."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from mtkit.config import DecodeConfig, ServeConfig
from mtkit.decoding.line_translator import LineTranslator, PairScore, Translation
from mtkit.serving import connections
from mtkit.serving import server as serve
from mtkit.serving.adapters import ServedAdapter
from mtkit.serving.batcher import Batcher
from mtkit.serving.models import pool_of

KEY = "a-key-for-tests"


AUTH = {"Authorization": f"Bearer {KEY}"}


class Server:
    """A `mtkit serve` process on a free port of 127.0.0.1, its stderr in a file; ready once /health answers."""

    def __init__(self, run: Path | None, log: Path, *options: str, env: dict[str, str] | None = None) -> None:
        """``run``: the one model to serve; None where ``options`` name the models."""
        self.log = log
        model = [str(run)] if run is not None else []
        command = [sys.executable, "-m", "mtkit", "--log-level", "debug", "serve", *model, "--port", "0"]
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                [*command, "--device", "cpu", *options],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**os.environ, **(env or {})},
            )
        self.url = self._wait_until_ready()

    def _wait_until_ready(self, limit_s: float = 120.0) -> str:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            found = re.search(r"serving .* at (http://\S+)", self.log.read_text())
            if found:
                try:
                    if httpx.get(found.group(1) + "/health", timeout=5).status_code == 200:
                        return found.group(1)
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"the server did not start: {self.log.read_text()}")

    def wait_for_log(self, pattern: str, count: int, limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        while len(re.findall(pattern, self.log.read_text())) < count:
            assert time.monotonic() < deadline, f"{count} x {pattern!r} not in the log: {self.log.read_text()}"
            time.sleep(0.02)

    def post(self, body: dict | None = None, **kwargs) -> httpx.Response:
        return httpx.post(self.url + "/v1/translate", json=body, timeout=60, **kwargs)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=60)


class Scripted(LineTranslator):
    """Upper-cases each line; a line holding "boom" breaks the whole search it is in."""

    decode, nbest = DecodeConfig(beam=2), 1

    def stream(self, chunks):
        for chunk in chunks:
            if any("boom" in line for line in chunk):
                raise RuntimeError("the search broke")
            yield from ([Translation(line.upper(), -1.0, -2.0)] for line in chunk)


@contextlib.contextmanager
def serving_in_this_process(
    translator: LineTranslator,
    cfg: ServeConfig,
    batcher: Batcher | None = None,
    name: str = "scripted",
    adapters: dict[str, ServedAdapter] | None = None,
):
    """``create_app`` under uvicorn, set up as `mtkit serve` sets it up, in a thread on a free port; its URL.
    ``batcher``: one the caller runs, as ``create_app`` takes it; ``name``: the model's; ``adapters``: its LoRA
    adapters, by name."""
    sock = connections.bind("127.0.0.1", 0)
    app = serve.create_app(pool_of(name, translator, adapters), cfg, batcher)
    server = uvicorn.Server(connections.uvicorn_config(app, cfg))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", sock.getsockname()[1], server, thread, app)
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@dataclass
class Served:
    url: str
    port: int
    server: uvicorn.Server
    thread: threading.Thread
    app: object


def shout(lines: list[str], options) -> list[str]:
    if "boom" in lines:
        raise ValueError("boom")
    return [f"{line.upper()}/{options}" for line in lines]


class Countdown:
    """A continuous search in which a line is done after as many steps (of 10 ms) as it has characters."""

    def __init__(self, steps_seen: list[list[str]]) -> None:
        self.live: dict = {}
        self.steps_seen = steps_seen

    def add(self, key, line: str) -> None:
        self.live[key] = [line, len(line)]

    def step(self) -> list:
        time.sleep(0.01)
        self.steps_seen.append(sorted(line for line, _ in self.live.values()))
        for entry in self.live.values():
            entry[1] -= 1
        done = [(key, entry[0].upper()) for key, entry in self.live.items() if entry[1] == 0]
        for key, _ in done:
            del self.live[key]
        return done

    def drop(self, keys: set) -> None:
        for key in keys & set(self.live):
            del self.live[key]

    def __len__(self) -> int:
        return len(self.live)


@contextlib.contextmanager
def stepwise_server(cfg: ServeConfig):
    """A server whose requests are searched by a ``Countdown`` (a line takes a step of 10 ms per character); the
    served application and the searches it opened."""
    searches: list[Countdown] = []

    class Answering(Countdown):  # each line done as the server renders it
        def step(self) -> list:
            return [(key, [Translation(text, -1.0, -2.0)]) for key, text in super().step()]

    def open_search(options) -> Countdown:
        searches.append(Answering([]))
        return searches[-1]

    batcher = Batcher(
        shout,
        cfg.max_batch_size,
        cfg.max_wait_ms / 1000,
        cfg.max_queue,
        open_search,
        queue_of=lambda options: options.model,
    )
    batcher.start()
    try:
        with serving_in_this_process(Scripted(), cfg, batcher) as served:
            yield served, searches
    finally:
        batcher.close()


def wait_until(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class ScriptedScorer(Scripted):
    """Scores each target -1 a character and its eos; a target "boom" breaks the batch it is in, and one "slow"
    takes two seconds. Notes each target it scores and the thread each translation and scoring runs in."""

    def __init__(self) -> None:
        self.scored: list[str] = []
        self.threads: set[str] = set()

    def stream(self, chunks):
        self.threads.add(threading.current_thread().name)
        yield from super().stream(chunks)

    def score_chunk(self, sources, targets, first_line, tokens):
        self.threads.add(threading.current_thread().name)
        if "boom" in targets:
            raise RuntimeError("the scoring broke")
        if "slow" in targets:
            time.sleep(2)
        self.scored += targets
        return [PairScore(-1.0 - len(t), len(t) + 1, (-1.0,) * (len(t) + 1) if tokens else None) for t in targets]
