"""OpenAI's chat completions API on `mtkit serve`, talked to with OpenAI's own client: the last user message
translated line by line as the library translates it, streamed or not, by the model and into the language the model
string says, with the usage counted by the model's tokenizers; errors in OpenAI's shape, each raising the client's
matching exception, never repeating a long value in full."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import KEY, Server

import mtkit
from mtkit.data.tokenizer import Tokenizer

USER = [{"role": "user", "content": "A dog."}]
LINES = ["A man in a red shirt reads a book.", "", "Two dogs play in the park.", "A cat."]


@pytest.fixture(scope="module")
def server(trained_run, multilingual_run, tmp_path_factory):
    """A server of two models with an API key: "tiny" (en->de) and, after it, "ml" (en->de and en->fr)."""
    log = tmp_path_factory.mktemp("chat") / "stderr"
    models = ("--model", f"tiny={trained_run}", "--model", f"ml={multilingual_run}")
    running = Server(None, log, *models, env={"MTKIT_API_KEY": KEY})
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(trained_run, multilingual_run) -> dict[str, list[str]]:
    """The library's translations of LINES by each model into each of its languages."""
    tiny, ml = mtkit.load(trained_run, device="cpu"), mtkit.load(multilingual_run, device="cpu")
    return {
        "tiny": tiny.translate(LINES),
        "ml:de": ml.translate(LINES, tgt_lang="de"),
        "ml:fr": ml.translate(LINES, tgt_lang="fr"),
    }


def test_the_last_user_message_is_translated_line_by_line_as_the_library_does(client, expected, trained_run):
    messages = [
        {"role": "system", "content": "Translate into French."},  # ignored: the model string says what to do
        {"role": "user", "content": "Not this one."},
        {"role": "assistant", "content": "Nicht dieses."},
        {"role": "user", "content": "\n".join(LINES)},
    ]
    answer = client.chat.completions.create(model="tiny", messages=messages, temperature=0.2, max_tokens=5, seed=1)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == "tiny"
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "stop" and choice.index == 0
    assert choice.message.content == "\n".join(expected["tiny"])
    tok = Tokenizer(trained_run / "spm.model")
    sources, targets = (sum(map(len, tok.encode(lines))) for lines in (LINES, expected["tiny"]))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (sources, targets)
    assert answer.usage.total_tokens == sources + targets
    parts = [{"type": "text", "text": LINES[0]}, {"type": "text", "text": LINES[2]}]
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}])
    assert answer.choices[0].message.content == f"{expected['tiny'][0]}\n{expected['tiny'][2]}"


def test_a_streamed_answer_gives_the_same_text(client, expected):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "\n".join(LINES)}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"} and len({chunk.id for chunk in chunks}) == 1
    deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
    assert deltas[0].role == "assistant"
    assert "".join(delta.content or "" for delta in deltas) == "\n".join(expected["tiny"])
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A cat."}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == expected["tiny"][-1]


@pytest.mark.parametrize(
    ("model", "served", "language"),
    [("ml:de", "ml", "ml:de"), ("ml:fr", "ml", "ml:fr"), ("ml:en:fr", "ml", "ml:fr"), ("en:fr", "ml", "ml:fr")]
    + [("en:de", "tiny", "tiny"), ("tiny:de", "tiny", "tiny"), ("tiny:en:de", "tiny", "tiny")],
)
def test_the_model_string_chooses_the_model_and_the_target(client, expected, model, served, language):
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "\n".join(LINES)}])
    assert answer.model == served and answer.choices[0].message.content == "\n".join(expected[language])


@pytest.mark.parametrize("headers", [{"Authorization": openai.Omit()}, {}])
def test_the_api_key_is_needed(server, headers):
    """Without the Authorization header, or with a wrong key."""
    refused = openai.OpenAI(api_key="wrong", base_url=server.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        refused.chat.completions.create(model="tiny", messages=USER, extra_headers=headers)
    assert raised.value.code == "invalid_api_key" and raised.value.message.endswith("missing or wrong API key")


@pytest.mark.parametrize(
    ("request_", "error", "param", "message"),
    [
        ({"messages": [{"role": "system", "content": "A dog."}]}, openai.BadRequestError, "messages", "there is none"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            openai.BadRequestError, "messages", "a part of type 'image_url'",
        ),
        ({"n": 2}, openai.BadRequestError, "n", "n is 1"),
        ({"logprobs": True}, openai.BadRequestError, "logprobs", "no log-probabilities"),
        ({"response_format": {"type": "json_object"}}, openai.BadRequestError, "response_format", "'json_object'"),
        ({"model": "gpt-4o"}, openai.NotFoundError, "model", "this server has no model 'gpt-4o'"),
        ({"model": "en:cs"}, openai.NotFoundError, "model", "translates en into cs"),
        ({"model": "ml"}, openai.BadRequestError, "model", "say which with tgt_lang"),
        ({"model": "tiny:cs"}, openai.BadRequestError, "model", "does not translate into 'cs'"),
        ({"model": "ml:fr:de"}, openai.BadRequestError, "model", "does not translate 'fr' into de"),
        ({"model": "tiny:a/b"}, openai.BadRequestError, "model", "'a/b' in the model 'tiny:a/b' is no language code"),
    ],
)  # fmt: skip
def test_a_bad_request_raises_the_clients_exception_saying_what_is_wrong(client, request_, error, param, message):
    with pytest.raises(error) as raised:
        client.chat.completions.create(**{"model": "tiny", "messages": USER, **request_})
    assert message in raised.value.message and raised.value.param == param
    assert raised.value.type == "invalid_request_error"
    assert raised.value.code == ("model_not_found" if error is openai.NotFoundError else "invalid_request")


def test_a_long_model_string_is_not_repeated_in_full(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="x" * 10_000, messages=USER)
    assert "(10,000 characters)" in raised.value.message and "x" * 41 not in raised.value.response.text


def test_too_much_text_is_413(client):
    for content in ("a" * 20_001, "\n".join(["A dog."] * 65)):
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
        assert raised.value.status_code == 413 and raised.value.code == "request_too_large"


@pytest.mark.parametrize("body", [b'{"model": "tiny", "messages": [', b"[]", b'{"model": "tiny"}'])
def test_a_malformed_body_is_400_in_openais_shape(server, body):
    answer = httpx.post(
        server.url + "/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error" and answer.json()["error"]["message"]


def test_the_api_documents_the_route(server):
    schema = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    operation = schema["paths"]["/v1/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "messages", "stream"} <= set(body["properties"]) and "$ref" not in str(body)
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert "text/event-stream" in operation["responses"]["200"]["content"] and "404" in operation["responses"]


def test_the_clients_model_list_names_the_served_models(client):
    assert [model.id for model in client.models.list()] == ["tiny", "ml"]
