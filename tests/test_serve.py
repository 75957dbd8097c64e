"""`mtkit serve` over real HTTP: server processes on the tiny model `test_cli` trains, talked to with httpx;
the application under uvicorn in this process over a scripted translator that can break; and the batcher
on its own, with a translate function written in the test."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from test_cli import invoke, trained_run  # noqa: F401  (trained_run is a fixture)

import mtkit
from mtkit import serve
from mtkit.batcher import Batcher, Refused
from mtkit.config import DecodeConfig, ServeConfig
from mtkit.runtime import choose_precision, cpu_features
from mtkit.tokenizer import Tokenizer
from mtkit.translate import LineTranslator, Translation

KEY = "a-key-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Server:
    """A `mtkit serve` process on a free port of 127.0.0.1, its stderr in a file; ready once /health answers."""

    def __init__(self, run: Path, log: Path, *options: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        command = [sys.executable, "-m", "mtkit", "--log-level", "debug", "serve", str(run), "--port", "0"]
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


@pytest.fixture(scope="module")
def lines(corpus_files) -> list[str]:
    chosen = corpus_files["val.en"].read_text().splitlines()[:10]
    return [*chosen, "", "A cat."]


@pytest.fixture(scope="module")
def expected(trained_run, lines) -> dict[int, dict[str, str]]:  # noqa: F811
    """The library's translation of each line, at beam 2 and at the model's own, 5."""
    translator = mtkit.load(trained_run, device="cpu")
    return {beam: dict(zip(lines, translator.translate(lines, beam=beam))) for beam in (2, 5)}


@pytest.fixture(scope="module")
def distinct(lines, expected) -> list[str]:
    """Lines whose translations differ from each other's (the tiny model's are poor, some are empty)."""
    chosen = {expected[2][line]: line for line in lines if expected[2][line]}
    assert len(chosen) >= 6
    return list(chosen.values())


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):  # noqa: F811
    """The server most tests share: an API key from the environment, batches waiting 20 ms for batch-mates."""
    running = Server(
        trained_run, tmp_path_factory.mktemp("serve") / "stderr", "--max-wait-ms", "20", env={"MTKIT_API_KEY": KEY}
    )
    yield running
    assert running.stop() == 0


def test_translations_are_the_librarys_in_order(server, trained_run, lines, expected):  # noqa: F811
    response = server.post({"text": lines}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json() == {"translations": [expected[5][line] for line in lines]}
    assert server.post({"text": lines[0], "beam": 2}, headers=AUTH).json() == {"translations": [expected[2][lines[0]]]}
    assert server.post({"text": []}, headers=AUTH).json() == {"translations": []}


def test_whole_batches_translate_as_the_library_does(trained_run, tmp_path, lines, expected):  # noqa: F811
    whole = Server(trained_run, tmp_path / "stderr", "--no-continuous")
    try:
        assert "whole batches" in whole.log.read_text()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda line: whole.post({"text": [line]}).json(), lines))
        assert answers == [{"translations": [expected[5][line]]} for line in lines]
    finally:
        assert whole.stop() == 0


def test_nbest_and_scores_are_those_the_command_line_prints(server, trained_run, lines):  # noqa: F811
    translator = mtkit.load(trained_run, device="cpu")
    chosen = [lines[0], "", lines[1]]
    listed = server.post({"text": chosen, "beam": 3, "nbest": 2}, headers=AUTH).json()["translations"]
    for entries, hypotheses in zip(listed, translator.hypotheses(chosen, beam=3, nbest=2)):
        assert [e["text"] for e in entries] == [h.text for h in hypotheses]
        assert [e["score"] for e in entries] == pytest.approx([h.score for h in hypotheses], abs=1e-3)
        assert [e["logprob"] for e in entries] == pytest.approx([h.logprob for h in hypotheses], abs=1e-3)
    assert listed[1] == [{"text": "", "score": 0.0, "logprob": 0.0}]  # an empty text: one empty entry
    scored = server.post({"text": chosen, "beam": 3, "scores": True}, headers=AUTH).json()["translations"]
    assert [entry["text"] for entry in scored] == [entries[0]["text"] for entries in listed]
    assert [entry["logprob"] < 0 for entry in scored] == [True, False, True]


def test_concurrent_requests_are_batched_and_each_gets_its_own_answers(server, distinct, expected):
    def requests_of(worker: int) -> list[tuple[list[str], int]]:
        """Four requests of 1 to 3 lines, at beam 2 for even workers and the model's beam 5 for odd ones."""
        beam = 2 if worker % 2 == 0 else 5
        return [
            ([distinct[(worker + i + j) % len(distinct)] for j in range(1 + (worker + i) % 3)], beam) for i in range(4)
        ]

    def work(worker: int) -> list[bool]:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
            answers = []
            for texts, beam in requests_of(worker):
                got = client.post("/v1/translate", json={"text": texts, "beam": beam}).json()["translations"]
                answers.append(got == [expected[beam][text] for text in texts])
            return answers

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(work, range(16)))
    assert results == [[True] * 4] * 16
    batches = [int(n) for n in re.findall(r"sentences join a search of \d+ \((\d+) requests\)", server.log.read_text())]
    assert max(batches) > 1  # requests did share searches


