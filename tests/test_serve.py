"""`mtkit serve` over real HTTP: server processes on the tiny model `test_cli` trains, talked to with httpx;
the application under uvicorn in this process over a scripted translator that can break; and the batcher
on its own, with a translate function written in the test."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
import select
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import invoke, tiny_model
from live_server import (
    AUTH,
    KEY,
    Countdown,
    Scripted,
    Server,
    serving_in_this_process,
    shout,
    stepwise_server,
    wait_until,
)

import mtkit
from mtkit.config import DecodeConfig, ServeConfig
from mtkit.data.tokenizer import Tokenizer
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import Translator
from mtkit.runtime import choose_precision, cpu_features
from mtkit.serving import connections, searches
from mtkit.serving.batcher import Batcher, Refused, Withdrawn


@pytest.fixture(scope="module")
def lines(corpus_files) -> list[str]:
    chosen = corpus_files["val.en"].read_text().splitlines()[:10]
    return [*chosen, "", "A cat."]


@pytest.fixture(scope="module")
def expected(trained_run, lines) -> dict[int, dict[str, str]]:
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
def server(trained_run, tmp_path_factory):
    """The server most tests share: an API key from the environment, batches waiting 20 ms for batch-mates."""
    running = Server(
        trained_run, tmp_path_factory.mktemp("serve") / "stderr", "--max-wait-ms", "20", env={"MTKIT_API_KEY": KEY}
    )
    yield running
    assert running.stop() == 0


def test_translations_are_the_librarys_in_order(server, trained_run, lines, expected):
    response = server.post({"text": lines}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json() == {"translations": [expected[5][line] for line in lines]}
    assert server.post({"text": lines[0], "beam": 2}, headers=AUTH).json() == {"translations": [expected[2][lines[0]]]}
    assert server.post({"text": []}, headers=AUTH).json() == {"translations": []}


def test_whole_batches_translate_as_the_library_does(trained_run, tmp_path, lines, expected):
    whole = Server(trained_run, tmp_path / "stderr", "--no-continuous")
    try:
        assert "whole batches" in whole.log.read_text()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda line: whole.post({"text": [line]}).json(), lines))
        assert answers == [{"translations": [expected[5][line]]} for line in lines]
    finally:
        assert whole.stop() == 0


def test_nbest_and_scores_are_those_the_command_line_prints(server, trained_run, lines):
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


def test_models_names_languages_precision_decode_settings_and_tokenizers(server, trained_run):
    info = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert info["mtkit_version"] == mtkit.__version__
    (model,) = info["models"]
    sha256 = Tokenizer(trained_run / "spm.model").sha256
    assert model["languages"] == {"source": "en", "target": "de"}
    assert model["directions"] == [{"source": "en", "target": "de"}]
    assert model["decode"]["beam"] == 5 and model["tokenizers"] == {"source": sha256, "target": sha256}
    assert model["precision"] == choose_precision("auto", "cpu", cpu_features()).to_dict()  # the default
    assert info["limits"] == {"max_texts": 64, "max_chars": 20_000, "max_beam": 16}
    assert model["batching"] == "continuous" and "continuous" in server.log.read_text()


def test_a_model_of_several_languages_takes_the_target_in_each_request(multilingual_run, tmp_path):
    lines = ["A man in a red shirt reads a book.", "", "Two dogs play in the park."]
    translator = mtkit.load(multilingual_run, device="cpu")
    expected = {lang: translator.translate(lines, tgt_lang=lang) for lang in ("de", "fr")}
    served = Server(multilingual_run, tmp_path / "stderr")
    try:
        [model] = httpx.get(served.url + "/v1/models").json()["models"]
        assert model["directions"] == [{"source": "en", "target": "de"}, {"source": "en", "target": "fr"}]
        assert model["languages"] is None
        with ThreadPoolExecutor(4) as pool:  # both languages in flight at once
            asked = [(lang, line) for line in lines for lang in ("de", "fr")]
            answers = list(pool.map(lambda a: served.post({"text": [a[1]], "tgt_lang": a[0]}).json(), asked))
        assert answers == [{"translations": [expected[lang][lines.index(line)]]} for lang, line in asked]
        refused = [({"text": "A dog."}, "say which with tgt_lang")]
        refused.append(({"text": "A dog.", "tgt_lang": "cs"}, "does not translate into 'cs'"))
        for body, problem in refused:
            response = served.post(body)
            assert response.status_code == 422 and problem in response.text, response.text
    finally:
        assert served.stop() == 0


def test_models_shows_no_path_of_the_server(server, trained_run):
    text = httpx.get(server.url + "/v1/models", headers=AUTH).text
    assert json.loads(text)["models"][0]["name"] == trained_run.name
    assert str(trained_run.parent) not in text and str(trained_run.parent).replace("/", "\\/") not in text


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rotary", "relative", "windowed"])
def test_a_model_of_any_positions_is_searched_continuously(positions, spm_model):
    kind = {"positions": positions} if positions != "windowed" else {"attention_window": 4}
    model = tiny_model(spm_model.vocab_size, **kind)
    translator = Translator(model, spm_model, spm_model, DecodeConfig(beam=2), torch.device("cpu"))
    assert searches.batching(translator, continuous=True) == "continuous"
    assert searches.batching(translator, continuous=False) == "whole batches (--no-continuous)"
    ensemble = Translator(Ensemble([model, model]), spm_model, spm_model, DecodeConfig(beam=2), torch.device("cpu"))
    assert searches.batching(ensemble, continuous=True) == "whole batches (an ensemble)"


def test_alignments_and_json_log_lines(trained_run, tmp_path, lines):
    """A request asks for word alignments: each translation comes with the one `mtkit translate --alignments`
    gives it. With --log-format json, every log line is a JSON object, a request's with its fields."""
    library = mtkit.load(trained_run, device="cpu", alignments=True)
    want = [{"text": best[0].text, "alignment": best[0].alignment} for best in library.hypotheses(lines, beam=2)]
    served = Server(trained_run, tmp_path / "stderr", "--log-format", "json")
    try:
        response = served.post({"text": lines, "beam": 2, "alignments": True})
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == want
        assert any(entry["alignment"] for entry in want)
        refused = served.post({"text": lines, "beam": 2, "nbest": 2, "alignments": True})
        assert refused.status_code == 422 and "best translation only" in refused.text
        number = int(response.headers["X-Request-ID"])
        served.wait_for_log(rf'"request": {number},', 1)
    finally:
        assert served.stop() == 0
    entries = [json.loads(line) for line in served.log.read_text().splitlines()]
    assert {"time", "level", "message"} <= set(entries[0])
    (logged,) = [entry for entry in entries if entry.get("request") == number]
    assert logged["status"] == 200 and logged["sentences"] == len(lines) and logged["path"] == "/v1/translate"


