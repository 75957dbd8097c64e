"""`mtkit serve` of a model told its languages by tokens (an imported M2M100): requests name src_lang beside tgt_lang,
checked against the model's languages (a 422 naming the field where one is missing or unknown), /v1/models lists the
languages, and the answers are what `mtkit translate` and `mtkit score` give with the same languages, on either
engine."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import m2m100_fixture as fx
import pytest
import torch
from helpers import joint_run
from live_server import serving_in_this_process

import mtkit
from mtkit.config import ServeConfig
from mtkit.interop.ct2_export import export_ctranslate2
from mtkit.interop.hf_import import import_hf
from mtkit.translation.engines import load_translator

with pytest.MonkeyPatch.context() as env:
    env.setenv("OMP_WAIT_POLICY", "PASSIVE")  # CTranslate2's OpenMP (tests/test_export.py)
    env.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")

LINES = [line for line in fx.LINES["en"] if len(line) < 70][:8]  # within the tiny model's 64 positions
TARGETS = fx.LINES["fr"][:8]
SERVE = ServeConfig()


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> dict[str, Path]:
    """An M2M100 folder (its language tokens' rows shrunk, which it would otherwise repeat) imported twice: with no
    default direction, and with en->de; the first exported for CTranslate2 too."""
    root = tmp_path_factory.mktemp("m2m100")
    folder = fx.m2m100_folder(root, seed=4, init_std=0.4)
    with torch.no_grad():
        folder.hf.model.shared.weight[[folder.tokenizer.get_lang_id(c) for c in folder.languages]] *= 0.1
    folder.hf.save_pretrained(folder.path)
    import_hf(str(folder.path), root / "any")
    import_hf(str(folder.path), root / "en-de", src_lang="en", tgt_lang="de")
    export_ctranslate2(root / "any", root / "ct2")
    return {"any": root / "any", "en-de": root / "en-de", "ct2": root / "ct2"}


@contextlib.contextmanager
def serving(model: Path, cfg: ServeConfig, **load):
    """The application as `mtkit serve MODEL` sets it up, under uvicorn in a thread; its URL."""
    translator = load_translator(model, device="cpu", **load)
    with serving_in_this_process(translator, cfg, name="model") as running:
        yield running.url


@pytest.fixture(scope="module")
def any_direction(imports):
    with serving(imports["any"], SERVE, precision="fp32") as url:
        yield url


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)


def test_translations_are_mtkit_translates_with_the_same_languages(any_direction, imports):
    """Concurrent requests into three languages from two, each answered as `mtkit translate --src-lang X --tgt-lang
    Y` translates (the batcher never searches two directions together)."""
    translator = mtkit.load(imports["any"], precision="fp32")
    pairs = [("en", "fr"), ("en", "de"), ("de", "fr"), ("en", "es")]
    bodies = [{"text": LINES, "src_lang": src, "tgt_lang": tgt} for src, tgt in pairs]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: post(any_direction, "translate", body), bodies))
    expected = [translator.translate(LINES, tgt_lang=tgt, src_lang=src) for src, tgt in pairs]
    assert [answer.json()["translations"] for answer in answers] == expected
    assert len({tuple(texts) for texts in expected}) == len(pairs)  # each language chosen matters


def test_scores_are_mtkit_scores_with_the_same_languages(any_direction, imports):
    translator = mtkit.load(imports["any"], precision="fp32")
    body = {"source": LINES, "target": TARGETS, "src_lang": "en", "tgt_lang": "fr", "tokens": True}
    answer = post(any_direction, "score", body)
    assert answer.status_code == 200, answer.text
    for got, want in zip(answer.json()["scores"], translator.score(LINES, TARGETS, "fr", True, "en")):
        assert got["tokens"] == want.tokens
        assert got["logprob"] == pytest.approx(want.logprob, abs=1e-5)
        assert got["token_logprobs"] == pytest.approx(list(want.token_logprobs), abs=1e-5)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tgt_lang": "fr"}, "this model translates between 100 languages: say which with src_lang"),
        ({"src_lang": "en"}, "this model translates between 100 languages: say which with tgt_lang"),
        ({"src_lang": "en", "tgt_lang": "xx"}, "'xx' is not one of this model's 100 languages (tgt_lang:"),
        ({"src_lang": "eng_Latn", "tgt_lang": "fr"}, "'eng_Latn' is not one of this model's 100 languages (src_lang"),
        ({"src_lang": 3, "tgt_lang": "fr"}, "src_lang: Input should be a valid string"),
    ],
)
def test_a_missing_or_unknown_language_is_a_422_naming_the_field(any_direction, body, message):
    for route, request in (("translate", {"text": "A dog."}), ("score", {"source": "A dog.", "target": "Un chien."})):
        answer = post(any_direction, route, {**request, **body})
        assert answer.status_code == 422 and message in answer.json()["detail"], answer.text
        assert "Traceback" not in answer.text


def test_models_lists_the_languages(any_direction, imports):
    model = httpx.get(f"{any_direction}/v1/models").json()["models"][0]
    assert model["between"] == list(mtkit.load(imports["any"]).data.languages) and len(model["between"]) == 100
    assert model["languages"] is None and model["directions"] == []
    with serving(imports["en-de"], SERVE, precision="fp32") as url:
        model = httpx.get(f"{url}/v1/models").json()["models"][0]
        assert model["languages"] == {"source": "en", "target": "de"}
        assert model["directions"] == [{"source": "en", "target": "de"}]
        translator = mtkit.load(imports["en-de"], precision="fp32")
        answer = post(url, "translate", {"text": LINES})  # the default direction
        assert answer.json()["translations"] == translator.translate(LINES)
        answer = post(url, "translate", {"text": LINES, "src_lang": "fr"})  # its default target
        assert answer.json()["translations"] == translator.translate(LINES, tgt_lang="de", src_lang="fr")


def test_the_ctranslate2_engine_serves_the_languages_too(imports):
    translator = mtkit.load(imports["ct2"], engine="ctranslate2")
    with serving(imports["ct2"], SERVE, engine="ctranslate2") as url:
        answer = post(url, "translate", {"text": LINES, "src_lang": "en", "tgt_lang": "fr", "scores": True})
        expected = [t[0] for t in translator.hypotheses(LINES, tgt_lang="fr", src_lang="en")]
        assert [(t["text"], t["logprob"]) for t in answer.json()["translations"]] == [
            (t.text, pytest.approx(t.logprob, abs=1e-5)) for t in expected
        ]
        answer = post(url, "translate", {"text": LINES, "tgt_lang": "fr"})
        assert answer.status_code == 422 and "say which with src_lang" in answer.json()["detail"]


def test_a_model_of_directions_checks_the_source_language(tmp_path, spm_model):
    """Other models take src_lang too, checked against their directions."""
    run = joint_run(tmp_path, spm_model, seed=1)
    with serving(run, SERVE, precision="fp32") as url:
        model = httpx.get(f"{url}/v1/models").json()["models"][0]
        assert model["between"] == []
        ((source, target),) = [(d["source"], d["target"]) for d in model["directions"]]
        assert post(url, "translate", {"text": "A dog.", "src_lang": source}).status_code == 200
        answer = post(url, "translate", {"text": "A dog.", "src_lang": "fr"})
        assert answer.status_code == 422
        assert f"this model does not translate 'fr' into {target}; src_lang is one of {source}" in answer.text