def test_too_much_text_is_413(server):
    assert server.post({"text": ["A dog."] * 65}, headers=AUTH).status_code == 413
    response = server.post({"text": ["a" * 10_000, "b" * 10_001]}, headers=AUTH)
    assert response.status_code == 413 and "20,001 characters" in response.json()["detail"]
    huge = httpx.post(server.url + "/v1/translate", content=b" " * 300_000, headers=AUTH, timeout=60)
    assert huge.status_code == 413 and "the body is over" in huge.json()["detail"]


@pytest.mark.parametrize(
    "body, problem",
    [
        (b'{"text": "A dog.', "Invalid JSON"),
        (b'{"text": 3}', "text"),
        (b'{"text": "A dog.", "bem": 3}', "bem: Extra inputs are not permitted"),
        (b'{"text": "A dog.", "beam": 0}', "beam: Input should be greater than or equal to 1"),
        (b'{"text": "A dog.", "beam": "2"}', "beam: Input should be a valid integer"),
        (b'{"text": "A dog.", "beam": 17}', "beam 17 is over this server's limit of 16"),
        (b'{"text": "A dog.", "nbest": 6}', "nbest 6 needs a beam of at least 6 (the beam is 5)"),
        (b'{"text": "A dog.", "beam": 2, "nbest": 3}', "nbest 3 needs a beam of at least 3 (the beam is 2)"),
    ],
)
def test_a_malformed_request_is_422_with_what_is_wrong(server, body, problem):
    response = httpx.post(server.url + "/v1/translate", content=body, headers=AUTH, timeout=60)
    assert response.status_code == 422 and problem in response.json()["detail"], response.text


def test_malformed_requests_amid_good_ones_harm_none(server, distinct, expected):
    def one(i: int) -> bool:
        if i % 3 == 0:
            bad = httpx.post(server.url + "/v1/translate", content=b'{"text": [1, 2', headers=AUTH, timeout=60)
            return bad.status_code == 422
        texts = [distinct[i % len(distinct)], distinct[(i + 1) % len(distinct)]]
        good = server.post({"text": texts, "beam": 2}, headers=AUTH)
        return good.status_code == 200 and good.json()["translations"] == [expected[2][t] for t in texts]

    with ThreadPoolExecutor(12) as pool:
        assert all(pool.map(one, range(36)))