def test_each_request_is_one_log_line(server):
    """The line is written once the answer has gone out, so the client may read the log before it is there."""
    response = server.post({"text": ["A dog.", "A cat."], "beam": 1}, headers=AUTH)
    number = response.headers["X-Request-ID"]
    server.wait_for_log(rf"request {number} POST /v1/translate: 2 sentences, [\d.]+ ms, status 200\n", 1)
    assert len(re.findall(rf"request {number} ", server.log.read_text())) == 1


def memory_kib(pid: int, field: str) -> int:
    """A field of /proc/PID/status, in KiB: VmSize (the address space), VmRSS (resident)."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def answer_to(sock: socket.socket) -> bytes:
    """What the server sends until it closes its side (or resets the connection)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_clients_sending_long_header_lines_do_not_grow_the_server(server):
    """Four clients send 65 kB header lines, up to 100 MiB each, before any API key is checked, to a server
    whose address space may grow by 256 MiB at most (ulimit -v): each is answered 431 as its head passes 16 KiB,
    the server's resident memory grows by less than 32 MiB, and it translates on."""
    assert server.post({"text": "A dog."}, headers=AUTH).status_code == 200  # its threads and arenas exist
    pid = server.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (memory_kib(pid, "VmSize") * 1024 + 256 * 2**20, hard))
    line = b"X-Filler: " + b"a" * 65_000 + b"\r\n"

    def flood(_: int) -> bytes:
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for _ in range(100 * 2**20 // len(line)):
                if select.select([sock], [], [], 0)[0]:  # answered: sending more is pointless
                    break
                try:
                    sock.sendall(line)
                except OSError:
                    break
            return answer_to(sock)

    resident, peak, done = memory_kib(pid, "VmRSS"), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], memory_kib(pid, "VmRSS"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(flood, range(4)))
    finally:
        done.set()
        watcher.join()
        if server.process.poll() is None:
            resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))
    assert all(answer.startswith(b"HTTP/1.1 431 ") for answer in answers), [answer[:100] for answer in answers]
    assert b"is over 16,384 bytes" in answers[0]
    assert peak[0] - resident < 32 * 1024, f"{(peak[0] - resident) / 1024:.0f} MiB more resident"
    assert server.post({"text": "A dog."}, headers=AUTH).status_code == 200


