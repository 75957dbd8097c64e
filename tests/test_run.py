"""`mtkit run`: a tiny recipe end to end on Multi30k from its mirror, then again with nothing to redo."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import MULTI30K
from test_cli import TINY_MODEL, invoke


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    """Multi30k En-De with a 1+1-layer model, 6 updates, greedy 4-token outputs: about a minute."""
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
        },
        "decode": {"beam": 1, "max_len_a": 0.0, "max_len_b": 4},
        "recipe": {"corpus": "multi30k_en_de", "average_last": 2, "bleu_max": 5.0, "expected": "a tiny test model"},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def first_run(tiny_recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny"
    result = invoke("run", tiny_recipe, "--out", out, "--mirror", MULTI30K)
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
    assert len((out / "test.hyp.de").read_text().splitlines()) == 1000
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "report.md").read_text()
    assert f"Test BLEU {bleu:.2f}" in markdown and "![training curves](curves.png)" in markdown
    assert result.stdout.strip() == markdown.strip()


def test_a_second_run_redoes_nothing_and_judges_a_new_range(first_run, tiny_recipe):
    out, _ = first_run
    hyp_stamp = (out / "test.hyp.de").stat().st_mtime_ns
    result = invoke(
        "run",
        tiny_recipe,
        "--out",
        out,
        "--mirror",
        MULTI30K,
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


def test_a_config_without_a_corpus_is_a_one_line_error(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text("train: {max_steps: 1}\n")
    result = invoke("run", path, "--out", tmp_path / "r")
    assert result.exit_code == 1 and result.stderr.startswith("error: recipe.corpus is not set")
