"""LibreTranslate's API on `mtkit serve` (``POST /translate``, ``GET /languages``), talked to by LibreTranslate's own
clients from PyPI, libretranslatepy and deep-translator, as they talk to LibreTranslate: their answers are the
library's translations, a model of several targets takes the target each request names, the API key is asked for
as LibreTranslate asks (403), and what is wrong with a request is LibreTranslate's ``{"error": ...}``, repeating no
long value. A scripted translator in this process shows what HTML keeps, and the limits' statuses."""

from __future__ import annotations

import html
import time
import urllib.error

import httpx
import pytest
from deep_translator import LibreTranslator
from deep_translator.exceptions import AuthorizationException, ServerException
from libretranslatepy import LibreTranslateAPI
from live_server import KEY, Scripted, Server, serving_in_this_process

import mtkit
from mtkit.config import DataConfig, ServeConfig

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def lines(trilingual_files) -> list[str]:
    return trilingual_files["val.en"].read_text().splitlines()[:4]


@pytest.fixture(scope="module")
def translator(multilingual_run):
    return mtkit.load(multilingual_run, device="cpu")


@pytest.fixture(scope="module")
def expected(translator, lines) -> dict[str, list[str]]:
    """The library's translations of the lines into each of the model's targets."""
    return {target: translator.translate(lines, tgt_lang=target) for target in ("de", "fr")}


@pytest.fixture(scope="module")
def keyed(multilingual_run, tmp_path_factory):
    """`mtkit serve` of the en->de and en->fr model, with an API key."""
    running = Server(multilingual_run, tmp_path_factory.mktemp("libre") / "stderr", env={"MTKIT_API_KEY": KEY})
    yield running
    assert running.stop() == 0


class ScriptedEnDe(Scripted):
    """Upper-cases each line, as a model of en->de; breaks a search of a line holding "boom"."""

    data = DataConfig(src_lang="en", tgt_lang="de")

    def choosing(self, tgt_lang: str | None, src_lang: str | None) -> ScriptedEnDe:
        return self  # its one direction


class Slow(ScriptedEnDe):
    """Takes a second over each search."""

    def stream(self, chunks):
        time.sleep(1)
        yield from super().stream(chunks)


