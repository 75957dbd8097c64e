"""Back-translation in `mtkit run`: the chain end to end on a tiny model, killed in each stage and resumed to
the uninterrupted run's result; the resumable translation of a file; the config and its refusals."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import captions
import pytest
import yaml
from helpers import (
    CHAIN_TRAIN,
    TINY_MODEL,
    finished_run,
    invoke,
    one_line_error,
    refused_as_trained_on_other_data,
    run_recipe_sigterm_after_first_part,
    run_recipe_with_plan,
)

import mtkit
from mtkit.config import ConfigError, SamplingConfig, from_dict, read_config
from mtkit.data.tokenizer import Tokenizer
from mtkit.files import OutputError
from mtkit.model import checkpoint, loading, run_folder
from mtkit.training import trainer
from mtkit.training.distributed import DistributedError
from mtkit.training.resume import ResumeRefused
from mtkit.translation import resumable
from mtkit.translation.resumable import translate_resumably
from mtkit.workflows.backtranslation import reverse_config, with_synthetic
from mtkit.workflows.stages import train_stage

MONO_LINES = 4_500  # three parts of resumable.PART_LINES


@pytest.fixture(scope="module")
def bt_data(tmp_path_factory) -> Path:
    """A folder laid out as `mtkit prepare` writes (400 en-de training pairs, 40 valid, 40 test) and mono.de."""
    root = tmp_path_factory.mktemp("bt")
    corpus = captions.parallel(480, seed=7)
    half = root / "half"
    half.mkdir()
    for split, lines in (("train", slice(0, 400)), ("valid", slice(400, 440)), ("test", slice(440, 480))):
        for lang in ("en", "de"):
            (half / f"{split}.{lang}").write_text("\n".join(corpus[lang][lines]) + "\n")
    (root / "mono.de").write_text("\n".join(captions.parallel(MONO_LINES, seed=8)["de"]) + "\n")
    return root


def _recipe(root: Path, data: Path, **backtranslation) -> Path:
    raw = {
        "data": {"corpora": [{"src_lang": "en", "tgt_lang": "de", "prepared": str(data / "half")}]},
        "backtranslation": {"monolingual": str(data / "mono.de"), **backtranslation},
        "tokenizer": {"vocab_size": 300},
        "model": dict(TINY_MODEL),
        "train": CHAIN_TRAIN,
        "decode": {"beam": 1, "max_len_a": 0.0, "max_len_b": 6},
        "recipe": {"average_last": 2, "bleu_max": 100.0, "expected": "a tiny test model"},
    }  # fmt: skip
    path = root / "bt.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _kill_at(target: str, call: int) -> dict:
    return {"target": target, "call": call, "kind": "any", "event": 1}


@pytest.fixture(scope="module")
def uninterrupted(bt_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    return finished_run(_recipe(out.parent, bt_data), out)


def test_the_chain_trains_a_reverse_model_back_translates_and_trains_on_both(uninterrupted, bt_data):
    report = json.loads((uninterrupted / "report.json").read_text())
    stages = ["reverse", "back-translate", "train", "average", "translate", "eval"]
    assert [s["name"] for s in report["stages"]] == stages
    synthetic = (uninterrupted / "backtranslated.en").read_text().splitlines()
    assert len(synthetic) == MONO_LINES  # line-aligned with the monolingual text
    reverse = checkpoint.read_checkpoint(loading.resolve(uninterrupted / "reverse"), with_state=False)
    assert (reverse.cfg.data.corpora[0].src_lang, reverse.cfg.data.corpora[0].tgt_lang) == ("de", "en")
    main = checkpoint.read_checkpoint(run_folder.latest(uninterrupted), with_state=False)
    real, extra = main.cfg.data.corpora
    assert (extra.train_src, extra.train_tgt) == (str(uninterrupted / "backtranslated.en"), str(bt_data / "mono.de"))
    assert extra.back_translated and not real.back_translated
    assert Tokenizer(uninterrupted / "spm.model").missing_symbols(["<BT>"]) == []
    record = json.loads((uninterrupted / "stages.json").read_text())["stages"]["back-translate"]
    assert record["settings"]["backtranslation"]["method"] == "sample"


def test_killed_in_each_stage_and_resumed_the_chain_ends_as_the_uninterrupted_one(uninterrupted, bt_data, tmp_path):
    recipe, out = _recipe(tmp_path, bt_data), tmp_path / "run"
    kills = [
        ("reverse", _kill_at("mtkit.training.trainer:Trainer.train_step", 5)),
        ("back-translate", _kill_at("mtkit.translation.resumable:atomic_write", 2)),
        ("train", _kill_at("mtkit.training.trainer:Trainer.train_step", 3)),
    ]
    parts = out / ".backtranslated.en.parts"
    for stage, plan in kills:
        killed = run_recipe_with_plan(recipe, out, plan)
        assert killed.returncode == -9, f"{stage}: {killed.returncode}\n{killed.stderr[-3000:]}"
        if stage == "reverse":
            assert run_folder.latest(out / "reverse") is not None and not parts.exists()
        if stage == "back-translate":  # the first part is kept, the synthetic corpus not yet written
            assert [p.name for p in parts.glob("*.txt")] == ["000000000000.txt"]
            assert not (out / "backtranslated.en").exists()
    done = run_recipe_with_plan(recipe, out)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("backtranslated.en", "test.hyp.de"):
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name
    assert not (out / ".backtranslated.en.parts").exists()
    ours = checkpoint.read_checkpoint(run_folder.latest(out), with_state=False).weights
    theirs = checkpoint.read_checkpoint(run_folder.latest(uninterrupted), with_state=False).weights
    assert all((ours[name] == theirs[name]).all() for name in theirs)


def test_a_resumed_translation_keeps_the_parts_done_and_redoes_a_damaged_one(bt_data, tmp_path, monkeypatch):
    model = _reverse_model(bt_data, tmp_path)
    translator = mtkit.load(model, device="cpu", sampling=SamplingConfig(seed=3))
    source = bt_data / "mono.de"
    straight = translate_resumably(translator, source, tmp_path / "straight.en", part_lines=1_000)
    assert straight == MONO_LINES

    class Stop(Exception):
        pass

    def stop_after_two(first: int) -> None:
        if first == 1_000:
            raise Stop

    with pytest.raises(Stop):
        translate_resumably(translator, source, tmp_path / "out.en", part_lines=1_000, on_part=stop_after_two)
    parts = tmp_path / ".out.en.parts"
    assert sorted(p.name for p in parts.glob("*.txt")) == ["000000000000.txt", "000000001000.txt"]
    (parts / "000000001000.txt").write_text("a torn part\n")  # fewer lines than its range: redone
    done: list[int] = []
    translate_resumably(translator, source, tmp_path / "out.en", part_lines=1_000, on_part=done.append)
    assert done == [1_000, 2_000, 3_000, 4_000]
    assert (tmp_path / "out.en").read_bytes() == (tmp_path / "straight.en").read_bytes()
    assert not parts.exists()

    with pytest.raises(Stop):  # parts of a translation made from other settings are never reused
        translate_resumably(translator, source, tmp_path / "again.en", part_lines=1_000, on_part=stop_after_two,
                            made_from={"beam": 5})  # fmt: skip
    done.clear()
    translate_resumably(translator, source, tmp_path / "again.en", part_lines=1_000, on_part=done.append,
                        made_from={"beam": 4})  # fmt: skip
    assert done == [0, 1_000, 2_000, 3_000, 4_000]


def _reverse_model(bt_data: Path, root: Path) -> Path:
    raw = yaml.safe_load(_recipe(root, bt_data).read_text())
    del raw["backtranslation"], raw["recipe"]
    raw["data"]["corpora"][0].update(src_lang="de", tgt_lang="en")
    raw["train"].update(max_steps=4, valid_every=0)
    (root / "reverse.yaml").write_text(yaml.safe_dump(raw))
    assert invoke("train", root / "reverse.yaml", "--out", root / "reverse").exit_code == 0
    return root / "reverse"


def test_the_reverse_config_turns_the_corpus_around_and_the_main_one_adds_the_synthetic_pairs(bt_data, tmp_path):
    cfg = read_config(_recipe(tmp_path, bt_data, reverse_steps=3, weight=0.5))
    reverse = reverse_config(cfg)
    (corpus,) = reverse.data.corpora
    assert (corpus.src_lang, corpus.tgt_lang, corpus.prepared) == ("de", "en", str(bt_data / "half"))
    assert reverse.train.max_steps == 3 and not reverse.backtranslation.monolingual
    single = from_dict({"data": {"train_src": "a.en", "train_tgt": "a.de", "src_lang": "en", "tgt_lang": "de"},
                        "backtranslation": {"monolingual": "m.de"}})  # fmt: skip
    flipped = reverse_config(single).data
    assert (flipped.src_lang, flipped.train_src, flipped.train_tgt) == ("de", "a.de", "a.en")
    main = with_synthetic(single, Path("bt.en")).data
    assert not main.train_src and [(c.train_src, c.train_tgt, c.back_translated) for c in main.corpora] == [
        ("a.en", "a.de", False),
        ("bt.en", "m.de", True),
    ]
    assert with_synthetic(cfg, Path("bt.en")).data.corpora[1].weight == 0.5


def test_bad_back_translation_settings_and_files_are_one_line_before_any_training(bt_data, tmp_path):
    with pytest.raises(ConfigError, match="backtranslation.weight must be > 0"):
        from_dict({"backtranslation": {"weight": 0}})
    with pytest.raises(ConfigError, match="backtranslation.method must be one of sample, beam"):
        from_dict({"backtranslation": {"method": "greedy"}})
    (tmp_path / "empty.de").write_text("")
    recipe = _recipe(tmp_path, bt_data)
    raw = yaml.safe_load(recipe.read_text())
    raw["backtranslation"]["monolingual"] = str(tmp_path / "empty.de")
    recipe.write_text(yaml.safe_dump(raw))
    result = invoke("run", recipe, "--out", tmp_path / "run")
    assert result.exit_code == 1
    one_line_error(result, "empty.de: backtranslation.monolingual has no lines")
    assert not (tmp_path / "run" / "reverse").exists()
    result = invoke("train", recipe, "--out", tmp_path / "train")
    assert result.exit_code == 1
    one_line_error(result, "`mtkit run`")


def _copy_run(uninterrupted: Path, tmp_path: Path) -> Path:
    """A copy of the finished chain, for a test to change without touching the others'."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    return out