def test_a_full_queue_is_503_until_its_batch_runs(trained_run, tmp_path):
    """Batches of five wait 60 s for batch-mates, a request 120 s for its answer: a request of four sentences
    waits in a queue of five, one of two more is refused (503), and one of one more fills the batch, which runs."""
    options = ["--max-wait-ms", "60000", "--timeout", "120", "--max-queue", "5", "--max-batch-size", "5"]
    slow = Server(trained_run, tmp_path / "stderr", *options)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(slow.post, {"text": ["A dog."] * 4})
            slow.wait_for_log(r"queued 4 sentences", 1)
            refused = slow.post({"text": ["A cat.", "A cat."]})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["detail"] == "4 sentences are waiting already (at most 5)"
            filling = slow.post({"text": "A cat."})
            assert (filling.status_code, waiting.result().status_code) == (200, 200)
    finally:
        assert slow.stop(signal.SIGINT) == 0  # Ctrl-C stops it as SIGTERM does


def test_sigterm_under_load_answers_every_accepted_request(trained_run, tmp_path, distinct, expected):
    """Three requests waiting for batch-mates and four clients sending batches of four one after another when
    SIGTERM comes: every answer that arrives is right, the waiting three all get one, the process exits 0, and
    every request the server took (logged it) reached its client: none was lost mid-response."""
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
                except httpx.TransportError:  # refused, or lost: the count of the server's log lines tells
                    return
                right = response.status_code == 200 and response.json()["translations"] == [expected[5][distinct[i]]]
                answers.append(right)

    with ThreadPoolExecutor(7) as pool:
        waited = [pool.submit(waiting, i) for i in range(3)]
        server.wait_for_log(r"queued 1 sentences", 3)
        loops = [pool.submit(repeating, i) for i in range(4)]
        wait_until(lambda: len(answers) >= 8, 60)  # full batches of four at beam 5 go by the three gathering
        server.process.send_signal(signal.SIGTERM)
        assert [future.result() for future in waited] == [True] * 3
        assert server.process.wait(timeout=60) == 0
        stop.set()
        for loop in loops:
            loop.result()
    assert all(answers)
    taken = len(re.findall(r"POST /v1/translate: \d+ sentences, [\d.]+ ms, status \d+", server.log.read_text()))
    assert taken == len(answers) + 3
    with pytest.raises(httpx.ConnectError):
        server.post({"text": "A dog."})


def test_int8_is_served_as_the_library_translates_in_int8(trained_run, tmp_path, distinct):
    expected = mtkit.load(trained_run, device="cpu", precision="int8").translate(distinct)
    served = Server(trained_run, tmp_path / "stderr", "--precision", "int8")
    try:
        [model] = httpx.get(served.url + "/v1/models").json()["models"]
        assert model["precision"]["precision"] == "int8"
        with ThreadPoolExecutor(4) as pool:  # concurrent requests join and leave one continuous search
            answers = list(pool.map(lambda line: served.post({"text": [line]}).json(), distinct))
        assert answers == [{"translations": [line]} for line in expected]
    finally:
        assert served.stop() == 0


def test_a_ctranslate2_export_is_served_as_the_library_translates_it(trained_run, tmp_path, distinct):
    pytest.importorskip("ctranslate2")
    export = tmp_path / "ct2"
    assert invoke("export", trained_run, "-o", export).exit_code == 0
    expected = mtkit.load(export, device="cpu", engine="ctranslate2").translate(distinct, beam=3)
    served = Server(export, tmp_path / "stderr", "--engine", "ctranslate2")
    try:
        response = served.post({"text": distinct, "beam": 3})
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == expected
        batching = "whole batches (the ctranslate2 engine batches its own searches)"
        assert httpx.get(served.url + "/v1/models").json()["models"][0]["batching"] == batching
        assert batching in served.log.read_text()
        refused = served.post({"text": distinct, "alignments": True})
        assert refused.status_code == 422 and "no word alignments" in refused.text
    finally:
        assert served.stop() == 0


