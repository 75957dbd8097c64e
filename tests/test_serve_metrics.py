"""`GET /metrics` of `mtkit serve`: Prometheus' text, parsed as a scrape parses it, whose counters move by what the
requests answered came to; behind the API key; each server's own. The application in this process over a scripted
translator with a real SentencePiece model's tokenizers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import AUTH, KEY, ScriptedScorer, serving_in_this_process, stepwise_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

from mtkit.config import ServeConfig
from mtkit.data.tokenizer import Tokenizer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Tokenized(ScriptedScorer):
    """Upper-cases each text, scores each pair by its target's length; tokens counted by ``tok``."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__()
        self.src_tok = self.tgt_tok = tok


def scrape(url: str, headers: dict | None = None) -> Samples:
    """Each sample of the server's metrics by its name and labels."""
    response = httpx.get(url + "/metrics", headers=headers if headers is not None else AUTH, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value (of the model "scripted" unless ``labels`` say another); 0 for a series not seen yet."""
    return samples.get((name, frozenset({"model": "scripted", **labels}.items())), 0.0)


def samples_of(samples: Samples, name: str) -> float:
    """The value of an unlabelled series."""
    return samples[(name, frozenset())]


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
def tokenized(spm_model) -> Tokenized:
    return Tokenized(spm_model)


def test_counters_move_by_the_requests_answered(tokenized, spm_model):
    texts, pairs = ["A dog runs.", "Two men in a boat.", ""], (["a", "b"], ["xy", "xyz"])
    with serving_in_this_process(tokenized, ServeConfig(max_wait_ms=0, api_key=KEY)) as served:
        before = scrape(served.url)
        post = {"headers": AUTH, "timeout": 30}
        assert httpx.post(served.url + "/v1/translate", json={"text": texts}, **post).status_code == 200
        assert httpx.post(served.url + "/v1/score", json={"source": pairs[0], "target": pairs[1]}, **post).is_success
        assert httpx.post(served.url + "/v1/translate", json={"text": 5}, **post).status_code == 422
        assert httpx.get(served.url + "/no/such%0Apath", **post).status_code == 404
        after = scrape(served.url)
    requests = {  # a request that reached no model (unreadable, unknown path, the scrape) counts under model ""
        ("scripted", "/v1/translate", "POST", "200"): 1, ("", "/v1/translate", "POST", "422"): 1,
        ("scripted", "/v1/score", "POST", "200"): 1, ("", "other", "GET", "404"): 1,
        ("", "/metrics", "GET", "200"): 1,  # the first scrape
    }  # fmt: skip
    for (model, route, method, status), count in requests.items():
        labels = {"model": model, "route": route, "method": method, "status": status}
        assert moved(before, after, "mtkit_requests_total", **labels) == count
    routes = {dict(labels).get("route") for _, labels in after} - {None}
    assert routes == {"/v1/translate", "/v1/score", "/metrics", "other"}  # never a raw path
    assert moved(before, after, "mtkit_request_seconds_count", route="/v1/translate") == 1
    assert moved(before, after, "mtkit_request_seconds_count", model="", route="/v1/translate") == 1
    assert moved(before, after, "mtkit_sentences_total", route="/v1/translate") == 3  # the 422's texts are none
    assert moved(before, after, "mtkit_sentences_total", route="/v1/score") == 2
    source = sum(map(len, spm_model.encode(texts)))
    target = sum(map(len, spm_model.encode([text.upper() for text in texts])))
    assert source > 0 and target > 0
    assert moved(before, after, "mtkit_tokens_total", side="source") == source
    assert moved(before, after, "mtkit_tokens_total", side="target") == target
    assert moved(before, after, "mtkit_batch_sentences_count") == 2  # a whole batch of 3 texts, one of 2 pairs
    assert moved(before, after, "mtkit_batch_sentences_sum") == 5
    assert samples_of(after, "mtkit_models_loaded") == 1
    assert value(after, "mtkit_queue_sentences") == 0


def test_the_queue_gauge_counts_the_sentences_in_a_running_search():
    """A line takes a step of 10 ms a character: the short line is done long before the long one."""
    with stepwise_server(ServeConfig(max_wait_ms=0)) as (served, searches):
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, served.url + "/v1/translate", json={"text": ["x" * 300, "yy"]}, timeout=30)
            wait_until(lambda: searches and len(searches[0]) == 1)
            assert value(scrape(served.url, {}), "mtkit_queue_sentences") == 1
            assert answer.result().status_code == 200
        after = scrape(served.url, {})
    assert value(after, "mtkit_queue_sentences") == 0
    assert value(after, "mtkit_batch_sentences_count") == 300  # a step a character of the long line
    assert value(after, "mtkit_batch_sentences_sum") == 2 * 2 + 298  # two lines for two steps, then one


def test_metrics_need_the_api_key_when_one_is_set(tokenized):
    with serving_in_this_process(tokenized, ServeConfig(api_key=KEY)) as served:
        refused = httpx.get(served.url + "/metrics", timeout=10)
        assert refused.status_code == 401 and "mtkit_" not in refused.text
        assert httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert "mtkit_requests_total" in httpx.get(served.url + "/metrics", headers=AUTH).text
        assert httpx.get(served.url + "/health").status_code == 200


def test_two_servers_in_one_process_count_apart(spm_model):
    with (
        serving_in_this_process(Tokenized(spm_model), ServeConfig(max_wait_ms=0)) as first,
        serving_in_this_process(Tokenized(spm_model), ServeConfig(max_wait_ms=0)) as second,
    ):
        for served, texts in ((first, ["a", "b"]), (second, ["c"])):
            assert httpx.post(served.url + "/v1/translate", json={"text": texts}, timeout=30).status_code == 200
        counts = [
            value(scrape(served.url, {}), "mtkit_sentences_total", route="/v1/translate") for served in (first, second)
        ]
    assert counts == [2, 1]