def test_a_reverse_model_cut_short_by_max_time_makes_the_run_incomplete(uninterrupted, bt_data, tmp_path):
    """The main training is whole (8 of 8 updates), but its synthetic sources come from a reverse model that
    train.max_time stopped at update 8 of 16: the score says nothing of the recipe."""
    out = _copy_run(uninterrupted, tmp_path)
    limits = ["--set", "backtranslation.reverse_steps=16", "--set", "train.max_time=1e-6"]
    result = invoke("run", _recipe(tmp_path, bt_data), "--out", out, *limits)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["stop"]["stopped_by"] == "max_steps"
    assert report["verdict"] == "incomplete" and report["reproduced"] is None  # though 0 <= BLEU <= 100
    reason = "the reverse model's training stopped by train.max_time (1e-06 min) at update 8 of 16"
    assert report["incomplete"] == [reason]
    assert f"**incomplete**: {reason}, so the score says nothing" in (out / "report.md").read_text()


def test_after_the_monolingual_text_changes_restart_train_trains_the_main_model_again(bt_data, tmp_path):
    """New monolingual text is back-translated again, so the main training's data changed: it refuses to resume
    with advice that names the option `mtkit run` has, and that option trains it again from update 0."""
    mono = tmp_path / "mono.de"
    mono.write_text("\n".join(captions.parallel(300, seed=8)["de"]) + "\n")
    recipe = _recipe(tmp_path, bt_data, monolingual=str(mono), reverse_steps=2)
    out = tmp_path / "run"
    assert invoke("run", recipe, "--out", out).exit_code == 0
    mono.write_text("\n".join(captions.parallel(300, seed=9)["de"]) + "\n")
    result = invoke("run", recipe, "--out", out)
    assert result.exit_code == 1 and "Traceback" not in result.output  # after the log of the stages before it:
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {out / 'checkpoints'}") and "trained on another data.corpora[1]" in line
    assert line.endswith("; to train it again from the start, run `mtkit run` with --restart train")
    stages = json.loads((out / "stages.json").read_text())["stages"]
    assert stages["back-translate"]["inputs"]["monolingual"] == hashlib.sha256(mono.read_bytes()).hexdigest()
    result = invoke("run", recipe, "--out", out, "--restart", "train")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    ran = {s["name"]: s["ran"] for s in report["stages"]}
    assert not ran["back-translate"] and ran["train"] and ran["average"] and ran["translate"]
    starts = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in starts if r["event"] == "start"] == [0]  # trained again from the start
    assert report["training"]["updates"] == 8
    result = invoke("run", recipe, "--out", out, "--restart", "teacher")
    one_line_error(result, "--restart teacher: this run has no such training; it trains train, reverse")