def test_each_of_many_concurrent_requests_gets_its_own_texts_answers_in_order():
    def work(worker: int) -> bool:
        with httpx.Client(base_url=url, timeout=60) as client:
            for i in range(4):
                texts = [f"worker {worker} request {i} text {j}" for j in range(1 + (worker + i) % 3)]
                got = client.post("/v1/translate", json={"text": texts}).json()
                if got != {"translations": [text.upper() for text in texts]}:
                    return False
        return True

    with serving_in_this_process(Scripted(), ServeConfig(max_wait_ms=20, max_batch_size=8)) as served:
        url = served.url
        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(work, range(16)))


@pytest.fixture
def mtkit_log(caplog, monkeypatch):
    """caplog with mtkit's info lines: an earlier command in this process may have set its logger apart."""
    monkeypatch.setattr(logging.getLogger("mtkit"), "propagate", True)
    caplog.set_level(logging.INFO, logger="mtkit")
    return caplog


def test_a_request_that_breaks_the_search_is_500_and_harms_none_of_its_batch_mates(mtkit_log):
    """The client of a failed request learns its number, not the exception; the log has the exception under it."""

    def one(i: int) -> tuple[int, dict, str]:
        response = httpx.post(url + "/v1/translate", json={"text": ["boom" if i % 3 == 0 else f"line {i}"]})
        return response.status_code, response.json(), response.headers["x-request-id"]

    with serving_in_this_process(Scripted(), ServeConfig(max_wait_ms=100)) as served:
        url = served.url
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, range(12)))
        assert one(1)[:2] == (200, {"translations": ["LINE 1"]})  # and the server goes on
    for i, (status, body, number) in enumerate(answers):
        if i % 3 == 0:
            detail = f"translation failed; the server's log has the details of request {number}"
            assert (status, body) == (500, {"detail": detail})
            assert f"request {number}: translation failed: the search broke" in mtkit_log.text
        else:
            assert (status, body) == (200, {"translations": [f"LINE {i}"]})


def test_without_fastapi_it_says_what_to_install(trained_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    result = invoke("serve", trained_run)
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == "error: mtkit serve needs the fastapi package: pip install -e '.[serve]' in mtkit's clone"
    )


def test_without_httptools_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "httptools", None)  # the parser the server's HTTP protocol is built on
    result = invoke("serve", tmp_path / "no-such-run")
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == "error: mtkit serve needs the httptools package: pip install -e '.[serve]' in mtkit's clone"
    )


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
    sock = connections.bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


# The batcher on its own: its translate function upper-cases, and fails on "boom".


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


def test_a_withdrawn_job_leaves_its_running_search_and_its_search_mates_go_on():
    steps: list[list[str]] = []
    batcher = Batcher(shout, max_batch_size=8, max_wait_s=0.0, max_queue=100, open_search=lambda _: Countdown(steps))
    batcher.start()
    stays, leaves = batcher.submit(["a" * 30], 1), batcher.submit(["b" * 300, "c"], 1)
    while len(steps) < 5:
        time.sleep(0.001)
    batcher.withdraw(leaves)  # mid-search: its "c" is done already, its long line is not
    with pytest.raises(Withdrawn):
        leaves.result(timeout=5)
    assert stays.result(timeout=5) == ["A" * 30]
    assert all("b" * 300 not in seen for seen in steps[-3:])  # stepped no further once withdrawn
    queued = batcher.submit(["d" * 300], 2)  # a search of other options
    batcher.withdraw(queued)
    assert queued.cancelled() or isinstance(queued.exception(timeout=5), Withdrawn)
    batcher.close()
    assert len(steps) < 100  # the search of the withdrawn 300-step lines did not run on


# Bounds the server keeps against slow, greedy or vanishing clients, on the application in this process.


def raw_request(port: int, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head + body)
    return sock