def test_every_request_but_health_needs_the_api_key(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert server.post({"text": "A dog."}, headers=headers).status_code == 401
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/openapi.json", headers=AUTH).json()["info"]["title"] == "mtkit"


def test_models_names_languages_precision_decode_settings_and_tokenizers(server, trained_run):  # noqa: F811
    info = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert info["mtkit_version"] == mtkit.__version__
    (model,) = info["models"]
    sha256 = Tokenizer(trained_run / "spm.model").sha256
    assert model["languages"] == {"source": "en", "target": "de"}
    assert model["decode"]["beam"] == 5 and model["tokenizers"] == {"source": sha256, "target": sha256}
    assert model["precision"] == choose_precision("auto", "cpu", cpu_features()).to_dict()  # the default
    assert info["limits"] == {"max_texts": 64, "max_chars": 20_000, "max_beam": 16}


def test_each_request_is_one_log_line(server):
    response = server.post({"text": ["A dog.", "A cat."], "beam": 1}, headers=AUTH)
    number = response.headers["X-Request-ID"]
    logged = rf"request {number} POST /v1/translate: 2 sentences, [\d.]+ ms, status 200"
    assert re.search(logged, server.log.read_text())


def test_a_full_queue_is_503_and_a_long_wait_504(trained_run, tmp_path):  # noqa: F811
    """Batches wait 3 s for batch-mates, a request 1 s for its answer: of two requests over the 4-sentence
    queue, the first to come waits (504), the other is refused (503)."""
    slow = Server(trained_run, tmp_path / "stderr", "--max-wait-ms", "3000", "--timeout", "1", "--max-queue", "4")
    try:
        with ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(slow.post, [{"text": ["A dog."] * 4}, {"text": "A cat."}]))
        by_status = {response.status_code: response for response in responses}
        assert sorted(by_status) == [503, 504]
        assert by_status[503].headers["Retry-After"] == "1"
        assert "no translation within 1 s" in by_status[504].json()["detail"]
    finally:
        assert slow.stop(signal.SIGINT) == 0  # Ctrl-C stops it as SIGTERM does