def test_sigterm_while_back_translating_ends_with_one_message_and_the_run_resumes(bt_data, tmp_path):
    recipe = _recipe(tmp_path, bt_data, reverse_model=str(_reverse_model(bt_data, tmp_path)))
    out = tmp_path / "run"
    stopped = run_recipe_sigterm_after_first_part(recipe, out)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    parts = out / ".backtranslated.en.parts"
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"stopped by SIGTERM while back-translating: the parts done are kept in {parts}; run the same command to resume"
    )
    assert "Traceback" not in stopped.stderr and (parts / "000000000000.txt").is_file()
    done = run_recipe_with_plan(recipe, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "back-translating: 2000 of 4500 lines already translated" in done.stderr


def test_a_full_disk_while_writing_a_part_names_the_part_not_the_source(bt_data, tmp_path, monkeypatch):
    translator = mtkit.load(_reverse_model(bt_data, tmp_path), device="cpu", beam=1)
    source = bt_data / "mono.de"
    write = resumable.atomic_write

    def full_disk(path, _write, *args):
        def fail(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        write(path, fail, *args)

    monkeypatch.setattr(resumable, "atomic_write", full_disk)
    with pytest.raises(OutputError) as raised:
        translate_resumably(translator, source, tmp_path / "out.en", part_lines=1_000)
    part = tmp_path / ".out.en.parts" / "000000000000.txt"
    assert str(raised.value) == f"{part}: cannot write (No space left on device)"


def _starts(run: Path) -> list[int]:
    """The update each training start in ``run`` began at (RUN/metrics.jsonl's start records)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["event"] == "start"]


def test_after_the_parallel_data_changes_restart_reverse_trains_the_reverse_model_again(bt_data, tmp_path):
    """The reverse model, the chain's first training, refuses to resume on changed parallel data, naming
    --restart reverse; with it (and --restart train for the main model, whose data changed too) both train from
    update 0."""
    shutil.copytree(bt_data / "half", tmp_path / "half")
    mono = tmp_path / "mono.de"
    mono.write_text("\n".join(captions.parallel(300, seed=8)["de"]) + "\n")
    recipe = _recipe(tmp_path, tmp_path, monolingual=str(mono), reverse_steps=2)
    out = tmp_path / "run"
    result = invoke("run", recipe, "--out", out)
    assert result.exit_code == 0, result.output
    train = tmp_path / "half" / "train.en"
    train.write_text("".join(train.read_text().splitlines(keepends=True)[:-20]) + "One more line.\n" * 20)
    result = invoke("run", recipe, "--out", out)
    refused_as_trained_on_other_data(result, out / "reverse" / "checkpoints", "reverse")
    weights = out / "reverse" / "checkpoints" / "update-00000002" / checkpoint.WEIGHTS_FILE
    before = weights.read_bytes()
    result = invoke("run", recipe, "--out", out, "--restart", "reverse", "--restart", "train")
    assert result.exit_code == 0, result.output
    assert weights.read_bytes() != before and _starts(out / "reverse") == [0] and _starts(out) == [0]
    ran = {s["name"]: s["ran"] for s in json.loads((out / "report.json").read_text())["stages"]}
    assert ran["reverse"] and ran["back-translate"] and ran["train"]


def test_only_a_refusal_to_resume_gets_the_chains_advice(monkeypatch):
    """A refusal to resume gets the advice `mtkit run` takes; other errors of a chain's training pass through as
    raised, even one whose advice names --restart."""
    raised: list[Exception] = []

    def fails(*args, **kwargs):
        raise raised[-1]

    monkeypatch.setattr(trainer, "run_training", fails)
    raised.append(DistributedError("rank 1 stopped answering; run it again, with --restart if it recurs", True))
    with pytest.raises(DistributedError) as error:
        train_stage(from_dict({}), Path("unused"), None, "reverse", False)
    assert error.value is raised[-1]
    raised.append(ResumeRefused("RUN/checkpoints/update-00000008: trained on another data.train_src", "--restart"))
    with pytest.raises(ResumeRefused) as error:
        train_stage(from_dict({}), Path("unused"), None, "reverse", False)
    assert str(error.value) == (
        "RUN/checkpoints/update-00000008: trained on another data.train_src; "
        "to train it again from the start, run `mtkit run` with --restart reverse"
    )
