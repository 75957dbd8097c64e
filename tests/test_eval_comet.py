"""COMET and CometKiwi in `mtkit eval` (both dialects), `mtkit.evaluate`, validation in training and `mtkit run`'s
report: each prints what mtkit.scoring.comet computes for the same model and texts, with its signature, and bad input
is one error line. The models are tiny random ones in unbabel-comet's layout (tests/comet_fixture.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from comet_fixture import HYPOTHESES, REFERENCES, SOURCES, build_comet
from helpers import invoke, one_line_error, small_config
from sacrebleu.metrics.base import Score as SacreScore
from sacrebleu.significance import _bootstrap_resample, _paired_bs_test, estimate_ci

import mtkit
from mtkit.model import checkpoint
from mtkit.scoring import learned_metrics
from mtkit.scoring.comet import Comet, CometResult
from mtkit.scoring.comet_names import COMET_NAME, COMETKIWI_NAME, SCORE_NAMES

# A second system and a second reference: the hypotheses with their first and last segments swapped for the
# references' (so the systems differ), and the references with the words of each segment reversed.
SYSTEM_B = [REFERENCES[0], *HYPOTHESES[1:-1], REFERENCES[-1]]
REFERENCES_B = [" ".join(reversed(line.split())) for line in REFERENCES]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> SimpleNamespace:
    """The fixture's texts as files, and a tiny COMET and CometKiwi model."""
    root = tmp_path_factory.mktemp("comet_eval")
    paths = {}
    for name, lines in (
        ("src", SOURCES),
        ("hyp", HYPOTHESES),
        ("hyp_b", SYSTEM_B),
        ("ref", REFERENCES),
        ("ref_b", REFERENCES_B),
    ):
        paths[name] = root / f"{name}.txt"
        paths[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    comet = build_comet(root / "comet", "comet")
    kiwi = build_comet(root / "kiwi", "cometkiwi")
    return SimpleNamespace(**paths, comet=comet, kiwi=kiwi, root=root)


@pytest.fixture(scope="module")
def direct(files) -> dict[str, list[CometResult]]:
    """What mtkit.scoring.comet itself gives: COMET of both systems against the first references and against both,
    CometKiwi of both systems."""
    comet, kiwi = Comet.load(str(files.comet)), Comet.load(str(files.kiwi))
    return {
        "comet": comet.score(SOURCES, [HYPOTHESES, SYSTEM_B], [REFERENCES]),
        "comet_two_refs": comet.score(SOURCES, [HYPOTHESES, SYSTEM_B], [REFERENCES, REFERENCES_B]),
        "kiwi": kiwi.score(SOURCES, [HYPOTHESES, SYSTEM_B]),
    }


def eval_ok(*args) -> str:
    result = invoke("eval", *args, "--device", "cpu")
    assert result.exit_code == 0, result.output
    return result.stdout


def test_mtkit_json_and_text_give_comets_score_and_signature_after_sacrebleus(files, direct):
    expected = direct["comet"][0]
    model = ["--comet-model", files.comet]
    entries = json.loads(
        eval_ok("--hyp", files.hyp, "--ref", files.ref, "--src", files.src, "-m", "comet", "bleu", *model, "--json")
    )
    assert [e["name"] for e in entries] == ["BLEU", "COMET"]
    comet = entries[1]
    assert comet["score"] == pytest.approx(expected.system, abs=1e-6)
    assert comet["signature"] == expected.signature
    assert comet["model"] == "comet" and comet["precision"] == "fp32" and comet["refs"] == "1"
    text = eval_ok("--hyp", files.hyp, "--ref", files.ref, "--src", files.src, "-m", "bleu", "comet", *model)
    assert f"COMET = {expected.system:.4f}\n  signature: {expected.signature}" in text
    assert text.startswith("BLEU = ")


def test_sacrebleu_dialect_prints_comet_with_four_decimals_and_its_signature(files, direct):
    expected = direct["comet"][0]
    line = eval_ok(
        files.ref, "-i", files.hyp, "--src", files.src, "-m", "comet", "--comet-model", files.comet, "-f", "text"
    )
    assert line.strip() == f"COMET|{expected.signature} = {expected.system:.4f}"
    entry = json.loads(
        eval_ok(files.ref, "-i", files.hyp, "--src", files.src, "-m", "comet", "--comet-model", files.comet)
    )
    assert entry["score"] == round(expected.system, 4) and entry["signature"] == expected.signature


def test_segment_scores_are_comets_and_average_to_the_system_score(files, direct):
    expected = direct["comet"][0]
    result = invoke(
        "eval",
        "--hyp",
        files.hyp,
        "--ref",
        files.ref,
        "--src",
        files.src,
        "-m",
        "comet",
        "chrf",
        "--comet-model",
        files.comet,
        "-sl",
        "--device",
        "cpu",
    )
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.strip().splitlines()]
    assert len(rows) == 2 * len(SOURCES)
    comet = [float(value) for _, name, value in rows if name == "COMET"]
    assert comet == pytest.approx(expected.segments, abs=1e-4)
    assert sum(expected.segments) / len(expected.segments) == pytest.approx(expected.system)
    assert f"COMET signature: {expected.signature}" in result.stderr
    per_metric = json.loads(
        eval_ok(
            "--hyp",
            files.hyp,
            "--ref",
            files.ref,
            "--src",
            files.src,
            "-m",
            "comet",
            "--comet-model",
            files.comet,
            "-sl",
            "--json",
        )
    )
    assert per_metric[0]["values"] == pytest.approx(expected.segments, abs=1e-6)


