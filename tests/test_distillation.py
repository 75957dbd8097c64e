"""Sequence-level distillation in `mtkit run`: the chain end to end on tiny teachers and a tiny student, killed
while the teacher translates and resumed to the uninterrupted run's result; the distilled corpus's alignment; the
report; the filters; refusals of teachers whose tokenizer or direction the student cannot take."""

from __future__ import annotations

import json
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
import mtkit.workflows.recipe
from mtkit import runtime
from mtkit.config import PRESETS, ConfigError, TokenizerConfig, from_dict, read_config
from mtkit.data.parallel import read_lines
from mtkit.data.tokenizer import PAD_ID, train_spm
from mtkit.model import checkpoint, run_folder
from mtkit.model.transformer import build_model, count_parameters
from mtkit.scoring.metrics import sentence_scores
from mtkit.training import trainer
from mtkit.training.stop_signals import TrainingStopped
from mtkit.translation import resumable
from mtkit.workflows.distillation import distil, kept_pairs
from mtkit.workflows.stages import Digests, StageRecord

TRAIN_LINES = 4_500  # three parts of resumable.PART_LINES


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder laid out as `mtkit prepare` writes one: 4,500 en-de training pairs, 40 valid, 40 test."""
    folder = tmp_path_factory.mktemp("distil") / "corpus"
    folder.mkdir()
    pairs = captions.parallel(TRAIN_LINES + 80, seed=11)
    splits = {"train": slice(0, TRAIN_LINES), "valid": slice(TRAIN_LINES, TRAIN_LINES + 40), "test": slice(-40, None)}
    for split, lines in splits.items():
        for lang in ("en", "de"):
            (folder / f"{split}.{lang}").write_text("\n".join(pairs[lang][lines]) + "\n")
    return folder


def _teacher_recipe(root: Path, corpus: Path) -> Path:
    raw = {
        "data": {"corpora": [{"src_lang": "en", "tgt_lang": "de", "prepared": str(corpus)}]},
        "tokenizer": {"vocab_size": 300},
        "model": {**TINY_MODEL, "d_model": 48},
        "train": {**CHAIN_TRAIN, "max_steps": 300, "valid_every": 150, "save_every": 50},  # enough to write German
        "decode": {"beam": 2, "max_len_a": 1.0, "max_len_b": 4},
        "recipe": {"average_last": 2, "expected": "a tiny teacher"},
    }
    path = root / "teacher.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _student_recipe(root: Path, corpus: Path, **distillation) -> Path:
    raw = {
        "data": {"corpora": [{"src_lang": "en", "tgt_lang": "de", "prepared": str(corpus)}]},
        "distillation": {"beam": 2, "nbest": 2, "drop_worst": 0.1, **distillation},
        "model": {**TINY_MODEL, "encoder_layers": 2},
        "train": CHAIN_TRAIN,
        "decode": {"beam": 2, "max_len_a": 0.0, "max_len_b": 8},
        "recipe": {"average_last": 2, "expected": "a tiny student"},
    }
    if "teacher" not in distillation:
        raw["distillation"]["teacher_recipe"] = str(_teacher_recipe(root, corpus))
        raw["distillation"].setdefault("teacher_seeds", [1, 2])
    path = root / "student.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    return finished_run(_student_recipe(out.parent, corpus), out)


def test_the_chain_trains_two_teachers_distils_and_trains_a_student_on_their_tokenizer(uninterrupted):
    report = json.loads((uninterrupted / "report.json").read_text())
    stages = ["teacher 1", "teacher 2", "distil", "filter", "shortlist", "train", "average", "translate", "eval"]
    assert [s["name"] for s in report["stages"]] == [*stages, "compare"]
    teachers = [Path(t) for t in report["distillation"]["teachers"]]
    assert [t.parent.name for t in teachers] == ["teacher-1", "teacher-2"]
    for teacher in teachers:  # each teacher is a whole run, scored on its test set
        assert json.loads((teacher.parent / "report.json").read_text())["scores"][0]["name"] == "BLEU"
    digests = [checkpoint.read_checkpoint(t, with_state=False).meta["tokenizer"]["src"]["sha256"] for t in teachers]
    student = checkpoint.read_checkpoint(run_folder.latest(uninterrupted), with_state=False)
    assert digests[0] == digests[1] == student.meta["tokenizer"]["src"]["sha256"]
    assert (student.cfg.model.encoder_layers, student.cfg.model.d_model) == (2, 32)
    (corpus,) = student.cfg.data.corpora
    assert corpus.train_tgt == str(uninterrupted / "distilled" / "train.de") and corpus.valid_tgt.endswith("valid.de")


def test_the_distilled_corpus_is_the_teachers_translations_line_aligned_with_their_sources(uninterrupted, corpus):
    report = json.loads((uninterrupted / "report.json").read_text())
    filters = report["distillation"]["filters"]
    scored = read_lines(uninterrupted / "distilled.de.scored")
    assert filters["translated"] == len(scored) == TRAIN_LINES
    assert filters["translated"] == sum(filters[k] for k in ("empty", "ratio", "worst", "kept"))
    assert filters["worst"] == int(0.1 * (TRAIN_LINES - filters["empty"] - filters["ratio"])) > 0
    sources, kept_src = read_lines(corpus / "train.en"), read_lines(uninterrupted / "distilled" / "train.en")
    kept_tgt = read_lines(uninterrupted / "distilled" / "train.de")
    assert len(kept_src) == len(kept_tgt) == filters["kept"]
    translated = iter(enumerate(zip(sources, (line.partition("\t")[2] for line in scored))))
    kept_at = []  # each kept pair is a source with its own translation, in the corpus's order
    for pair in zip(kept_src, kept_tgt):
        kept_at.append(next(i for i, candidate in translated if candidate == pair))
    teacher = mtkit.load([Path(t) for t in report["distillation"]["teachers"]], device="cpu", nbest=2, beam=2)
    references = read_lines(corpus / "train.de")
    for at, hypotheses in zip(kept_at[:30], teacher.hypotheses(sources[i] for i in kept_at[:30])):
        texts, kept = [h.text for h in hypotheses], kept_tgt[kept_at.index(at)]
        assert kept in texts  # one of the ensemble's two best: the closer to the reference by chrF
        chrf = sentence_scores(texts, [[references[at]] * 2], ("chrf",))[0].values
        assert chrf[texts.index(kept)] == max(chrf)


def test_the_report_sets_teacher_and_student_side_by_side(uninterrupted):
    report = json.loads((uninterrupted / "report.json").read_text())
    comparison = report["distillation"]["comparison"]
    precisions = ["fp32", *(["bf16"] if "bf16" in {r["precision"] for r in comparison["rows"]} else []), "int8"]
    settings = {(r["model"], r["precision"], r["shortlist"], r["beam"]) for r in comparison["rows"]}
    expected = {("teacher", p, s, 2) for p in precisions for s in (False, True)}
    expected |= {("student", p, s, b) for p in precisions for s in (False, True) for b in (2, 1)}
    assert settings == expected and len(comparison["rows"]) == len(expected)
    assert all(r["sentences_per_s"] > 0 and 0 <= r["bleu"] <= 100 and r["chrf"] > 0 for r in comparison["rows"])
    student = {
        (r["precision"], r["beam"]): r for r in comparison["rows"] if r["model"] == "student" and not r["shortlist"]
    }
    assert student["fp32", 2]["bleu"] == pytest.approx(report["scores"][0]["value"])  # the run's own test score
    sizes = comparison["models"]
    assert sizes["student"]["file_bytes"] == Path(report["model"]).stat().st_size
    assert sizes["teacher"]["parameters"] > 2 * sizes["student"]["parameters"] > 0  # two wider models
    assert Path(report["distillation"]["shortlist"]) == uninterrupted / "shortlist.safetensors"
    markdown = (uninterrupted / "report.md").read_text()
    assert "| teacher | fp32 | yes | 2 |" in markdown and "| student | int8 | no | 1 |" in markdown
    assert f"{sizes['student']['parameters']:,} parameters" in markdown


def test_killed_while_the_teacher_translates_the_chain_resumes_to_the_uninterrupted_result(
    uninterrupted, corpus, tmp_path
):
    recipe, out = _student_recipe(tmp_path, corpus), tmp_path / "run"
    plan = {"target": "mtkit.translation.resumable:atomic_write", "call": 2, "kind": "any", "event": 1}
    killed = run_recipe_with_plan(recipe, out, plan)
    assert killed.returncode == -9, killed.stderr[-3000:]
    parts = out / ".distilled.de.scored.parts"
    assert [p.name for p in parts.glob("*.txt")] == ["000000000000.txt"]  # one part kept, no corpus yet
    assert not (out / "distilled.de.scored").exists() and not (out / "distilled").exists()
    done = run_recipe_with_plan(recipe, out)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = {s["name"]: s["ran"] for s in json.loads((out / "report.json").read_text())["stages"]}
    assert not stages["teacher 1"] and not stages["teacher 2"] and stages["distil"]  # the teachers were kept
    assert "distilling: 2000 of 4500 lines already translated" in done.stderr
    for name in ("distilled.de.scored", "distilled/train.en", "distilled/train.de", "test.hyp.de"):
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name
    assert not parts.exists()


def test_the_filters_drop_empty_and_disproportionate_translations_then_the_lowest_scored(tmp_path):
    lines = ["a dog runs on the grass", "a man", "two children play", "a woman sings", "a cat sleeps", "a bird"]
    source = tmp_path / "train.en"
    source.write_text("\n".join(lines) + "\n")
    translations = [
        "-0.5\tein Hund läuft auf dem Gras",
        "-0.1\t",  # empty
        "-0.2\tzwei Kinder spielen " + "und spielen " * 20,  # far longer than its source
        "-3.0\teine Frau singt",  # the lowest score left
        "-0.3\teine Katze schläft",
        "-1.0\tein Vogel",
    ]
    scored = tmp_path / "scored.de"
    scored.write_text("\n".join(translations) + "\n")
    pairs = captions.parallel(500, seed=3)
    spm = train_spm(pairs["en"] + pairs["de"], tmp_path / "spm", TokenizerConfig(vocab_size=200))
    cfg = from_dict({"distillation": {"teacher": ["t"], "max_ratio": 3.0, "drop_worst": 0.25}})
    tokenizer = TokenizerConfig(vocab_size=200, model=str(spm))
    keep, counts = kept_pairs(cfg, tokenizer, source, scored)
    assert keep.tolist() == [True, False, False, False, True, True]
    assert counts == {"translated": 6, "empty": 1, "ratio": 1, "worst": 1, "kept": 3}
    scored.write_text("-0.5\tein Hund\nnot a score\n")
    with pytest.raises(mtkit.MtkitError, match=r"scored.de: line 2: not a score, a tab and a translation"):
        kept_pairs(cfg, tokenizer, source, scored)


@pytest.fixture(scope="module")
def other_teachers(corpus, tmp_path_factory) -> dict[str, Path]:
    """Teachers a student of the chain's config cannot take: en-de with another tokenizer, and de-en."""
    root = tmp_path_factory.mktemp("others")
    models = {}
    for name, (src, tgt) in {"other-tokenizer": ("en", "de"), "de-en": ("de", "en")}.items():
        raw = yaml.safe_load(_teacher_recipe(root, corpus).read_text())
        del raw["recipe"]
        raw["data"]["corpora"][0].update(src_lang=src, tgt_lang=tgt)
        raw["tokenizer"] = {"vocab_size": 280, "seed": 7}
        raw["train"] = {**CHAIN_TRAIN, "max_steps": 2, "valid_every": 0}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        assert invoke("train", root / f"{name}.yaml", "--out", root / name).exit_code == 0
        models[name] = root / name
    return models


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("vocab_size", "tokenizer.vocab_size is 500 in this config but 300 in the teacher"),
        ("tokenizer_file", "is another vocabulary than the teacher"),
        ("ensemble", "have different tokenizers: an ensemble shares one vocabulary"),
        ("direction", "translates de->en, not en->de"),
    ],
)
def test_a_teacher_the_student_cannot_take_is_refused_in_one_line_before_it_translates(
    uninterrupted, other_teachers, corpus, tmp_path, case, expected
):
    teacher = str(uninterrupted / "teacher-1")
    teachers = {
        "ensemble": [teacher, str(other_teachers["other-tokenizer"])],
        "direction": [str(other_teachers["de-en"])],
    }
    recipe = _student_recipe(tmp_path, corpus, teacher=teachers.get(case, [teacher]))
    raw = yaml.safe_load(recipe.read_text())
    if case == "vocab_size":
        raw["tokenizer"] = {"vocab_size": 500}
    if case == "tokenizer_file":
        raw["tokenizer"] = {"model": str(other_teachers["other-tokenizer"] / "spm.model")}
    recipe.write_text(yaml.safe_dump(raw))
    result = invoke("run", recipe, "--out", tmp_path / "run")
    assert result.exit_code == 1
    one_line_error(result, expected)
    assert not (tmp_path / "run" / "distilled.de.scored").exists()
    assert not list((tmp_path / "run").glob(".distilled*"))


