"""`POST /v1/score` of `mtkit serve`: given translations scored as the library scores them, bounded and refused as
translate requests are, in the batcher's one thread beside concurrent translations. Over HTTP to a server process
on the tiny model `test_cli` trains, and to the application in this process over a scripted translator."""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import AUTH, KEY, ScriptedScorer, Server, serving_in_this_process, wait_until

import mtkit
from mtkit.config import ServeConfig
from mtkit.decoding.line_translator import PairScore


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    """An API key from the environment, batches waiting 20 ms for batch-mates."""
    running = Server(
        trained_run, tmp_path_factory.mktemp("serve") / "stderr", "--max-wait-ms", "20", env={"MTKIT_API_KEY": KEY}
    )
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def library(trained_run):
    return mtkit.load(trained_run, device="cpu")


@pytest.fixture(scope="module")
def pairs(corpus_files) -> list[tuple[str, str]]:
    """Sources with their references, and a source without a target and the reverse."""
    sources = corpus_files["val.en"].read_text().splitlines()[:8]
    targets = corpus_files["val.de"].read_text().splitlines()[:8]
    return [*zip(sources, targets), ("A cat.", ""), ("", "Eine Katze.")]


def score(url: str, body: dict | bytes, headers: dict = AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    json = body if isinstance(body, dict) else None
    return httpx.post(url + "/v1/score", json=json, content=content, headers=headers, timeout=60)


def expected(scores: list[PairScore], tokens: bool) -> dict:
    return {
        "scores": [
            {"logprob": s.logprob, "tokens": s.tokens} | ({"token_logprobs": list(s.token_logprobs)} if tokens else {})
            for s in scores
        ]
    }


@pytest.mark.parametrize("tokens", [False, True])
def test_scores_are_the_librarys_in_order(server, library, pairs, tokens):
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    response = score(server.url, {"source": sources, "target": targets, "tokens": tokens})
    assert response.status_code == 200, response.text
    assert response.json() == expected(list(library.score(sources, targets, tokens=tokens)), tokens)
    assert all(entry["logprob"] < 0 for entry in response.json()["scores"])
    one = score(server.url, {"source": sources[0], "target": targets[0], "tokens": tokens}).json()
    assert one == expected(list(library.score(sources[:1], targets[:1], tokens=tokens)), tokens)
    assert score(server.url, {"source": [], "target": []}).json() == {"scores": []}


def test_concurrent_translations_and_scores_each_get_their_own_answers(server, library, pairs):
    sources = [s for s, _ in pairs]
    translations = dict(zip(sources, library.translate(sources, beam=2)))
    scores = {pair: found.logprob for pair, found in zip(pairs, library.score(sources, [t for _, t in pairs]))}

    def work(i: int) -> bool:
        chosen = [pairs[(i + j) % len(pairs)] for j in range(1 + i % 3)]
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
            if i % 2:
                texts = [source for source, _ in chosen]
                got = client.post("/v1/translate", json={"text": texts, "beam": 2}).json()["translations"]
                return got == [translations[text] for text in texts]
            body = {"source": [s for s, _ in chosen], "target": [t for _, t in chosen]}
            got = [entry["logprob"] for entry in client.post("/v1/score", json=body).json()["scores"]]
            return got == pytest.approx([scores[pair] for pair in chosen], abs=1e-4)  # batch-mates: float rounding

    with ThreadPoolExecutor(12) as pool:
        assert all(pool.map(work, range(48)))


def test_too_much_text_is_413_sources_and_targets_counted_together(server):
    response = score(server.url, {"source": ["A dog."] * 33, "target": ["Ein Hund."] * 33})
    assert response.status_code == 413 and response.json()["detail"].startswith("66 texts;"), response.text
    response = score(server.url, {"source": ["a" * 10_000], "target": ["b" * 10_001]})
    assert response.status_code == 413 and "20,001 characters" in response.json()["detail"]
    huge = score(server.url, b" " * 300_000)
    assert huge.status_code == 413 and "the body is over" in huge.json()["detail"]


@pytest.mark.parametrize(
    "body, problem",
    [
        (b'{"source": "A dog.', "Invalid JSON"),
        (b'{"source": "A dog."}', "target: Field required"),
        (b'{"source": 3, "target": "Ein Hund."}', "source"),
        (b'{"source": "A dog.", "target": "Ein Hund.", "beam": 3}', "beam: Extra inputs are not permitted"),
        (b'{"source": "A dog.", "target": "Ein Hund.", "tokens": 1}', "tokens: Input should be a valid boolean"),
        (b'{"source": ["A dog.", "A cat."], "target": ["Ein Hund."]}', "2 sources but 1 targets"),
        (b'{"source": "A dog.", "target": ["Ein Hund.", "Eine Katze."]}', "1 sources but 2 targets"),
        (b'{"source": "A dog.", "target": "Un chien.", "tgt_lang": "fr"}', "does not translate into 'fr'"),
    ],
)
def test_a_malformed_request_is_422_with_what_is_wrong(server, body, problem):
    response = score(server.url, body)
    assert response.status_code == 422 and problem in response.json()["detail"], response.text


def test_scoring_needs_the_api_key_and_is_in_the_api_docs(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert score(server.url, {"source": "A dog.", "target": "Ein Hund."}, headers).status_code == 401
    api = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    route = api["paths"]["/v1/score"]["post"]
    asked = route["requestBody"]["content"]["application/json"]["schema"]
    assert set(asked["properties"]) == {"source", "target", "tokens", "tgt_lang", "src_lang", "model", "adapter"}
    assert route["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ScoreAnswer")
    assert set(api["components"]["schemas"]["ScoredPair"]["properties"]) == {"logprob", "tokens", "token_logprobs"}


def test_a_score_request_is_one_log_line_with_its_pairs(server):
    response = score(server.url, {"source": ["A dog.", "A cat.", ""], "target": ["Ein Hund.", "", "Eine Katze."]})
    number = response.headers["X-Request-ID"]
    server.wait_for_log(rf"request {number} POST /v1/score: 3 sentences, [\d.]+ ms, status 200\n", 1)
    assert len(re.findall(rf"request {number} ", server.log.read_text())) == 1


def test_a_model_of_several_languages_scores_into_the_language_asked(multilingual_run):
    translator = mtkit.load(multilingual_run, device="cpu")
    sources, targets = ["A dog runs.", ""], ["Ein Hund rennt.", "Un chien."]
    with serving_in_this_process(translator, ServeConfig(max_wait_ms=0)) as served:
        for lang in ("de", "fr"):
            response = score(served.url, {"source": sources, "target": targets, "tgt_lang": lang})
            assert response.json() == expected(list(translator.score(sources, targets, lang)), False)
        for body, problem in [
            ({"source": sources, "target": targets}, "this model translates into de, fr: say which with tgt_lang"),
            ({"source": sources, "target": targets, "tgt_lang": "cs"}, "does not translate into 'cs'"),
        ]:
            response = score(served.url, body)
            assert response.status_code == 422 and problem in response.text, response.text


@pytest.fixture
def mtkit_log(caplog, monkeypatch):
    """caplog with mtkit's debug lines: an earlier command in this process may have set its logger apart."""
    monkeypatch.setattr(logging.getLogger("mtkit"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="mtkit")
    return caplog


def test_scoring_runs_in_the_batchers_thread_and_a_failure_harms_none_of_its_batch_mates(mtkit_log):
    scripted = ScriptedScorer()

    def one(i: int) -> tuple[int, dict, str]:
        if i % 2:
            response = httpx.post(url + "/v1/translate", json={"text": [f"line {i}"]}, timeout=60)
        else:
            target = "boom" if i % 3 == 0 else "x" * i
            response = httpx.post(url + "/v1/score", json={"source": "a", "target": target}, timeout=60)
        return response.status_code, response.json(), response.headers["x-request-id"]

    with serving_in_this_process(scripted, ServeConfig(max_wait_ms=100)) as served:
        url = served.url
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, range(12)))
    for i, (status, body, number) in enumerate(answers):
        if i % 2:
            assert (status, body) == (200, {"translations": [f"LINE {i}"]})
        elif i % 3 == 0:
            detail = f"scoring failed; the server's log has the details of request {number}"
            assert (status, body) == (500, {"detail": detail})
            assert f"request {number}: scoring failed: the scoring broke" in mtkit_log.text
        else:
            assert (status, body) == (200, {"scores": [{"logprob": -1.0 - i, "tokens": i + 1}]})
    assert scripted.threads == {"mtkit-batcher"}  # never beside a search, in another thread


def test_a_score_request_that_times_out_is_504_and_leaves_the_queue():
    scripted = ScriptedScorer()
    with serving_in_this_process(scripted, ServeConfig(max_wait_ms=0, timeout=0.3)) as served:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(score, served.url, {"source": "a", "target": "slow"})
            wait_until(lambda: scripted.threads)  # its batch is being scored
            queued = score(served.url, {"source": "a", "target": "queued"})
            assert queued.status_code == 504
            assert queued.json()["detail"] == "no scores within 0.3 s; the server is busy"
            assert slow.result().status_code == 504  # a whole batch already scoring runs to its end
        wait_until(lambda: scripted.scored)
        assert score(served.url, {"source": "a", "target": "after"}).status_code == 200
    assert scripted.scored == ["slow", "after"]


def test_a_client_that_goes_away_withdraws_its_score_request(mtkit_log):
    scripted = ScriptedScorer()
    with serving_in_this_process(scripted, ServeConfig(max_wait_ms=0)) as served:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(score, served.url, {"source": "a", "target": "slow"})
            wait_until(lambda: scripted.threads)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(served.url + "/v1/score", json={"source": "a", "target": "gone"}, timeout=0.3)
            wait_until(lambda: "status 499" in mtkit_log.text)
            assert slow.result().status_code == 200
    assert scripted.scored == ["slow"]


def test_a_full_queue_is_503_for_scores_and_translations_alike(mtkit_log):
    """Batches of three wait 60 s for batch-mates: two pairs wait in a queue of three, two texts or two pairs more
    are refused (503), and one pair more fills the batch, which runs."""
    cfg = ServeConfig(max_wait_ms=60_000, timeout=120, max_queue=3, max_batch_size=3)
    with serving_in_this_process(ScriptedScorer(), cfg) as served:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(score, served.url, {"source": ["a", "b"], "target": ["x", "y"]})
            wait_until(lambda: "queued 2 sentences" in mtkit_log.text)
            for refused in (
                httpx.post(served.url + "/v1/translate", json={"text": ["c", "d"]}, timeout=60),
                score(served.url, {"source": ["c", "d"], "target": ["z", "w"]}),
            ):
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
                assert refused.json()["detail"] == "2 sentences are waiting already (at most 3)"
            filling = score(served.url, {"source": "c", "target": "zz"})
            assert (filling.status_code, waiting.result().status_code) == (200, 200)
            assert filling.json() == {"scores": [{"logprob": -3.0, "tokens": 3}]}