def test_several_systems_and_references_are_scored_in_one_call(files, direct, monkeypatch):
    calls = []
    score = Comet.score

    def counted(self, sources, systems, references=None):
        calls.append((len(systems), len(references or [])))
        return score(self, sources, systems, references)

    monkeypatch.setattr(Comet, "score", counted)
    rows = json.loads(
        eval_ok(
            files.ref,
            files.ref_b,
            "-i",
            files.hyp,
            files.hyp_b,
            "--src",
            files.src,
            "-m",
            "comet",
            "--comet-model",
            files.comet,
        )
    )
    assert calls == [(2, 2)]  # both systems and both references in one call: sources and references embedded once
    assert [row["system"] for row in rows] == [str(files.hyp), str(files.hyp_b)]
    scores = [row["COMET"]["score"] for row in rows]
    assert scores == pytest.approx([r.system for r in direct["comet_two_refs"]], abs=1e-6)
    assert all(row["COMET"]["signature"] == direct["comet_two_refs"][0].signature for row in rows)
    assert "refs:2" in rows[0]["COMET"]["signature"]


def test_cometkiwi_needs_no_references(files, direct):
    blocks = eval_ok(
        "--hyp",
        files.hyp,
        "--hyp",
        files.hyp_b,
        "--src",
        files.src,
        "-m",
        "cometkiwi",
        "--comet-model",
        files.kiwi,
        "--json",
    )
    rows = json.loads(blocks)
    assert [row["scores"][0]["name"] for row in rows] == ["CometKiwi", "CometKiwi"]
    assert [row["scores"][0]["score"] for row in rows] == pytest.approx([r.system for r in direct["kiwi"]], abs=1e-6)
    assert "refs:0" in rows[0]["scores"][0]["signature"]


def test_the_python_api_scores_comet_beside_bleu(files, direct):
    scores = mtkit.evaluate(
        HYPOTHESES, [REFERENCES], ("comet", "bleu"), sources=SOURCES, comet_model=str(files.comet), device="cpu"
    )
    assert [s.name for s in scores] == ["BLEU", "COMET"]
    assert scores[1].value == pytest.approx(direct["comet"][0].system, abs=1e-6)
    kiwi = mtkit.evaluate(HYPOTHESES, [], ("cometkiwi",), sources=SOURCES, comet_model=str(files.kiwi), device="cpu")
    assert kiwi[0].value == pytest.approx(direct["kiwi"][0].system, abs=1e-6)
    with pytest.raises(mtkit.MtkitError, match="need a source per hypothesis"):
        mtkit.evaluate(HYPOTHESES, [REFERENCES], ("comet",), comet_model=str(files.comet))


