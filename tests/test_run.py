"""`mtkit run`: a tiny recipe end to end on a Multi30k mirror (of captions, tests/captions.py), then again with
nothing to redo, and again after changing what the average or the translation depends on."""

from __future__ import annotations

import hashlib
import json
import shutil

import captions
import pytest
import yaml
from helpers import TINY_MODEL, invoke


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    """Multi30k En-De with a 1+1-layer model, 6 updates, greedy 4-token outputs: about a minute. On the CPU, also on a
    machine with CUDA (where device auto would train on the GPU), so that what the tests see is the same everywhere."""
    path = tmp_path_factory.mktemp("recipe") / "tiny_m30k.yaml"
    raw = {
        "data": {"src_lang": "en", "tgt_lang": "de"},
        "tokenizer": {"vocab_size": 300},
        "model": dict(TINY_MODEL),
        "train": {
            "max_steps": 6,
            "batch_tokens": 1024,
            "warmup": 2,
            "lr": 3e-3,
            "valid_every": 3,
            "save_every": 3,
            "log_every": 3,
            "device": "cpu",
        },
        "decode": {"beam": 1, "max_len_a": 0.0, "max_len_b": 4},
        "recipe": {"corpus": "multi30k_en_de", "average_last": 2, "bleu_max": 5.0, "expected": "a tiny test model"},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def first_run(tiny_recipe, tmp_path_factory, multi30k_mirror):
    out = tmp_path_factory.mktemp("run") / "tiny"
    result = invoke("run", tiny_recipe, "--out", out, "--mirror", multi30k_mirror)
    assert result.exit_code == 0, result.output
    return out, result


def test_a_recipe_runs_end_to_end_and_reports(first_run):
    out, result = first_run
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["prepare", "train", "average", "translate", "eval"]
    assert all(s["ran"] for s in report["stages"])
    assert [s["name"] for s in report["scores"]] == ["BLEU", "chrF2", "TER"]
    assert all("version:" in s["signature"] for s in report["scores"])
    bleu = report["scores"][0]["value"]
    assert report["reproduced"] == (0.0 <= bleu <= 5.0)
    assert report["model"].endswith("average-last2.safetensors")
    assert report["training"]["updates"] == 6 and [v["step"] for v in report["training"]["validations"]] == [3, 6]
    assert len((out / "test.hyp.de").read_text().splitlines()) == captions.MIRROR_SPLITS["test_2016_flickr"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "report.md").read_text()
    assert f"Test BLEU {bleu:.2f}" in markdown and "![training curves](curves.png)" in markdown
    assert result.stdout.strip() == markdown.strip()


def test_the_report_says_where_training_ran_in_what_precision_and_what_stopped_it(first_run):
    """The tiny recipe sets no precision: training runs in auto, which the report resolves and explains (for the CPU
    the recipe pins)."""
    import torch

    from mtkit.runtime import choose_precision, cpu_features, hardware

    out, _ = first_run
    report = json.loads((out / "report.json").read_text())
    choice = choose_precision("auto", "cpu", cpu_features())
    assert report["training"]["machines"] == [
        {"step": 0, "hardware": hardware(torch.device("cpu")), "precision": choice.precision, "reason": choice.reason}
    ]
    stop = {"stopped_by": "max_steps", "reason": "reached train.max_steps 6", "max_steps": 6}
    assert report["training"]["stop"] == stop
    assert report["verdict"] == ("reproduced" if report["reproduced"] else "not reproduced")
    markdown = (out / "report.md").read_text()
    assert f"Trained on {hardware(torch.device('cpu'))}, in {choice.precision} ({choice.reason})." in markdown


def test_a_run_cut_short_by_max_time_is_incomplete_whatever_its_score(tiny_recipe, tmp_path, multi30k_mirror):
    out = tmp_path / "short"
    limits = ["--set", "train.max_time=1e-6", "--set", "recipe.bleu_min=0", "--set", "recipe.bleu_max=100"]
    result = invoke("run", tiny_recipe, "--out", out, "--mirror", multi30k_mirror, *limits)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    reason = "stopped by train.max_time (1e-06 min) at update 1 of 6"
    assert report["training"]["stop"] == {"stopped_by": "max_time", "reason": reason, "max_steps": 6}
    assert report["verdict"] == "incomplete" and report["reproduced"] is None  # though 0 <= BLEU <= 100
    assert f"**incomplete**: training {reason}" in (out / "report.md").read_text()
    assert "reproduced" not in (out / "report.md").read_text()


def test_a_second_run_redoes_nothing_and_judges_a_new_range(first_run, tiny_recipe, multi30k_mirror):
    out, _ = first_run
    hyp_stamp = (out / "test.hyp.de").stat().st_mtime_ns
    result = invoke(
        "run",
        tiny_recipe,
        "--out",
        out,
        "--mirror",
        multi30k_mirror,
        "--set",
        "recipe.bleu_min=30",
        "--set",
        "recipe.bleu_max=100",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert {s["name"]: s["ran"] for s in report["stages"]} == {
        "prepare": False,
        "train": True,  # resumed at update 6 of 6: stops at once
        "average": False,
        "translate": False,
        "eval": True,
    }
    assert (out / "test.hyp.de").stat().st_mtime_ns == hyp_stamp
    assert report["reproduced"] is False and "**NOT reproduced** (expected 30-100" in result.stdout


def test_a_second_run_directory_uses_the_same_prepared_corpus(first_run, tiny_recipe, tmp_path, multi30k_mirror):
    """One download and one prepared copy for every run of a recipe, outside the run directories."""
    first = json.loads((first_run[0] / "report.json").read_text())
    result = invoke(
        "run", tiny_recipe, "--out", tmp_path / "other", "--mirror", multi30k_mirror, "--set", "train.max_steps=3"
    )
    assert result.exit_code == 0, result.output
    second = json.loads((tmp_path / "other" / "report.json").read_text())
    prepared = [next(s for s in r["stages"] if s["name"] == "prepare") for r in (first, second)]
    assert prepared[1]["ran"] is False and prepared[0]["note"] == prepared[1]["note"]
    assert not (tmp_path / "other" / "data").exists() and not (first_run[0] / "data").exists()


def _copy_run(first_run, tmp_path):
    """A copy of the first run's directory, so a test may change it without touching the others'."""
    out = tmp_path / "tiny"
    shutil.copytree(first_run[0], out)
    return out


def _rerun(tiny_recipe, mirror, out, *settings):
    """``mtkit run`` again into ``out`` with ``--set`` ``settings``; its report.json and its stdout."""
    args = [a for setting in settings for a in ("--set", setting)]
    result = invoke("run", tiny_recipe, "--out", out, "--mirror", mirror, *args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text()), result.stdout


def _ran(report):
    return {s["name"]: s["ran"] for s in report["stages"] if s["name"] in ("average", "translate")}


def _note(report, stage):
    return next(s["note"] for s in report["stages"] if s["name"] == stage)


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_report_names_the_model_and_settings_the_hypothesis_came_from(first_run):
    out, _ = first_run
    report = json.loads((out / "report.json").read_text())
    assert report["test"]["model_sha256"] == _sha256(out / "average-last2.safetensors")
    assert report["test"]["decode"]["beam"] == 1 and report["test"]["decode"]["max_len_b"] == 4
    assert _note(report, "translate") == "beam 1, lenpen 1, max_len 0 * source + 4"
    assert report["test"]["model_sha256"][:12] in _note(report, "eval")


def test_new_decode_settings_translate_again_and_the_report_shows_them(
    first_run, tiny_recipe, tmp_path, multi30k_mirror
):
    out = _copy_run(first_run, tmp_path)
    before = (out / "test.hyp.de").read_text()
    report, stdout = _rerun(tiny_recipe, multi30k_mirror, out, "decode.beam=2", "decode.max_len_b=2")
    assert _ran(report) == {"average": False, "translate": True}
    assert _note(report, "translate") == "beam 2, lenpen 1, max_len 0 * source + 2"
    assert "beam 2, lenpen 1, max_len 0 * source + 2" in stdout
    assert report["test"]["decode"]["beam"] == 2
    assert (out / "test.hyp.de").read_text() != before  # at most 2 tokens now: shorter lines


def test_scoring_best_instead_of_the_average_translates_again(first_run, tiny_recipe, tmp_path, multi30k_mirror):
    out = _copy_run(first_run, tmp_path)
    report, _ = _rerun(tiny_recipe, multi30k_mirror, out, "recipe.average_last=0")
    assert _ran(report) == {"average": False, "translate": True}
    assert report["model"].endswith("best")
    assert report["test"]["model_sha256"] == _sha256(out / "best" / "model.safetensors")


def test_more_checkpoints_and_a_longer_average_redo_the_average_then_nothing(
    first_run, tiny_recipe, tmp_path, multi30k_mirror
):
    out = _copy_run(first_run, tmp_path)
    settings = ("train.max_steps=9", "recipe.average_last=3")
    report, _ = _rerun(tiny_recipe, multi30k_mirror, out, *settings)
    assert report["training"]["updates"] == 9
    assert _ran(report) == {"average": True, "translate": True}
    assert _note(report, "average") == "the newest 3 checkpoints, update-00000003 to update-00000009"
    assert report["test"]["model_sha256"] == _sha256(out / "average-last3.safetensors")
    hyp_stamp = (out / "test.hyp.de").stat().st_mtime_ns
    again, _ = _rerun(tiny_recipe, multi30k_mirror, out, *settings)
    assert _ran(again) == {"average": False, "translate": False}
    assert (out / "test.hyp.de").stat().st_mtime_ns == hyp_stamp
    assert again["test"]["model_sha256"] == report["test"]["model_sha256"]


def _truncated(text: str) -> bytes:
    return text.encode()[: len(text) // 2]


def _wrong_shape(text: str) -> bytes:
    record = json.loads(text)
    record["stages"] = {"average": ["update-3", 2], "translate": {"inputs": None, "settings": 5}}
    return json.dumps(record).encode()


def _edited(text: str) -> bytes:
    record = json.loads(text)
    for entry in record["stages"].values():
        entry["settings"]["edited"] = True
    return json.dumps(record).encode()


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: b"\x00\xff\xfe not json \x80",
        _truncated,
        lambda text: b"[1, 2, 3]",
        _wrong_shape,
        _edited,
    ],
    ids=["garbage", "truncated", "a list", "wrong shape", "edited"],
)
def test_a_damaged_stage_record_redoes_the_stages_instead_of_failing(
    first_run, tiny_recipe, tmp_path, damage, multi30k_mirror
):
    out = _copy_run(first_run, tmp_path)
    record = out / "stages.json"
    record.write_bytes(damage(record.read_text()))
    report, _ = _rerun(tiny_recipe, multi30k_mirror, out)
    assert _ran(report) == {"average": True, "translate": True}
    assert json.loads(record.read_text())["stages"]["translate"]["settings"]["decode"]["beam"] == 1
    again, _ = _rerun(tiny_recipe, multi30k_mirror, out)
    assert _ran(again) == {"average": False, "translate": False}


def test_an_edited_hypothesis_is_translated_again(first_run, tiny_recipe, tmp_path, multi30k_mirror):
    out = _copy_run(first_run, tmp_path)
    hyp = out / "test.hyp.de"
    original = hyp.read_text()
    hyp.write_text("edited\n" * 1000)
    report, _ = _rerun(tiny_recipe, multi30k_mirror, out)
    assert _ran(report) == {"average": False, "translate": True}
    assert hyp.read_text() == original


@pytest.mark.parametrize("source", ["x", {"a": 1}], ids=["a-string", "another-mapping"])
def test_an_edited_prepare_json_source_prepares_again_and_the_run_reports(
    first_run, tiny_recipe, tmp_path, multi30k_mirror, source
):
    """Such a record once went through training, translation and scoring to a TypeError in the report."""
    data = tmp_path / "data"
    assert invoke("prepare", "multi30k_en_de", "--out", data, "--mirror", multi30k_mirror).exit_code == 0
    record = json.loads((data / "prepare.json").read_text())
    (data / "prepare.json").write_text(json.dumps({**record, "source": source}))
    report, _ = _rerun(tiny_recipe, multi30k_mirror, _copy_run(first_run, tmp_path), f"recipe.data_dir={data}")
    assert report["corpus_source"] is None and _note(report, "prepare") == str(data)
    assert next(s["ran"] for s in report["stages"] if s["name"] == "prepare") is True
    assert "source" not in json.loads((data / "prepare.json").read_text())


def test_a_config_without_a_corpus_is_a_one_line_error(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text("train: {max_steps: 1}\n")
    result = invoke("run", path, "--out", tmp_path / "r")
    assert result.exit_code == 1 and result.stderr.startswith("error: recipe.corpus is not set")


def test_the_report_says_which_commit_of_a_hub_corpus_it_used():
    from mtkit.workflows.report import _origin

    source = {"dataset": "wmt/wmt14", "config": "de-en", "revision": "b199e406369ec1b7634206d3ded5ba45de2fe696"}
    assert _origin(source) == " (hf:wmt/wmt14 de-en at commit b199e406369ec1b7634206d3ded5ba45de2fe696)"
    assert _origin({"dataset": "/mirror/IWSLT/iwslt2017", "data_dir": "iwslt2017-de-en", "revision": None}) == (
        " (hf:/mirror/IWSLT/iwslt2017 iwslt2017-de-en)"
    )
    assert _origin(None) == ""  # Multi30k: its files' SHA-256 are in prepare.json


def test_a_recipe_of_several_corpora_scores_each_direction_and_their_mean(tiny_recipe, tmp_path, multi30k_mirror):
    raw = yaml.safe_load(tiny_recipe.read_text())
    del raw["recipe"]["corpus"], raw["data"]["src_lang"], raw["data"]["tgt_lang"]
    raw["data"]["corpora"] = [
        {"src_lang": "en", "tgt_lang": lang, "corpus": f"multi30k_en_{lang}"} for lang in ("de", "fr")
    ]
    (tmp_path / "en_xx.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    result = invoke("run", tmp_path / "en_xx.yaml", "--out", out, "--mirror", multi30k_mirror)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == [
        "prepare multi30k_en_de", "prepare multi30k_en_fr", "train", "average",
        "translate en-de", "eval en-de", "translate en-fr", "eval en-fr",
    ]  # fmt: skip
    assert report["test"] is None and [d["direction"] for d in report["directions"]] == ["en-de", "en-fr"]
    for direction in report["directions"]:
        lang = direction["direction"][-2:]
        hypothesis = out / f"test.{direction['direction']}.hyp.{lang}"
        assert direction["hypothesis"] == str(hypothesis)
        assert len(hypothesis.read_text().splitlines()) == captions.MIRROR_SPLITS["test_2016_flickr"]
    bleu = [d["scores"][0]["value"] for d in report["directions"]]
    assert report["scores"][0]["value"] == pytest.approx(sum(bleu) / 2)
    assert report["scores"][0]["signature"].startswith("mean over en-de, en-fr")
    assert all("bleu_by_direction" in v for v in report["training"]["validations"])
    markdown = (out / "report.md").read_text()
    assert "| en-fr |" in markdown and "Corpora `multi30k_en_de, multi30k_en_fr`" in markdown
    again, _ = _rerun(tmp_path / "en_xx.yaml", multi30k_mirror, out)
    assert not any(s["ran"] for s in again["stages"] if s["name"].startswith(("translate", "average")))


def test_a_catalogue_corpus_of_other_languages_than_its_entry_is_one_line(tiny_recipe, tmp_path, multi30k_mirror):
    raw = yaml.safe_load(tiny_recipe.read_text())
    del raw["recipe"]["corpus"]
    raw["data"] = {"corpora": [{"src_lang": "en", "tgt_lang": "fr", "corpus": "multi30k_en_de"}]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    result = invoke("run", tmp_path / "bad.yaml", "--out", tmp_path / "run", "--mirror", multi30k_mirror)
    assert result.exit_code == 1
    assert "corpus multi30k_en_de is en->de, but its src_lang/tgt_lang say en->fr" in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()