def test_sigterm_under_load_answers_every_accepted_request(trained_run, tmp_path, distinct, expected):  # noqa: F811
    """Three requests waiting for batch-mates and four clients sending batches of four one after another when
    SIGTERM comes: every answer that arrives is right, the waiting three all get one, and the process exits 0."""
    server = Server(trained_run, tmp_path / "stderr", "--max-wait-ms", "3000", "--max-batch-size", "4")
    answers: list[bool] = []
    stop = threading.Event()

    def waiting(i: int) -> bool:
        response = server.post({"text": [distinct[i]], "beam": 2})
        return response.status_code == 200 and response.json()["translations"] == [expected[2][distinct[i]]]

    def repeating(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not stop.is_set():
                try:
                    response = client.post("/v1/translate", json={"text": [distinct[i]]})  # the model's beam, 5
                except httpx.TransportError:  # the server closed the connection before taking the request
                    return
                right = response.status_code == 200 and response.json()["translations"] == [expected[5][distinct[i]]]
                answers.append(right)

    with ThreadPoolExecutor(7) as pool:
        waited = [pool.submit(waiting, i) for i in range(3)]
        server.wait_for_log(r"queued 1 sentences", 3)
        loops = [pool.submit(repeating, i) for i in range(4)]
        time.sleep(1.0)  # full batches of four at beam 5 go by the three still gathering at beam 2
        server.process.send_signal(signal.SIGTERM)
        assert [future.result() for future in waited] == [True] * 3
        assert server.process.wait(timeout=60) == 0
        stop.set()
        for loop in loops:
            loop.result()
    assert len(answers) >= 8 and all(answers)
    with pytest.raises(httpx.ConnectError):
        server.post({"text": "A dog."})


def test_a_ctranslate2_export_is_served_as_the_library_translates_it(trained_run, tmp_path, distinct):  # noqa: F811
    pytest.importorskip("ctranslate2")
    export = tmp_path / "ct2"
    assert invoke("export", trained_run, "-o", export).exit_code == 0
    expected = mtkit.load(export, engine="ctranslate2").translate(distinct, beam=3)
    served = Server(export, tmp_path / "stderr", "--engine", "ctranslate2")
    try:
        response = served.post({"text": distinct, "beam": 3})
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == expected
    finally:
        assert served.stop() == 0


class Scripted(LineTranslator):
    """Upper-cases each line; a line holding "boom" breaks the whole search it is in."""

    decode, nbest = DecodeConfig(beam=2), 1

    def stream(self, chunks):
        for chunk in chunks:
            if any("boom" in line for line in chunk):
                raise RuntimeError("the search broke")
            yield from ([Translation(line.upper(), -1.0, -2.0)] for line in chunk)


@contextlib.contextmanager
def serving_in_this_process(translator: LineTranslator, cfg: ServeConfig):
    """``create_app`` under uvicorn in a thread, on a free port; its URL."""
    sock = serve.bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(serve.create_app(translator, cfg, "scripted"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


def test_each_of_many_concurrent_requests_gets_its_own_texts_answers_in_order():
    def work(worker: int) -> bool:
        with httpx.Client(base_url=url, timeout=60) as client:
            for i in range(4):
                texts = [f"worker {worker} request {i} text {j}" for j in range(1 + (worker + i) % 3)]
                got = client.post("/v1/translate", json={"text": texts}).json()
                if got != {"translations": [text.upper() for text in texts]}:
                    return False
        return True

    with serving_in_this_process(Scripted(), ServeConfig(max_wait_ms=20, max_batch_size=8)) as url:
        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(work, range(16)))


def test_a_request_that_breaks_the_search_is_500_and_harms_none_of_its_batch_mates():
    def one(i: int) -> tuple[int, str]:
        response = httpx.post(url + "/v1/translate", json={"text": ["boom" if i % 3 == 0 else f"line {i}"]})
        return response.status_code, response.json()

    with serving_in_this_process(Scripted(), ServeConfig(max_wait_ms=100)) as url:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, range(12)))
        assert one(1) == (200, {"translations": ["LINE 1"]})  # and the server goes on
    for i, (status, body) in enumerate(answers):
        if i % 3 == 0:
            assert (status, body) == (500, {"detail": "translation failed: RuntimeError: the search broke"})
        else:
            assert (status, body) == (200, {"translations": [f"LINE {i}"]})