def test_paired_bootstrap_over_segments_is_sacrebleus_test_of_their_mean(files, direct, monkeypatch):
    """The baseline's bootstrap mean and CI, and the other system's p-value, are what sacreBLEU's own paired test
    computes for a metric whose corpus score is the mean of its segment scores."""
    baseline, system = direct["comet"]
    result = learned_metrics.paired_bootstrap([("a", baseline), ("b", system)], n=200, seed=7)

    class MeanOfSegments:  # sacreBLEU's Metric interface, as its paired test uses it
        def _compute_score_from_stats(self, stats):
            return SacreScore("COMET", float(stats[0]) / len(baseline.segments))

        def _extract_corpus_statistics(self, hypotheses, references):
            assert hypotheses is SYSTEM_B
            return [[value] for value in system.segments]

        def _aggregate_and_compute(self, stats):
            return SacreScore("COMET", float(np.mean(stats)))

    metric = MeanOfSegments()
    monkeypatch.setenv("SACREBLEU_SEED", "7")
    _, resampled = _bootstrap_resample([[v] for v in baseline.segments], metric, 200)
    mean, ci = estimate_ci(np.array([score.score for score in resampled]))
    assert result.systems[0].mean == pytest.approx(mean, rel=1e-5) and result.systems[0].ci == pytest.approx(
        ci, rel=1e-5
    )
    baseline_info = {"COMET": ([[v] for v in baseline.segments], SimpleNamespace(score=baseline.system))}
    _, tested = _paired_bs_test(baseline_info, "b", SYSTEM_B, None, {"COMET": metric}, n_samples=200, seed=7)
    assert result.systems[1].p_value == pytest.approx(tested["COMET"].p_value)
    assert result.systems[1].mean == pytest.approx(tested["COMET"].mean, rel=1e-5)
    assert result.signature == f"{baseline.signature}|bs:200|seed:7"


def test_paired_bootstrap_through_the_command_line(files, direct):
    rows = json.loads(
        eval_ok(
            files.ref,
            "-i",
            files.hyp,
            files.hyp_b,
            "--src",
            files.src,
            "-m",
            "bleu",
            "comet",
            "--comet-model",
            files.comet,
            "--paired-bs",
            "--paired-bs-n",
            "100",
        )
    )
    assert [list(row) for row in rows] == [["system", "BLEU", "COMET"]] * 2
    assert rows[0]["COMET"]["p_value"] is None and 0 < rows[1]["COMET"]["p_value"] <= 1
    assert [row["COMET"]["score"] for row in rows] == pytest.approx([r.system for r in direct["comet"]], abs=1e-6)


def test_a_paired_table_of_comet_alone_marks_its_column_as_sacrebleu_marks_bleus(files):
    """sacreBLEU adds "(μ ± 95% CI)" only to columns after one it formatted itself: COMET's alone once lost it."""
    args = [files.ref, "-i", files.hyp, files.hyp_b, "--src", files.src, "--comet-model", files.comet]
    paired = ["--paired-bs", "--paired-bs-n", "50", "-f", "text"]
    comet_only = eval_ok(*args, "-m", "comet", *paired)
    assert comet_only.count("COMET (μ ± 95% CI)") == 1
    both = eval_ok(*args, "-m", "bleu", "comet", *paired)
    assert both.count("BLEU (μ ± 95% CI)") == 1 and both.count("COMET (μ ± 95% CI)") == 1


def test_a_bootstrap_seed_sacrebleu_would_not_apply_to_every_resample_is_refused(direct, monkeypatch):
    """sacreBLEU seeds a compared system's resamples only with a seed other than 0, and reads $SACREBLEU_SEED as a
    number: anything else would make a p-value that the signature's seed cannot reproduce, or a traceback."""
    systems = [("a", direct["comet"][0]), ("b", direct["comet"][1])]
    first = learned_metrics.paired_bootstrap(systems, n=50, seed=3)
    assert learned_metrics.paired_bootstrap(systems, n=50, seed=3) == first
    monkeypatch.setenv("SACREBLEU_SEED", "3")
    assert learned_metrics.paired_bootstrap(systems, n=50) == first
    with pytest.raises(mtkit.MtkitError, match="positive whole number"):
        learned_metrics.paired_bootstrap(systems, n=50, seed=0)
    for value in ("0", "seven", "٣"):
        monkeypatch.setenv("SACREBLEU_SEED", value)
        with pytest.raises(mtkit.MtkitError, match=r"\$SACREBLEU_SEED"):
            learned_metrics.paired_bootstrap(systems, n=50)
    monkeypatch.setenv("SACREBLEU_SEED", "none")
    assert learned_metrics.paired_bootstrap(systems, n=50).signature.endswith("|bs:50|seed:none")