def head(length: int) -> bytes:
    return (
        f"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_request_that_times_out_is_504_and_leaves_its_search():
    with stepwise_server(ServeConfig(timeout=0.3, max_wait_ms=0)) as (served, searches):
        response = httpx.post(served.url + "/v1/translate", json={"text": ["x" * 3000]}, timeout=10)
        assert response.status_code == 504
        assert response.json()["detail"] == "no translation within 0.3 s; the server is busy"
        wait_until(lambda: len(searches[0]) == 0)  # long before its 30 s of steps


def test_a_client_that_goes_away_withdraws_its_request_and_is_one_log_line(mtkit_log):
    caplog = mtkit_log
    with stepwise_server(ServeConfig(max_wait_ms=0)) as (served, searches):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/translate", json={"text": ["x" * 3000]}, timeout=0.3)
        wait_until(lambda: "status 499" in caplog.text)
        wait_until(lambda: len(searches[0]) == 0)  # at the search's next steps, long before its 30 s
        sock = raw_request(served.port, head(100), b'{"text": ')  # gone mid-body
        sock.close()
        wait_until(lambda: caplog.text.count("status 499") == 2)
    assert "Traceback" not in caplog.text and "Exception" not in caplog.text


def test_a_body_over_the_limit_is_413_before_it_is_read():
    with stepwise_server(ServeConfig(max_wait_ms=0)) as (served, _):
        with raw_request(served.port, head(10**12), b'{"text": "a"}') as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_slow_headers_close_the_connection_and_a_slow_body_is_408():
    with stepwise_server(ServeConfig(max_wait_ms=0, receive_timeout=0.5)) as (served, _):
        start = time.monotonic()
        with raw_request(served.port, b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\n") as sock:
            for _ in range(100):  # a header byte every 0.1 s, as a slowloris client sends them, for 10 s
                try:
                    sock.sendall(b"X")
                    time.sleep(0.1)
                except OSError:
                    break
            assert sock.recv(4096) == b""
        assert time.monotonic() - start < 5  # closed at 0.5 s, however slowly this machine runs
        with raw_request(served.port, head(40), b'{"text": ') as sock:
            for _ in range(10):
                time.sleep(0.1)
                sock.sendall(b" ")
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")


def test_a_request_head_over_its_bounds_is_431_before_the_api_key_and_the_server_goes_on(mtkit_log):
    """A head of over 16 KiB or 100 fields is answered 431, whatever the client sends after it; an 8 MB header
    line too, and an oversized head sent right behind a request, which is answered first. The connection's next
    request and the server's next connection are served."""
    request_line = b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    body = b'{"text": "a"}'
    fields = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    oversized = [
        (b"X-Filler: " + b"a" * 20_000 + b"\r\n", b"is over 16,384 bytes"),
        (b"X-Filler: " + b"a" * 8_000_000 + b"\r\n", b"is over 16,384 bytes"),
        (b"".join(b"X-Field-%d: 1\r\n" % i for i in range(100)), b"has over 100 fields"),
    ]
    with stepwise_server(ServeConfig(max_wait_ms=0, api_key=KEY)) as (served, _):
        for extra, why in oversized:
            with raw_request(served.port, request_line + extra + fields) as sock:
                answer = answer_to(sock)
            assert answer.startswith(b"HTTP/1.1 431 ") and why in answer, answer[:300]
        within = b"".join(b"X-Field-%d: 1\r\n" % i for i in range(95)) + b"Authorization: Bearer %s\r\n" % KEY.encode()
        twice = request_line + within + fields + request_line + within + b"Connection: close\r\n" + fields
        with raw_request(served.port, twice) as sock:  # 100 fields each, on one connection
            assert answer_to(sock).count(b"HTTP/1.1 200 OK") == 2
        auth = b"Authorization: Bearer %s\r\n" % KEY.encode()
        behind = request_line + auth + fields + request_line + auth + oversized[0][0] + fields
        with raw_request(served.port, behind) as sock:  # in one send: the request before it is no cover
            answer = answer_to(sock)
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.count(b"HTTP/1.1 ") == 2, answer[:600]
        assert b"HTTP/1.1 431 " in answer and b"is over 16,384 bytes" in answer, answer[:600]
        assert httpx.post(served.url + "/v1/translate", json={"text": "b"}, headers=AUTH).json() == {
            "translations": ["B"]
        }
    assert mtkit_log.text.count("a request refused (431)") == 4


def test_a_trailer_field_that_runs_on_ends_its_connection(mtkit_log):
    """After a chunked body come trailer fields, which httptools holds as it holds headers: one that runs on
    past what a request can take ends the connection at once, long before the receive timeout's 408."""
    chunked = b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    with stepwise_server(ServeConfig(max_wait_ms=0, receive_timeout=5)) as (served, _):
        start = time.monotonic()
        with raw_request(served.port, chunked + b'd\r\n{"text": "a"}\r\n0\r\nX-Trailer: ') as sock:
            with contextlib.suppress(OSError):  # the server closes while this is sent
                sock.sendall(b"a" * 2_000_000)
            assert answer_to(sock) == b""
        assert time.monotonic() - start < 5
        wait_until(lambda: "status 499" in mtkit_log.text)
    assert "a connection closed: its request's body and trailer fields are over" in mtkit_log.text


def test_the_log_escapes_what_a_request_path_holds(mtkit_log):
    """A decoded %0A in the path would start a forged log line, a %1B an escape sequence of the terminal that
    shows the log: the log line holds them escaped, as the JSON log's fields do."""
    with stepwise_server(ServeConfig(max_wait_ms=0)) as (served, _):
        path = b"/v1/%0Arequest%209%20POST%20/v1/translate%1B[2K%E2%80%AE%5C"
        with raw_request(served.port, b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % path) as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 404")
        wait_until(lambda: "status 404" in mtkit_log.text)
    (record,) = [record for record in mtkit_log.records if "status 404" in record.getMessage()]
    escaped = r"/v1/\nrequest 9 POST /v1/translate\x1b[2K\u202e\\"
    assert record.getMessage().startswith(f"request 1 GET {escaped}: 0 sentences")
    assert record.fields["path"] == escaped
    assert all(c.isprintable() for c in record.getMessage())


def test_a_422_repeats_only_the_start_of_a_long_value():
    with stepwise_server(ServeConfig(max_wait_ms=0)) as (served, _):
        refused = [
            ({"text": "a", "tgt_lang": "x" * 100_000}, f"does not translate into {'x' * 40!r}... (100,000 characters)"),
            ({"text": "a", "y" * 100_000: 1}, f"{'y' * 40}... (100,000 characters): Extra inputs are not permitted"),
        ]
        for body, problem in refused:
            response = httpx.post(served.url + "/v1/translate", json=body, timeout=10)
            assert response.status_code == 422 and problem in response.json()["detail"], response.text[:300]
            assert len(response.content) < 500


def test_connections_beyond_the_limit_are_503():
    with stepwise_server(ServeConfig(max_wait_ms=0, max_connections=3)) as (served, _):
        held = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(3)]
        try:
            with socket.create_connection(("127.0.0.1", served.port), timeout=10) as extra:
                assert extra.recv(4096).startswith(b"HTTP/1.1 503")
            held.pop().close()
            wait_until(lambda: len(served.server.server_state.connections) < 3)
            assert httpx.post(served.url + "/v1/translate", json={"text": "a"}).json() == {"translations": ["A"]}
        finally:
            for sock in held:
                sock.close()


def test_shutdown_waits_for_trickling_clients_no_longer_than_its_bound():
    cfg = ServeConfig(max_wait_ms=0, receive_timeout=0.5, timeout=1.0)
    with stepwise_server(cfg) as (served, _):
        trickling = [raw_request(served.port, head(1000), b"{") for _ in range(5)]
        start = time.monotonic()
        served.server.should_exit = True
        served.thread.join(timeout=10)
        assert not served.thread.is_alive() and time.monotonic() - start < 4
        for sock in trickling:
            sock.close()


def test_a_stop_that_cuts_requests_off_is_counted():
    with stepwise_server(ServeConfig(max_wait_ms=0)) as (served, searches):
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, served.url + "/v1/translate", json={"text": ["x" * 300]}, timeout=10)
            wait_until(lambda: searches and len(searches[0]) == 1)
            served.server.should_exit = served.server.force_exit = True  # a second signal
            served.thread.join(timeout=10)
            with contextlib.suppress(httpx.TransportError):  # or uvicorn answers 500 for the cancelled request
                assert pending.result().status_code == 500
        assert served.app.state.tally.cut_off == 1