def test_without_fastapi_it_says_what_to_install(trained_run, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    result = invoke("serve", trained_run)
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: mtkit serve needs the fastapi package: pip install 'mtkit[serve]'"


@pytest.mark.parametrize(
    "option, message",
    [
        (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
        (["--max-wait-ms", "-1"], "--max-wait-ms must be a finite number >= 0, got -1.0"),
        (["--timeout", "inf"], "--timeout must be a finite number > 0, got inf"),
        (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    ],
)
def test_bad_settings_are_one_line_errors(tmp_path, option, message):
    result = invoke("serve", tmp_path / "no-such-run", *option)
    assert result.exit_code == 1 and result.stderr.strip() == f"error: {message}"


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke("serve", tmp_path / "no-such-run", "--port", port)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_the_listening_socket_sends_small_writes_at_once():
    """uvicorn writes a response's head and body apart; with Nagle's algorithm on, the body waits for the
    client's delayed ACK of the head, 40 ms on Linux, on every response. Accepted sockets inherit TCP_NODELAY."""
    sock = serve.bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


# The batcher on its own: its translate function upper-cases, and fails on "boom".


def shout(lines: list[str], options) -> list[str]:
    if "boom" in lines:
        raise ValueError("boom")
    return [f"{line.upper()}/{options}" for line in lines]


def recording(calls: list):
    def translate(lines: list[str], options) -> list[str]:
        calls.append((list(lines), options))
        return shout(lines, options)

    return translate


def test_jobs_that_come_together_share_a_batch_of_one_options_and_bounded_size():
    calls: list = []
    batcher = Batcher(recording(calls), max_batch_size=4, max_wait_s=0.2, max_queue=100)
    futures = [batcher.submit(lines, options) for lines, options in
               [(["a", "b"], 1), (["c"], 2), (["d", "e"], 1), (["f", "g"], 1), (["h"], 2)]]  # fmt: skip
    batcher.start()
    batcher.close()
    assert [f.result() for f in futures] == [["A/1", "B/1"], ["C/2"], ["D/1", "E/1"], ["F/1", "G/1"], ["H/2"]]
    assert calls == [(["a", "b", "d", "e"], 1), (["c", "h"], 2), (["f", "g"], 1)]


def test_a_failing_job_fails_alone_and_the_worker_goes_on():
    calls: list = []
    batcher = Batcher(recording(calls), max_batch_size=8, max_wait_s=0.2, max_queue=100)
    before, failing, after = (batcher.submit(lines, 1) for lines in (["x"], ["y", "boom"], ["z"]))
    batcher.start()
    with pytest.raises(ValueError, match="boom"):
        failing.result(timeout=5)
    assert before.result(timeout=5) == ["X/1"] and after.result(timeout=5) == ["Z/1"]
    assert calls[0] == (["x", "y", "boom", "z"], 1)  # one batch, which failed; then each job alone
    assert batcher.submit(["w"], 1).result(timeout=5) == ["W/1"]
    batcher.close()


def test_a_full_queue_refuses_and_a_cancelled_job_leaves_it():
    calls: list = []
    batcher = Batcher(recording(calls), max_batch_size=8, max_wait_s=0.2, max_queue=3)
    first = batcher.submit(["a", "b"], 1)
    with pytest.raises(Refused, match="2 sentences are waiting already"):
        batcher.submit(["c", "d"], 1)
    assert first.cancel()
    batcher.start()
    later = batcher.submit(["c", "d"], 1)  # the cancelled job's sentences no longer count
    batcher.close()
    assert later.result() == ["C/1", "D/1"] and calls == [(["c", "d"], 1)]
    with pytest.raises(Refused, match="shutting down"):
        batcher.submit(["e"], 1)


def test_a_full_group_goes_before_an_older_one_still_gathering():
    calls: list = []
    batcher = Batcher(recording(calls), max_batch_size=2, max_wait_s=0.5, max_queue=100)
    batcher.start()
    gathering = batcher.submit(["a"], 1)
    full = batcher.submit(["b", "c"], 2)
    assert full.result(timeout=5) == ["B/2", "C/2"] and not gathering.done()
    assert gathering.result(timeout=5) == ["A/1"]
    batcher.close()
    assert [options for _, options in calls] == [2, 1]


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

    def __len__(self) -> int:
        return len(self.live)


def test_jobs_join_a_running_search_and_leave_it_as_each_is_done():
    steps: list[list[str]] = []
    batcher = Batcher(shout, max_batch_size=3, max_wait_s=0.0, max_queue=100, open_search=lambda _: Countdown(steps))
    long = batcher.submit(["a" * 40], 1)
    batcher.start()
    while not steps:
        time.sleep(0.001)
    short = batcher.submit(["bb", "c"], 1)  # joins the running search: three sentences, the most it holds
    late = batcher.submit(["dd", "ee"], 1)  # waits until both fit
    assert short.result(timeout=5) == ["BB", "C"] and late.result(timeout=5) == ["DD", "EE"]
    assert not long.done() and long.result(timeout=5) == ["A" * 40]
    batcher.close()
    assert len(steps) == 40 and max(map(len, steps)) == 3
    joined = [i for i, lines in enumerate(steps) if "bb" in lines][0]
    a = "a" * 40
    assert steps[joined : joined + 4] == [[a, "bb", "c"], [a, "bb"], [a, "dd", "ee"], [a, "dd", "ee"]]