def test_bad_distillation_settings_are_one_line(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"distillation.nbest must be between 1 and distillation.beam \(4\)"):
        from_dict({"distillation": {"teacher": ["t"], "beam": 4, "nbest": 5}})
    with pytest.raises(ConfigError, match="give distillation.teacher .* or distillation.teacher_recipe"):
        from_dict({"distillation": {"teacher": ["t"], "teacher_recipe": "r.yaml"}})
    with pytest.raises(ConfigError, match=r"distillation.drop_worst must be in \[0, 1\)"):
        from_dict({"distillation": {"drop_worst": 1.0}})
    with pytest.raises(ConfigError, match="teacher_seeds has a seed twice"):
        from_dict({"distillation": {"teacher_seeds": [1, 1]}})
    recipe = _student_recipe(tmp_path, corpus, teacher=["t"])
    result = invoke("train", recipe, "--out", tmp_path / "train")
    assert result.exit_code == 1
    one_line_error(result, "distillation is a chain of stages that `mtkit run` carries out")
    assert read_config(recipe).distillation.enabled


def test_the_student_presets_are_deep_encoders_with_shallow_decoders_smaller_than_their_teachers():
    def parameters(preset: str) -> int:
        return count_parameters(build_model(from_dict({"model": {"preset": preset}}).model, 8000, 8000, PAD_ID))

    for student, teacher in (("student-tiny", "transformer-base"), ("student-micro", "transformer-small")):
        assert (PRESETS[student]["encoder_layers"], PRESETS[student]["decoder_layers"]) == (6, 2)
        assert parameters(student) < parameters(teacher) / 2