def post(url: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(url + "/translate", json=body, timeout=60, **kwargs)


def test_libretranslates_clients_get_the_librarys_translations(keyed, lines, expected):
    client = LibreTranslateAPI(keyed.url, api_key=KEY)
    assert client.translate(lines[0], source="en", target="de") == expected["de"][0]
    deep = LibreTranslator(source="en", target="fr", api_key=KEY, custom_url=keyed.url + "/")
    assert deep.translate_batch(lines[:2]) == expected["fr"][:2]
    listed = post(keyed.url, {"q": lines, "source": "en", "target": "de", "api_key": KEY})
    assert listed.status_code == 200 and listed.json() == {"translatedText": expected["de"]}, listed.text
    lined = post(keyed.url, {"q": "\r\n".join(lines), "source": "en", "target": "fr"}, headers=AUTH)
    assert lined.json() == {"translatedText": "\n".join(expected["fr"])}  # each line a segment
    assert post(keyed.url, {"q": [], "source": "en", "target": "de"}, headers=AUTH).json() == {"translatedText": []}
    asked = post(keyed.url, {"q": [lines[0]], "source": "en", "target": "de", "alternatives": 3}, headers=AUTH)
    assert asked.json() == {"translatedText": expected["de"][:1], "alternatives": [[]]}


def test_languages_lists_exactly_the_pools_directions(keyed):
    listed = LibreTranslateAPI(keyed.url, api_key=KEY).languages()
    assert listed == [
        {"code": "en", "name": "English", "targets": ["de", "fr"]},
        {"code": "de", "name": "German", "targets": []},
        {"code": "fr", "name": "French", "targets": []},
    ]
    [model] = httpx.get(keyed.url + "/v1/models", headers=AUTH, timeout=10).json()["models"]
    pairs = [(language["code"], target) for language in listed for target in language["targets"]]
    assert pairs == [(pair["source"], pair["target"]) for pair in model["directions"]]


def test_a_target_no_model_translates_into_is_400_naming_it(keyed):
    refused = post(keyed.url, {"q": "A dog.", "source": "en", "target": "es"}, headers=AUTH)
    assert refused.status_code == 400 and "'es'" in refused.json()["error"], refused.text
    with pytest.raises(ServerException):
        LibreTranslator(source="en", target="es", api_key=KEY, custom_url=keyed.url + "/").translate("A dog.")


def test_the_key_is_asked_for_as_libretranslate_asks(keyed):
    with pytest.raises(urllib.error.HTTPError) as refused:
        LibreTranslateAPI(keyed.url).translate("A dog.", source="en", target="de")
    assert refused.value.code == 403
    assert refused.value.read() == b'{"error":"missing or wrong API key"}'
    with pytest.raises(urllib.error.HTTPError, match="403"):
        LibreTranslateAPI(keyed.url, api_key="wrong").languages()
    with pytest.raises(AuthorizationException):
        LibreTranslator(source="en", target="de", api_key="wrong", custom_url=keyed.url + "/").translate("A dog.")
    body = {"q": [], "source": "en", "target": "de"}  # nothing to translate: the key alone is tested
    assert post(keyed.url, body, headers=AUTH).status_code == 200  # the header's key, as the rest of the API takes it
    assert post(keyed.url, body, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert post(keyed.url, {**body, "api_key": KEY}, headers={"Authorization": "Bearer wrong"}).status_code == 200
    in_query = {"q": "A dog.", "source": "en", "target": "de", "api_key": KEY}  # as deep-translator sends them
    assert httpx.post(keyed.url + "/translate", params=in_query, timeout=60).status_code == 200
    for broken in (b'{"q": "A dog.", "api_key": "' + KEY.encode(), b"not json"):  # no key can be read in it
        answer = httpx.post(keyed.url + "/translate", content=broken, headers={"Content-Type": "application/json"})
        assert answer.status_code == 403
    assert httpx.get(keyed.url + "/languages", params={"api_key": KEY}).status_code == 200
    assert httpx.get(keyed.url + "/languages").status_code == 403
    assert httpx.get(keyed.url + "/health").status_code == 200


@pytest.mark.parametrize(
    "content, content_type, problem",
    [
        (b'{"q": "A dog.', "application/json", "Invalid JSON"),
        (b'["A dog."]', "application/json", "Invalid JSON format"),
        (b'{"source": "en", "target": "de"}', "application/json", "q: Field required"),
        (b'{"q": 3, "source": "en", "target": "de"}', "application/json", "q.str: Input should be a valid string"),
        (b'{"q": ["A", 3], "source": "en", "target": "de"}', "application/json", "q.list[str].1"),
        (b'{"q": "A", "source": 1, "target": "de"}', "application/json", "source: Input should be a valid string"),
        (b'{"q": "A", "source": "en", "target": "de", "format": "pdf"}', "application/json", "format: Input should"),
        (b'{"q": "A", "source": "auto", "target": "de"}', "application/json", "detects no language: give source"),
        (b"q=A&q=B&source=en&target=de", "application/x-www-form-urlencoded", "'q' is given twice"),
        (b"q=\xff&source=en&target=de", "application/x-www-form-urlencoded", "a form's body is UTF-8"),
        (b"&".join([b"f=1"] * 65), "application/x-www-form-urlencoded", "more than 64 fields"),
        (b"--b\r\n", "multipart/form-data; boundary=b", "as a form (application/x-www-form-urlencoded)"),
    ],
)
def test_a_malformed_request_is_400_with_what_is_wrong(keyed, content, content_type, problem):
    headers = {**AUTH, "Content-Type": content_type}
    response = httpx.post(keyed.url + "/translate", content=content, headers=headers, timeout=60)
    assert response.status_code == 400 and problem in response.json()["error"], response.text


@pytest.mark.parametrize("field", ["source", "target"])
def test_an_error_repeats_no_long_value_and_no_path_of_the_server(keyed, multilingual_run, field):
    for value in ("x" * 10_000, "../" * 3_000 + "etc/passwd", "/etc/passwd", "es"):
        body = {"q": "A dog.", "source": "en", "target": "de", field: value}
        response = post(keyed.url, body, headers=AUTH)
        error = response.json()["error"]
        assert response.status_code == 400 and len(error) < 300, error
        assert "x" * 41 not in error and "../" * 14 not in error and str(multilingual_run.parent) not in error
    assert "'es'" in error  # a short one is named


def test_too_much_text_is_413(keyed):
    body = {"source": "en", "target": "de", "api_key": KEY}
    assert post(keyed.url, {**body, "q": ["A dog."] * 65}).status_code == 413
    response = post(keyed.url, {**body, "q": "a" * 20_001})
    assert response.status_code == 413 and response.json()["error"].startswith("20,001 characters")
    lined = post(keyed.url, {**body, "q": "\n".join(["A dog."] * 65)})  # each line counts as a text
    assert lined.status_code == 413 and "65 texts" in lined.json()["error"]
    huge = httpx.post(keyed.url + "/translate", content=b"q=" + b"a" * 300_000, headers=AUTH, timeout=60)
    assert huge.status_code == 413 and "the body is over" in huge.json()["error"]


def test_html_keeps_its_markup_and_translates_the_text_between(keyed, translator):
    page = (
        '<!DOCTYPE html>\n<p class="lead">A dog runs.</p>\n<p>A <b title="a &lt; b">man</b> &amp; a woman.</p>'
        '<script>var s = "<b>A cat.</b>";</script><!-- A note. --><img alt="A cat." src="c.png"> <br/>'
    )
    runs = ["A dog runs.", "A", "man", "& a woman."]
    t = [html.escape(text, quote=False) for text in translator.translate(runs, tgt_lang="de")]
    want = (
        f'<!DOCTYPE html>\n<p class="lead">{t[0]}</p>\n<p>{t[1]} <b title="a &lt; b">{t[2]}</b> {t[3]}</p>'
        '<script>var s = "<b>A cat.</b>";</script><!-- A note. --><img alt="A cat." src="c.png"> <br/>'
    )
    response = post(keyed.url, {"q": page, "source": "en", "target": "de", "format": "html"}, headers=AUTH)
    assert response.status_code == 200 and response.json() == {"translatedText": want}, response.text


def test_html_translations_are_escaped_and_tags_kept_byte_for_byte():
    pages = [
        "<P CLASS=x>a dog &amp; a cat</P >\n\n<TD>\n  two\n  lines\n</TD>",
        "x &lt; y <unclosed",
        '<a href="/?q=<b>">link</a><STYLE>p { color: red }</STYLE>&nbsp;<br>',
        '<a "' * 500,
    ]
    with serving_in_this_process(ScriptedEnDe(), ServeConfig()) as served:
        response = post(served.url, {"q": pages, "source": "en", "target": "de", "format": "html"})
        assert response.status_code == 200, response.text
        assert response.json()["translatedText"] == [
            "<P CLASS=x>A DOG &amp; A CAT</P >\n\n<TD>\n  TWO LINES\n</TD>",
            "X &lt; Y &lt;UNCLOSED",
            '<a href="/?q=<b>">LINK</a><STYLE>p { color: red }</STYLE>&nbsp;<br>',
            html.escape('<A "' * 500, quote=False),
        ]
        plain = post(served.url, {"q": "a <b>dog</b>", "source": "en", "target": "de"}).json()
        assert plain == {"translatedText": "A <B>DOG</B>"}  # text is text


def test_a_failed_search_and_a_timeout_keep_their_statuses_in_libretranslates_shape():
    with serving_in_this_process(ScriptedEnDe(), ServeConfig()) as served:
        broken = post(served.url, {"q": "boom", "source": "en", "target": "de"})
        assert broken.status_code == 500 and "log has the details of request" in broken.json()["error"]
    with serving_in_this_process(Slow(), ServeConfig(timeout=0.3)) as served:
        late = post(served.url, {"q": "A dog.", "source": "en", "target": "de"})
        assert late.status_code == 504 and late.json() == {"error": "no translation within 0.3 s; the server is busy"}


def test_the_openapi_document_describes_both_routes():
    with serving_in_this_process(ScriptedEnDe(), ServeConfig()) as served:
        paths = httpx.get(served.url + "/openapi.json", timeout=10).json()["paths"]
    translate, languages = paths["/translate"]["post"], paths["/languages"]["get"]
    body = translate["requestBody"]["content"]
    assert {"application/json", "application/x-www-form-urlencoded"} <= set(body)
    assert {"q", "source", "target", "format", "api_key"} <= set(body["application/json"]["schema"]["properties"])
    assert {"200", "400", "403", "413", "503"} <= set(translate["responses"])
    assert translate["responses"]["200"]["content"]["application/json"]["schema"]
    assert languages["responses"]["200"]["content"]["application/json"]["schema"]