def test_results_carry_the_names_mtkit_eval_and_the_report_print_with_four_decimals(direct):
    assert direct["comet"][0].name == COMET_NAME and direct["kiwi"][0].name == COMETKIWI_NAME
    assert {COMET_NAME, COMETKIWI_NAME} == set(SCORE_NAMES)


def test_bad_comet_input_is_one_line_and_exit_1(files, tmp_path):
    short = tmp_path / "short.en"
    short.write_text("one line\n")
    base = ["--hyp", files.hyp, "--ref", files.ref]
    cases = [
        ([*base, "-m", "comet", "--comet-model", files.comet], ["--src"]),
        ([*base, "--src", short, "-m", "comet", "--comet-model", files.comet], [f"has {len(SOURCES)} lines", "short"]),
        (["--hyp", files.hyp, "--src", files.src, "-m", "comet", "--comet-model", files.comet], ["references"]),
        (
            ["--hyp", files.hyp, "--src", files.src, "-m", "cometkiwi", "--comet-model", files.comet],
            ["reference-based"],
        ),
        ([*base, "--src", files.src, "-m", "comet", "cometkiwi", "--comet-model", files.comet], ["--comet-model"]),
        ([*base, "--hyp", files.hyp_b, "--src", files.src, "-m", "comet", "bleu"], ["several systems", "--paired-bs"]),
        ([*base, "--hyp", files.hyp_b, "--src", files.src, "-m", "comet", "-sl"], ["--sentence", "one"]),
        ([*base, "--src", files.src, "-m", "comet", "--comet-model", tmp_path / "missing"], ["missing"]),
    ]
    for args, fragments in cases:
        one_line_error(invoke("eval", *args, "--device", "cpu"), *fragments)
    comet = [*base, "--src", files.src, "-m", "comet", "--comet-model", files.comet]
    one_line_error(invoke("eval", *comet, "--device", "tpu"), "device must be auto, cpu, cuda or cuda:N")
    for option in (["--precision", "fp16"], ["--batch-size", "0"], ["--batch-size", "4097"]):
        refused = invoke("eval", *comet, *option)
        assert refused.exit_code == 2 and option[0] in refused.output  # the command line's own usage error
    with pytest.raises(mtkit.MtkitError, match="precision"):
        mtkit.evaluate(
            HYPOTHESES, [REFERENCES], ("comet",), sources=SOURCES, comet_model=str(files.comet), precision="fp16"
        )


def test_a_damaged_model_folder_is_one_line_from_the_real_command(files, tmp_path):
    damaged = build_comet(tmp_path / "damaged", "comet")
    (damaged / "checkpoints" / "model.ckpt").write_bytes(b"not a checkpoint")
    command = [
        sys.executable,
        "-m",
        "mtkit",
        "eval",
        "--hyp",
        files.hyp,
        "--ref",
        files.ref,
        "--src",
        files.src,
        "-m",
        "comet",
        "--comet-model",
        damaged,
        "--device",
        "cpu",
    ]
    proc = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model.ckpt" in lines[0], proc.stderr