@pytest.fixture(scope="module")
def quick_teacher(corpus, tmp_path_factory) -> Path:
    """A teacher of two updates on the chain's corpus, writing 2 or 3 tokens: fast to distil from."""
    root = tmp_path_factory.mktemp("quick")
    raw = yaml.safe_load(_teacher_recipe(root, corpus).read_text())
    del raw["recipe"]
    raw["train"] = {**CHAIN_TRAIN, "max_steps": 2, "valid_every": 0, "device": "cpu"}
    raw["decode"] = {"beam": 1, "max_len_a": 0.0, "max_len_b": 3, "min_len": 2}
    (root / "quick.yaml").write_text(yaml.safe_dump(raw))
    assert invoke("train", root / "quick.yaml", "--out", root / "quick").exit_code == 0
    return root / "quick"


def test_a_distillation_resumed_where_auto_means_another_precision_translates_every_part_again(
    corpus, quick_teacher, tmp_path, monkeypatch
):
    """Parts decoded in fp32 (a CPU without native bf16) are never joined with parts decoded in bf16 (one with it):
    the resumed stage translates the whole corpus again."""
    teacher = [str(quick_teacher)]
    recipe = _student_recipe(tmp_path, corpus, teacher=teacher, beam=1, nbest=1, max_ratio=100.0, shortlist=False)
    raw = yaml.safe_load(recipe.read_text())
    raw["train"]["device"] = "cpu"
    recipe.write_text(yaml.safe_dump(raw))
    cfg, out = read_config(recipe), tmp_path / "run"
    written: list[str] = []
    write = resumable.atomic_write

    class Stop(Exception):
        pass

    def counted(path: Path, *args) -> None:
        write(path, *args)
        if path.parent.name == ".distilled.de.scored.parts":
            written.append(path.name)
            if stop_after_one:
                raise Stop

    monkeypatch.setattr(resumable, "atomic_write", counted)
    stop_after_one = True
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset())  # auto: fp32
    with pytest.raises(Stop):
        distil(cfg, out, [], StageRecord(out, Digests()), None)
    assert written == ["000000000000.txt"]
    stop_after_one, stages = False, []
    written.clear()
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx512_bf16"}))  # auto: bf16
    distil(cfg, out, stages, StageRecord(out, Digests()), None)
    assert written == ["000000000000.txt", "000000002000.txt", "000000004000.txt"]
    assert next(s.note for s in stages if s.name == "distil").endswith("; bf16 on cpu)")
    assert len(read_lines(out / "distilled.de.scored")) == TRAIN_LINES


