"""The API's documentation for people, on a `mtkit serve` process with an API key: /openapi.json and /docs need no
key and load nothing from outside the server, every operation documents its answer and the key, the answers are what
the documentation says; and Swagger UI in a real headless Chromium (Debian's, driven by Playwright) translates once
the key is entered in its Authorize dialog, and shows 401 while it is not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import joint_run
from live_server import AUTH, KEY, Server
from playwright.sync_api import Browser, Page, sync_playwright

import mtkit
from mtkit.serving.answers import ModelInfo, ModelsAnswer, TranslateAnswer
from mtkit.serving.openapi import ASSETS, SECURITY_SCHEME

CHROMIUM = Path("/usr/bin/chromium")  # Debian's: Playwright never downloads a browser of its own here
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TEXTS = ["A dog runs in the park.", "Two men play music."]
DESCRIBING = {"$ref", "type", "properties", "anyOf", "oneOf", "allOf", "items", "enum", "const"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, spm_model) -> Path:
    """A hand-built model whose translations end soon: quick to make, and to serve."""
    return joint_run(tmp_path_factory.mktemp("docs"), spm_model, seed=3, ending=True)


@pytest.fixture(scope="module")
def server(run, tmp_path_factory) -> Iterator[Server]:
    """The model served with a key, in fp32 (which the library's translations are in too) on one thread."""
    log = tmp_path_factory.mktemp("serve-docs") / "stderr"
    running = Server(run, log, "--precision", "fp32", "--threads", "1", env={"MTKIT_API_KEY": KEY})
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def schema(server) -> dict:
    response = httpx.get(server.url + "/openapi.json", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip("needs Chromium (/usr/bin/chromium)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield chromium
        chromium.close()


def test_the_documentation_needs_no_key_and_names_nothing_outside_the_server(server):
    for path in ["/docs", "/docs/oauth2-redirect", "/openapi.json", *ASSETS]:
        response = httpx.get(server.url + path, timeout=30)
        assert response.status_code == 200, (path, response.text[:200])
    page = httpx.get(server.url + "/docs", timeout=30).text
    assert "http://" not in page and "https://" not in page
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401  # the API itself keeps its key


def test_every_operation_documents_its_answer_and_the_key(schema):
    operations = {(path, method): op for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert {("/v1/translate", "post"), ("/v1/models", "get"), ("/health", "get")} <= set(operations)
    scheme = schema["components"]["securitySchemes"][SECURITY_SCHEME]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for (path, method), operation in operations.items():
        answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert DESCRIBING & set(answer), f"{method.upper()} {path}: its answer is not documented"
        if path == "/health":
            assert "security" not in operation and "401" not in operation["responses"]
        else:
            assert operation["security"] == [{SECURITY_SCHEME: []}], path
            assert {"401", "403"} & set(operation["responses"]), path
    translate = operations["/v1/translate", "post"]["responses"]
    assert {"200", "401", "408", "413", "422", "500", "503", "504"} <= set(translate)
    assert translate["503"]["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    error = translate["413"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert schema["components"]["schemas"][error]["required"] == ["detail"]
    for (path, method), model in [
        (("/v1/translate", "post"), "TranslateAnswer"),
        (("/v1/models", "get"), "ModelsAnswer"),
        (("/health", "get"), "HealthAnswer"),
    ]:
        answer = operations[path, method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer == {"$ref": f"#/components/schemas/{model}"}


def test_the_answers_are_what_the_documentation_says(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        for body in ({"text": TEXTS}, {"text": TEXTS, "scores": True}, {"text": TEXTS[0], "beam": 2, "nbest": 2}):
            response = client.post("/v1/translate", json=body)
            assert response.status_code == 200, response.text
            TranslateAnswer.model_validate(response.json())
        models = client.get("/v1/models").json()
    ModelsAnswer.model_validate(models)
    assert set(models) == set(ModelsAnswer.model_fields)
    assert [set(model) for model in models["models"]] == [set(ModelInfo.model_fields)]


def translated_in_the_page(page: Page, url: str, key: str | None) -> tuple[str, str]:
    """What Swagger UI at /docs shows for POST /v1/translate of ``TEXTS``, tried out with ``key`` entered in its
    Authorize dialog (None: no key): the status and the body of the answer."""
    page.goto(url + "/docs")
    if key is not None:
        page.locator(".auth-wrapper .authorize").click()
        page.get_by_label("auth-bearer-value").fill(key)
        page.get_by_role("button", name="Apply credentials").click()
        page.get_by_role("button", name="Close").click()
    operation = page.locator(".opblock-post").filter(has=page.locator('[data-path="/v1/translate"]'))
    operation.locator(".opblock-summary-control").click()
    operation.get_by_role("button", name="Try it out").click()
    operation.locator("textarea.body-param__text").fill(json.dumps({"text": TEXTS}))
    operation.get_by_role("button", name="Execute").click()
    shown = operation.locator(".live-responses-table .response")
    return shown.locator(".response-col_status").inner_text(), shown.locator(
        ".response-col_description pre"
    ).first.inner_text()


def test_swagger_ui_translates_with_the_key_entered_in_its_authorize_dialog(server, browser, run):
    page = browser.new_context().new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    status, body = translated_in_the_page(page, server.url, KEY)
    assert status == "200", body
    assert json.loads(body) == {"translations": mtkit.load(run, device="cpu", precision="fp32").translate(TEXTS)}
    assert requested and all(url.startswith(server.url + "/") for url in requested), requested  # no CDN


def test_swagger_ui_without_the_key_shows_401(server, browser):
    page = browser.new_context().new_page()
    status, body = translated_in_the_page(page, server.url, None)
    assert status == "401"
    assert json.loads(body) == {"detail": "missing or wrong API key"}