def test_validation_scores_comet_and_best_follows_it(files, corpus_files, spm_model, tmp_path, monkeypatch):
    """train.valid_comet logs valid_comet at each validation and best/ follows it; the report of the run lists it,
    and recipe.comet puts the test set's COMET beside BLEU, chrF and TER with its signature."""
    from mtkit.training.trainer import run_training
    from mtkit.workflows import recipe as recipe_module
    from mtkit.workflows.report import build_report, render_report
    from mtkit.workflows.stages import Digests, StageRecord

    cfg = small_config(
        corpus_files,
        spm_model,
        max_steps=4,
        valid_every=2,
        valid_beam=1,
        best_metric="comet",
        valid_comet=str(files.comet),
    )
    cfg = replace(cfg, decode=replace(cfg.decode, beam=1, max_len_a=0.0, max_len_b=4))  # short outputs: fast
    out = tmp_path / "run"
    run_training(cfg, out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r.get("event") == "valid"]
    assert [r["step"] for r in valid] == [2, 4]
    assert all(isinstance(r["valid_comet"], float) and r["comet_signature"].startswith("model:comet|") for r in valid)
    assert "valid_bleu" not in valid[0]  # train.valid_bleu false: the translations are decoded for COMET alone
    best = checkpoint.read_checkpoint(out / "best", with_state=False)
    assert best.meta["validation"]["valid_comet"] == max(r["valid_comet"] for r in valid)

    test = recipe_module.TestSet("src-tgt", "tgt", corpus_files["val.en"], corpus_files["val.de"])
    stages: list = []
    loaded = []
    load = Comet.load

    def load_after_translating(model, **settings):
        # The test set is translated, and its stage over, before the COMET model is loaded: never both in memory.
        loaded.append(([s.name for s in stages], (out / "test.hyp.tgt").exists()))
        return load(model, **settings)

    monkeypatch.setattr(Comet, "load", load_after_translating)
    with_comet = _with_recipe_comet(cfg, str(files.comet))
    result = recipe_module._test(with_comet, out / "best", test, out, stages, StageRecord(out, Digests()), False)
    assert loaded == [(["translate"], True)]
    assert [s["name"] for s in result["scores"]] == ["BLEU", "chrF2", "TER", "COMET"]
    assert result["scores"][3]["signature"].startswith("model:comet|")
    report = build_report(cfg, tmp_path / "r.yaml", out, out, "captions", None, [result], stages)
    assert [v["comet"] for v in report["training"]["validations"]] == [r["valid_comet"] for r in valid]
    training = report["training"]  # the validation best/ holds, by the metric it follows
    assert (training["best_valid_metric"], training["best_valid_step"]) == ("comet", best.meta["step"])
    assert training["best_valid_score"] == best.meta["validation"]["valid_comet"]
    markdown = render_report(report)
    assert f"| COMET | {result['scores'][3]['value']:.4f} |" in markdown
    assert (
        f"best validation COMET {training['best_valid_score']:.4f} at update {training['best_valid_step']}" in markdown
    )


def _with_recipe_comet(cfg, model: str):
    return replace(cfg, recipe=replace(cfg.recipe, comet=model))


@pytest.mark.parametrize(
    ("best_metric", "shown"),
    [
        ("bleu", "best validation BLEU 31.00 at update 2,"),
        ("comet", "best validation COMET 0.6100 at update 4,"),  # tied at update 6: the first, as training keeps
        ("loss", "best validation loss 1.500 at update 6,"),
    ],
)
def test_the_report_names_the_validation_best_holds_by_the_metric_it_follows(
    corpus_files, spm_model, tmp_path, best_metric, shown
):
    """Each metric peaks at another update: the report once named the best BLEU's whatever best/ followed."""
    from mtkit.workflows.report import _curves, build_report, render_report

    out = tmp_path / "run"
    out.mkdir()
    records = [
        {"event": "train", "step": 1, "loss": 5.0},
        {"event": "valid", "step": 2, "valid_loss": 2.0, "valid_bleu": 31.0, "valid_comet": 0.4},
        {"event": "valid", "step": 4, "valid_loss": 1.8, "valid_bleu": 30.0, "valid_comet": 0.61},
        {"event": "valid", "step": 6, "valid_loss": 1.5, "valid_bleu": 29.0, "valid_comet": 0.61},
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = small_config(corpus_files, spm_model, best_metric=best_metric, valid_bleu=True, valid_comet="comet")
    bleu = {"name": "BLEU", "value": 30.5, "signature": "nrefs:1", "details": "", "comparable": True, "verbose": ""}
    result = {"direction": "en-de", "scores": [bleu]}
    report = build_report(cfg, tmp_path / "r.yaml", out, out, "captions", None, [result], [])
    expected_step = {"bleu": 2, "comet": 4, "loss": 6}[best_metric]
    assert report["training"]["best_valid_step"] == expected_step
    assert report["training"]["best_valid_metric"] == best_metric
    assert report["training"]["best_valid_bleu"] == {2: 31.0, 4: 30.0, 6: 29.0}[expected_step]
    assert shown in render_report(report)
    panels = {panel.ylabel: panel.lines for panel in _curves(records[:1], records[1:])}
    assert list(panels) == ["loss", "BLEU", "COMET"]
    assert [(steps, values) for _, steps, values, _ in panels["COMET"]] == [([2, 4, 6], [0.4, 0.61, 0.61])]
    without_comet = [{key: value for key, value in r.items() if key != "valid_comet"} for r in records[1:]]
    assert [panel.ylabel for panel in _curves(records[:1], without_comet)] == ["loss", "BLEU"]