def test_a_teacher_cut_short_by_max_time_makes_the_run_incomplete(tmp_path):
    """The student trains to its end, but from a teacher that train.max_time stopped at update 1 of 300."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    pairs = captions.parallel(380, seed=12)
    for split, lines in {"train": slice(0, 300), "valid": slice(300, 340), "test": slice(340, 380)}.items():
        for lang in ("en", "de"):
            (folder / f"{split}.{lang}").write_text("\n".join(pairs[lang][lines]) + "\n")
    recipe = _student_recipe(tmp_path, folder, beam=1, nbest=1, shortlist=False, teacher_seeds=[1])
    raw = yaml.safe_load(recipe.read_text())
    raw["recipe"].update(bleu_min=0.0, bleu_max=100.0)
    recipe.write_text(yaml.safe_dump(raw))
    teacher = yaml.safe_load(Path(raw["distillation"]["teacher_recipe"]).read_text())
    teacher["train"]["max_time"] = 1e-6
    Path(raw["distillation"]["teacher_recipe"]).write_text(yaml.safe_dump(teacher))
    out = tmp_path / "run"
    result = invoke("run", recipe, "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["stop"]["stopped_by"] == "max_steps"  # the student's training is whole
    assert report["verdict"] == "incomplete" and report["reproduced"] is None  # though 0 <= BLEU <= 100
    reason = "teacher 1's training stopped by train.max_time (1e-06 min) at update 1 of 300"
    assert report["incomplete"] == [reason]
    assert f"**incomplete**: {reason}, so the score says nothing" in (out / "report.md").read_text()


def test_sigterm_while_distilling_ends_with_one_message_and_keeps_the_parts_done(corpus, quick_teacher, tmp_path):
    recipe = _student_recipe(tmp_path, corpus, teacher=[str(quick_teacher)], beam=1, nbest=1, max_ratio=100.0)
    out = tmp_path / "run"
    stopped = run_recipe_sigterm_after_first_part(recipe, out)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    parts = out / ".distilled.de.scored.parts"
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"stopped by SIGTERM while distilling: the parts done are kept in {parts}; run the same command to resume"
    )
    assert "Traceback" not in stopped.stderr
    assert [p.name for p in parts.glob("*.txt")] == ["000000000000.txt"] and not (out / "distilled").exists()


def _starts(run: Path) -> list[int]:
    """The update each training start in ``run`` began at (RUN/metrics.jsonl's start records)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["event"] == "start"]


def test_after_the_teachers_data_changes_restart_teacher_trains_it_again_from_update_0(tmp_path):
    """A teacher whose training data changed refuses to resume, naming --restart teacher; with it the teacher trains
    from update 0, which makes new distilled data, so the student is refused next, naming --restart train."""
    student, teacher = tmp_path / "student-corpus", tmp_path / "teacher-corpus"
    pairs = captions.parallel(380, seed=13)
    for folder in (student, teacher):
        folder.mkdir()
        for split, lines in {"train": slice(0, 300), "valid": slice(300, 340), "test": slice(340, 380)}.items():
            for lang in ("en", "de"):
                (folder / f"{split}.{lang}").write_text("\n".join(pairs[lang][lines]) + "\n")
    recipe = _student_recipe(tmp_path, student, beam=1, nbest=1, max_ratio=100.0, shortlist=False, teacher_seeds=[1])
    raw = yaml.safe_load(recipe.read_text())
    raw["train"].update(max_steps=4, device="cpu")
    recipe.write_text(yaml.safe_dump(raw))
    teacher_recipe = Path(raw["distillation"]["teacher_recipe"])
    teacher_raw = yaml.safe_load(_teacher_recipe(tmp_path, teacher).read_text())
    teacher_raw["train"].update(max_steps=2, valid_every=0, save_every=1, device="cpu")  # 2 updates: not yet EOS
    teacher_recipe.write_text(yaml.safe_dump(teacher_raw))
    out = tmp_path / "run"
    result = invoke("run", recipe, "--out", out)
    assert result.exit_code == 0, result.output
    (teacher / "train.de").write_text("\n".join(pairs["de"][:290]) + "\n" + "\n".join(pairs["de"][:10]) + "\n")

    result = invoke("run", recipe, "--out", out)
    refused_as_trained_on_other_data(result, out / "teacher-1" / "checkpoints", "teacher")

    weights = out / "teacher-1" / "checkpoints" / "update-00000002" / checkpoint.WEIGHTS_FILE
    before = weights.read_bytes()
    result = invoke("run", recipe, "--out", out, "--restart", "teacher")
    assert result.stderr.strip().splitlines()[-1].endswith("run `mtkit run` with --restart train")
    assert result.exit_code == 1 and "Traceback" not in result.output  # its new translations are the student's data
    assert weights.read_bytes() != before and _starts(out / "teacher-1") == [0]  # trained again from update 0

    result = invoke("run", recipe, "--out", out, "--restart", "train")
    assert result.exit_code == 0, result.output
    ran = {s["name"]: s["ran"] for s in json.loads((out / "report.json").read_text())["stages"]}
    assert not ran["teacher 1"] and not ran["distil"] and ran["train"]
    assert _starts(out) == [0] and _starts(out / "teacher-1") == [0, 2]  # the teacher only found itself done


def test_sigterm_in_a_run_with_restart_says_to_resume_without_it(corpus, quick_teacher, tmp_path):
    """The same command would start the training over again: the way to resume is the command less --restart."""
    recipe = _student_recipe(tmp_path, corpus, teacher=[str(quick_teacher)], beam=1, nbest=1, max_ratio=100.0)
    stopped = run_recipe_sigterm_after_first_part(recipe, tmp_path / "run", "--restart", "train")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM while distilling: the parts done are kept in ")
    assert last.endswith("; run the command again without --restart to resume")


def test_a_training_stopped_in_a_command_with_restart_says_to_resume_without_it(
    corpus, quick_teacher, tmp_path, monkeypatch
):
    def stopped(*args, **kwargs):
        raise TrainingStopped(signal.SIGTERM, 3)

    monkeypatch.setattr(mtkit.workflows.recipe, "run_recipe", stopped)
    monkeypatch.setattr(trainer, "run_training", stopped)
    recipe = _student_recipe(tmp_path, corpus, teacher=[str(quick_teacher)])
    for command in (["run", recipe, "--restart", "train"], ["train", quick_teacher.parent / "quick.yaml", "--restart"]):
        result = invoke(*command, "--out", tmp_path / "out")
        assert result.exit_code == 128 + signal.SIGTERM, result.output
        assert result.stderr.strip().splitlines()[-1] == (
            f"stopped by SIGTERM at update 3: last checkpoint saved in {tmp_path / 'out'}; "
            "run the command again without --restart to resume"
        )
