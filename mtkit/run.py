"""A recipe end to end: prepare, train, average, translate the test set, score, report.

Each stage leaves files in the run directory that the next run recognises (mtkit.stages records
them), so re-running after an interruption (or after changing only the decoding) redoes only what is
missing or out of date: prepare keeps prepare.json, training resumes from its newest checkpoint (and
stops at once when it is done). The average and the translation are up to date only when
RUN/stages.json records that their output was made from the inputs they would read now (by SHA-256
of the checkpoint weights, the model, the test source) with the settings they would use now (the
averaged checkpoints and K; every decode.* value); otherwise they are redone. So a new decode.*
value, a new recipe.average_last, training that added checkpoints, or an edited output redoes what
depends on it. A missing, damaged or hand-edited RUN/stages.json redoes both stages, never stops the
run.

A training that cannot resume because its data changed (a chain's earlier stage made new data) is refused in one
line naming ``--restart NAME``, which starts that training over (``RESTARTABLE``).

The report (RUN/report.md and RUN/report.json, with RUN/curves.png when matplotlib is installed)
gives the test scores with their signatures, says whether they fall in the recipe's expected range
("incomplete" instead when train.max_time stopped a training before its max_steps: the run's own, a
reverse model's or a teacher's, each named in report.json's ``incomplete``), the hardware and
precision training ran in, and each stage's wall clock. It describes the hypothesis it scores from the
record made with that hypothesis: the decode settings (the translate note, report.json's test.decode) and the SHA-256
of the model that wrote it (report.json's test.model_sha256; its first 12 digits in the eval note).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock

from mtkit.config import ConfigError, RunConfig
from mtkit.model.checkpoint import WEIGHTS_FILE, weights_file

if TYPE_CHECKING:
    from mtkit.training.reporting import Reporter
from mtkit.files import atomic_write_text
from mtkit.stages import Digests, Stage, StageRecord, train_stage

log = logging.getLogger("mtkit")

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
CURVES = "curves.png"


def run_recipe(
    cfg: RunConfig,
    recipe: Path,
    out: Path,
    mirror: str | None,
    reporter: Reporter | None = None,
    restart: Collection[str] = (),
    stage: str = "train",
) -> dict:
    """Run every stage of ``cfg``'s recipe into ``out``; returns the report. ``reporter`` shows training's
    progress; a signal stops training with ``TrainingStopped``, after its checkpoint, and a chain's translation
    with ``StageStopped``, keeping its finished parts. ``restart`` names this run's trainings to start over from
    update 0 (``RESTARTABLE``); ``stage`` is what a refusal to resume this run's own training calls it for
    `mtkit run --restart`: ``train``, or ``teacher`` in a teacher's run."""
    check_restart(cfg, restart)
    stages: list[Stage] = []
    if importlib.util.find_spec("matplotlib") is None:  # said now, not after an hour of training
        log.warning("no training curves: pip install matplotlib to draw them")
    corpus = cfg.recipe.corpus
    if cfg.data.corpora:
        corpus = ", ".join(c.corpus or c.prepared or c.train_src for c in cfg.data.corpora)
        cfg, tests, source = _prepare_corpora(cfg, out, mirror, stages)
    else:
        cfg, test, source = _prepare(cfg, out, mirror, stages)
        tests = [TestSet(f"{cfg.data.src_lang}-{cfg.data.tgt_lang}", cfg.data.tgt_lang, *test)]

    record = StageRecord(out, Digests())
    distillation = None
    if cfg.distillation.enabled:
        from mtkit.distillation import distil

        def run_teacher(teacher: RunConfig, folder: Path) -> dict:
            again = ("train",) if "teacher" in restart else ()
            teacher_recipe = Path(cfg.distillation.teacher_recipe)
            return run_recipe(teacher, teacher_recipe, folder, mirror, reporter, again, "teacher")

        distillation = distil(cfg, out, stages, record, run_teacher)
        cfg = distillation.cfg
    if cfg.backtranslation.monolingual:
        from mtkit.backtranslation import back_translate

        cfg = back_translate(cfg, out, stages, record, reporter, restart)

    start = time.perf_counter()
    train_stage(cfg, out, reporter, stage, "train" in restart)
    stages.append(Stage("train", time.perf_counter() - start, True))

    model = _average(cfg, out, stages, record)
    results = [_test(cfg, model, test, out, stages, record, several=len(tests) > 1) for test in tests]
    distilled = None
    if distillation is not None:
        from mtkit.distillation import compare, report_section

        comparison = compare(cfg, distillation, model, tests[0].source, tests[0].reference, out, stages, record)
        distilled = report_section(distillation, comparison)
    report = _report(cfg, recipe, out, model, corpus, source, results, stages, distilled)
    _write_report(out, report)
    return report


RESTARTABLE = ("train", "reverse", "teacher")  # what `mtkit run --restart` starts over: the run's own training, the
# back-translation chain's reverse model, the distillation chain's teachers


def check_restart(cfg: RunConfig, restart: Collection[str]) -> None:
    """ConfigError, in one line, for a training to start over that this run does not have."""
    backtranslation, distillation = cfg.backtranslation, cfg.distillation
    trains = {
        "train": True,
        "reverse": bool(backtranslation.monolingual and not backtranslation.reverse_model),
        "teacher": bool(distillation.enabled and distillation.teacher_recipe),
    }
    has = [name for name in RESTARTABLE if trains[name]]
    for name in restart:
        if name not in has:
            raise ConfigError(f"--restart {name}: this run has no such training; it trains {', '.join(has)}")


@dataclass(frozen=True)
class TestSet:
    """One direction's test split: what `mtkit run` translates and scores."""

    direction: str  # SRC-TGT
    tgt_lang: str
    source: Path
    reference: Path


def _test(
    cfg: RunConfig, model: Path, test: TestSet, out: Path, stages: list[Stage], record: StageRecord, several: bool
) -> dict:
    """Translate one test set (unless its translation is up to date) and score it: its part of the report."""
    from mtkit.data.parallel import read_lines
    from mtkit.scoring.metrics import REPORT_METRICS, corpus_scores

    hyp_path, hyp_record = _translate(cfg, model, test, out, stages, record, several)
    start = time.perf_counter()
    scores = corpus_scores(read_lines(hyp_path), [read_lines(test.reference)], REPORT_METRICS)
    note = f"{hyp_path.name} from model sha256 {hyp_record['inputs']['model'][:12]}"
    stages.append(Stage(f"eval {test.direction}" if several else "eval", time.perf_counter() - start, True, note))
    return {
        "direction": test.direction,
        "source": str(test.source),
        "reference": str(test.reference),
        "hypothesis": str(hyp_path),
        "model_sha256": hyp_record["inputs"]["model"],
        "decode": hyp_record["settings"]["decode"],
        "scores": [score.to_dict() for score in scores],
    }


def _prepare(
    cfg: RunConfig, out: Path, mirror: str | None, stages: list[Stage]
) -> tuple[RunConfig, tuple[Path, Path], dict | None]:
    """The config with data.* pointing at the prepared corpus, the test (source, reference) files, and
    what prepare.json says of a Hub corpus's source (dataset, config, the commit it resolved to)."""
    r = cfg.recipe
    if not r.corpus:
        raise ConfigError("recipe.corpus is not set: `mtkit run` needs a corpus from `mtkit prepare --list`")
    from mtkit.data.corpora import find_corpus
    from mtkit.data.preparation import RECORD, prepare_corpus, shared_folder

    spec = find_corpus(r.corpus)
    if (spec.src_lang, spec.tgt_lang) != (cfg.data.src_lang, cfg.data.tgt_lang):
        raise ConfigError(
            f"recipe.corpus {spec.name} is {spec.src_lang}->{spec.tgt_lang}, "
            f"but data.src_lang/tgt_lang say {cfg.data.src_lang}->{cfg.data.tgt_lang}"
        )
    data_dir = Path(r.data_dir) if r.data_dir else shared_folder(spec)
    record = data_dir / RECORD
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(data_dir.parent / f".{data_dir.name}.lock"):  # two runs may prepare it at once
        before = record.stat().st_mtime_ns if record.exists() else None
        start = time.perf_counter()
        prepared = prepare_corpus(spec, data_dir, mirror)
    stages.append(Stage("prepare", time.perf_counter() - start, record.stat().st_mtime_ns != before, str(data_dir)))

    def path(split: str, lang: str) -> str:
        return str(data_dir / f"{split}.{lang}")

    src, tgt = spec.src_lang, spec.tgt_lang
    data = replace(
        cfg.data,
        train_src=path("train", src),
        train_tgt=path("train", tgt),
        valid_src=path("valid", src),
        valid_tgt=path("valid", tgt),
        cache_dir=cfg.data.cache_dir or str(data_dir / "encoded"),
    )
    test = (Path(path("test", src)), Path(path("test", tgt)))
    return replace(cfg, data=data), test, prepared.get("source")


def _prepare_corpora(
    cfg: RunConfig, out: Path, mirror: str | None, stages: list[Stage]
) -> tuple[RunConfig, list[TestSet], dict | None]:
    """``_prepare`` for data.corpora: each catalogue corpus prepared into its shared folder and given as files, each
    corpus with a test split (a catalogue corpus's, or a prepared folder's test.*) tested on."""
    if cfg.recipe.corpus:
        raise ConfigError("recipe.corpus names one corpus; with data.corpora, name each corpus in its corpus key")
    from mtkit.data.corpora import find_corpus
    from mtkit.data.preparation import RECORD, prepare_corpus, shared_folder

    corpora, tests, folders = [], [], []
    for i, corpus in enumerate(cfg.data.corpora):
        folder = Path(corpus.prepared) if corpus.prepared else None
        if corpus.corpus:
            spec = find_corpus(corpus.corpus)
            if spec.langs != (corpus.src_lang, corpus.tgt_lang):
                raise ConfigError(
                    f"data.corpora[{i}]: corpus {spec.name} is {spec.src_lang}->{spec.tgt_lang}, but its src_lang/"
                    f"tgt_lang say {corpus.src_lang}->{corpus.tgt_lang}"
                )
            folder = Path(cfg.recipe.data_dir) / spec.name if cfg.recipe.data_dir else shared_folder(spec)
            folder.parent.mkdir(parents=True, exist_ok=True)
            with filelock.FileLock(folder.parent / f".{folder.name}.lock"):  # two runs may prepare it at once
                before = (folder / RECORD).stat().st_mtime_ns if (folder / RECORD).exists() else None
                start = time.perf_counter()
                prepare_corpus(spec, folder, mirror)
            ran = (folder / RECORD).stat().st_mtime_ns != before
            stages.append(Stage(f"prepare {spec.name}", time.perf_counter() - start, ran, str(folder)))
            corpus = replace(corpus, corpus="", prepared=str(folder))
        corpora.append(corpus)
        if folder is not None:
            folders.append(folder)
            source, reference = (folder / f"test.{lang}" for lang in (corpus.src_lang, corpus.tgt_lang))
            if source.is_file() and reference.is_file():
                tests.append(TestSet(corpus.direction, corpus.tgt_lang, source, reference))
    if not tests:
        raise ConfigError("no corpus of data.corpora has a test split: name catalogue corpora (corpus: NAME)")
    twice = sorted({t.direction for t in tests if [u.direction for u in tests].count(t.direction) > 1})
    if twice:
        raise ConfigError(f"data.corpora has two test splits for {', '.join(twice)}: keep one corpus with a test split")
    cache = cfg.data.cache_dir or str(folders[0] / "encoded")
    return replace(cfg, data=replace(cfg.data, corpora=tuple(corpora), cache_dir=cache)), tests, None


def _average(cfg: RunConfig, out: Path, stages: list[Stage], record: StageRecord) -> Path:
    """The model to score: the mean of the newest ``recipe.average_last`` checkpoints, or best/."""
    from mtkit.model.loading import resolve, run_checkpoints
    from mtkit.training.averaging import write_average

    k = cfg.recipe.average_last
    checkpoints = run_checkpoints(out)[-k:] if k else []
    if len(checkpoints) < 2:
        note = "recipe.average_last is 0" if not k else f"{len(checkpoints)} checkpoint(s), nothing to average"
        stages.append(Stage("average", 0.0, False, f"scoring best/ ({note})"))
        return resolve(out)
    target = out / f"average-last{k}.safetensors"
    start = time.perf_counter()
    weights = [c / WEIGHTS_FILE for c in checkpoints]
    inputs = {str(w.relative_to(out)): record.digests.of(w) for w in weights}
    settings = {"average_last": k, "checkpoints": [c.name for c in checkpoints]}
    entry = record.current("average", target, inputs, settings)
    ran = entry is None
    if ran:
        write_average(checkpoints, target)
        entry = record.write("average", target, inputs, settings)
    names = entry["settings"]["checkpoints"]
    note = f"the newest {len(names)} checkpoints, {names[0]} to {names[-1]}"
    stages.append(Stage("average", time.perf_counter() - start, ran, note))
    return target


def _translate(
    cfg: RunConfig, model: Path, test: TestSet, out: Path, stages: list[Stage], record: StageRecord, several: bool
) -> tuple[Path, dict]:
    """A test set's translation, and the record of the model, source and settings it was made with."""
    hyp_path = out / (f"test.{test.direction}.hyp.{test.tgt_lang}" if several else f"test.hyp.{test.tgt_lang}")
    stage = f"translate {test.direction}" if several else "translate"
    start = time.perf_counter()
    inputs = {"model": record.digests.of(weights_file(model)), "source": record.digests.of(test.source)}
    settings = {"decode": asdict(cfg.decode)}
    entry = record.current(stage, hyp_path, inputs, settings)
    ran = entry is None
    if ran:
        _write_translation(cfg, model, test, hyp_path)
        entry = record.write(stage, hyp_path, inputs, settings)
    stages.append(Stage(stage, time.perf_counter() - start, ran, _decode_note(entry["settings"]["decode"])))
    return hyp_path, entry


def _write_translation(cfg: RunConfig, model: Path, test: TestSet, hyp_path: Path) -> None:

    from mtkit.data.parallel import read_lines
    from mtkit.decoding.translate import Translator, chunked
    from mtkit.files import atomic_write
    from mtkit.model.loading import load_for_inference
    from mtkit.runtime import pick_device

    device = pick_device(cfg.train.device)
    bundle = load_for_inference(model, device)
    translator = Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, cfg.decode, device)
    translator.data = bundle.cfg.data
    translator = translator.into(test.tgt_lang)
    source = test.source

    def write(f) -> None:
        for best in translator.stream(chunked(read_lines(source))):
            f.write((best[0].text + "\n").encode("utf-8"))

    atomic_write(hyp_path, write)


def _decode_note(decode: dict[str, Any]) -> str:
    """The decode settings that shape a translation, in a few words (batching does not)."""
    max_len = f"{decode['max_len_a']:g} * source + {decode['max_len_b']}"
    power = " (power)" if decode["length_penalty"] == "power" else ""
    note = f"beam {decode['beam']}, lenpen {decode['lenpen']:g}{power}, max_len {max_len}"
    if decode["min_len"]:
        note += f", min_len {decode['min_len']}"
    return note if decode["early_stop"] else note + ", early_stop false"


def _training_records(out: Path) -> dict[str, list[dict]]:
    """RUN/metrics.jsonl's records by event (train, valid, start, done), each with an int step; a torn or edited
    line, or a record whose fields have the wrong types, is skipped, not fatal."""
    numbers = {"train": ("loss",), "valid": ("valid_loss", "valid_bleu"), "start": (), "done": ("max_steps",)}
    texts = {"start": ("hardware", "precision", "reason"), "done": ("stopped_by", "reason")}
    events: dict[str, list[dict]] = {event: [] for event in numbers}
    path = out / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        event = record.get("event")
        if event not in events:
            continue
        optional = {"valid_bleu": 0.0}  # validation without BLEU (train.valid_bleu: false)
        if all(isinstance(record.get(key, optional.get(key)), (int, float)) for key in numbers[event]) and all(
            isinstance(record.get(key), str) for key in texts.get(event, ())
        ):
            events[event].append(record)
    return events


def _origin(source: dict | None) -> str:
    """`` (hf:wmt/wmt14 de-en at commit b199e40...)``: where a Hub corpus came from; empty otherwise."""
    if not source:
        return ""
    parts = [f"hf:{source['dataset']}", *(str(source[k]) for k in ("config", "data_dir") if source.get(k))]
    revision = source.get("revision")
    return f" ({' '.join(parts)}{f' at commit {revision}' if revision else ''})"


def _report(
    cfg: RunConfig,
    recipe: Path,
    out: Path,
    model: Path,
    corpus: str,
    source: dict | None,
    results: list[dict],
    stages: list[Stage],
    distillation: dict | None = None,
) -> dict:
    """The report of a run: with one test set, its scores (and ``test``, where they come from); with several
    (data.corpora), each direction's under ``directions`` and their means under ``scores``, which the verdict
    judges; with ``distillation``, the teacher and the student compared (mtkit.distillation)."""
    r = cfg.recipe
    events = _training_records(out)
    train, valid = events["train"], events["valid"]
    scores = results[0]["scores"] if len(results) == 1 else _mean_scores(results)
    bleu = next(s for s in scores if s["name"] == "BLEU")
    done = events["done"][-1] if events["done"] else None
    cut = [s.incomplete for s in stages if s.incomplete]  # a reverse model or a teacher cut short
    if done is not None and done["stopped_by"] == "max_time":
        cut.append(f"training {done['reason']}")
    incomplete = bool(cut)
    if incomplete:
        verdict = "incomplete"  # the score of a model cut short, or made with one, says nothing of the recipe
    else:
        verdict = "reproduced" if r.bleu_min <= bleu["value"] <= r.bleu_max else "not reproduced"
    best = max(valid, key=lambda v: v.get("valid_bleu", float("-inf")), default=None)
    plot = _plot(out, train, valid)
    tested = {key: value for key, value in results[0].items() if key not in ("direction", "scores")}
    return {
        "recipe": str(recipe),
        "corpus": corpus,
        "corpus_source": source,
        "run_dir": str(out),
        "model": str(model),
        "test": tested if len(results) == 1 else None,
        "directions": results if len(results) > 1 else None,
        "scores": scores,
        "expected": {"bleu_min": r.bleu_min, "bleu_max": r.bleu_max, "source": r.expected, "hardware": r.hardware},
        "verdict": verdict,
        "reproduced": None if incomplete else verdict == "reproduced",
        "incomplete": cut,
        "training": {
            "updates": max((r["step"] for r in train + valid), default=0),
            "stop": {key: done[key] for key in ("stopped_by", "reason", "max_steps")} if done else None,
            "machines": _machines(events["start"]),
            "best_valid_bleu": best.get("valid_bleu") if best else None,
            "best_valid_step": best["step"] if best else None,
            "validations": [_validation(v) for v in valid],
        },
        "distillation": distillation,
        "curves": plot,
        "stages": [asdict(s) for s in stages],
        "seconds": sum(s.seconds for s in stages),
    }


def _validation(record: dict) -> dict:
    """A validation as the report lists it; per direction too where the run validates several."""
    entry = {"step": record["step"], "bleu": record.get("valid_bleu"), "loss": record["valid_loss"]}
    by_direction = record.get("valid_bleu_by_direction")
    if isinstance(by_direction, dict) and all(isinstance(v, (int, float)) for v in by_direction.values()):
        entry["bleu_by_direction"] = by_direction
    return entry


def _mean_scores(results: list[dict]) -> list[dict]:
    """Each metric's mean over the directions tested, labelled as such (a mean is not a sacreBLEU score)."""
    names = ", ".join(result["direction"] for result in results)
    means = []
    for i, first in enumerate(results[0]["scores"]):
        value = sum(result["scores"][i]["value"] for result in results) / len(results)
        means.append(
            {"name": first["name"], "value": value, "signature": f"mean over {names}; each: {first['signature']}",
             "details": "", "comparable": first["comparable"], "verbose": ""}
        )  # fmt: skip
    return means


def _machines(starts: list[dict]) -> list[dict]:
    """Where training ran: the hardware and precision of each start that differs from the one before it."""
    machines: list[dict] = []
    for start in starts:
        machine = {key: start[key] for key in ("step", "hardware", "precision", "reason")}
        if not machines or {**machines[-1], "step": 0} != {**machine, "step": 0}:
            machines.append(machine)
    return machines


def _plot(out: Path, train: list[dict], valid: list[dict]) -> str | None:
    """Training loss and validation BLEU by update, as RUN/curves.png; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # run_recipe has said so
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot([t["step"] for t in train], [t["loss"] for t in train], label="train (label-smoothed)")
    left.plot([v["step"] for v in valid], [v["valid_loss"] for v in valid], "o-", label="valid")
    left.set(xlabel="update", ylabel="loss", title="loss")
    left.legend()
    bleu = [v for v in valid if "valid_bleu" in v]
    right.plot([v["step"] for v in bleu], [v["valid_bleu"] for v in bleu], "o-")
    right.set(xlabel="update", ylabel="BLEU", title="validation BLEU (sacreBLEU)")
    fig.tight_layout()
    tmp = out / f".{CURVES}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out / CURVES)
    return CURVES


def _write_report(out: Path, report: dict) -> None:
    atomic_write_text(out / REPORT_JSON, json.dumps(report, indent=1) + "\n")
    atomic_write_text(out / REPORT_MD, render_report(report))


def render_report(report: dict) -> str:
    """The report as Markdown."""
    e, t = report["expected"], report["training"]
    bleu = next(s for s in report["scores"] if s["name"] == "BLEU")
    verdict = {"reproduced": "**reproduced**", "not reproduced": "**NOT reproduced**"}.get(report["verdict"])
    if verdict is None:
        verdict = f"**incomplete**: {'; '.join(report['incomplete'])}, so the score says nothing of the recipe"
    lines = [
        f"# {Path(report['recipe']).stem}",
        "",
        f"Test BLEU {bleu['value']:.2f}: {verdict} (expected {e['bleu_min']:g}-{e['bleu_max']:g}"
        + (f"; {e['source']}" if e["source"] else "")
        + ").",
        "",
        f"{'Corpora' if report.get('directions') else 'Corpus'} `{report['corpus']}`"
        f"{_origin(report['corpus_source'])}, run directory `{report['run_dir']}`, "
        f"scored model `{report['model']}`" + (f"; the recipe expects {e['hardware']}." if e["hardware"] else "."),
        "",
        "| metric | score | signature |",
        "| --- | --- | --- |",
        *(f"| {s['name']} | {s['value']:.2f} | `{_cell(s['signature'])}` |" for s in report["scores"]),
        "",
    ]
    if report.get("directions"):
        names = [s["name"] for s in report["directions"][0]["scores"]]
        lines += [
            "| direction | " + " | ".join(names) + " | hypothesis |",
            "| --- |" + " --- |" * (len(names) + 1),
            *(
                f"| {d['direction']} | "
                + " | ".join(f"{s['value']:.2f}" for s in d["scores"])
                + f" | `{Path(d['hypothesis']).name}` |"
                for d in report["directions"]
            ),
            "",
        ]
    if t["best_valid_bleu"] is not None:
        mean = " (the mean over the directions)" if report.get("directions") else ""
        lines += [
            f"Training: {t['updates']:,} updates; best validation BLEU{mean} {t['best_valid_bleu']:.2f} "
            f"at update {t['best_valid_step']:,}.",
            "",
        ]
    for i, m in enumerate(t["machines"]):
        where = "Trained" if i == 0 else f"Resumed at update {m['step']:,}"
        lines += [f"{where} on {m['hardware']}, in {m['precision']} ({m['reason']}).", ""]
    if report.get("distillation"):
        from mtkit.distillation import render_section

        lines += render_section(report["distillation"])
    if report["curves"]:
        lines += [f"![training curves]({report['curves']})", ""]
    lines += ["| stage | wall clock | |", "| --- | --- | --- |"]
    for s in report["stages"]:
        done = "ran" if s["ran"] else "up to date"
        lines.append(f"| {s['name']} | {_duration(s['seconds'])} | {done}{'; ' + s['note'] if s['note'] else ''} |")
    lines += [f"| total | {_duration(report['seconds'])} | |", ""]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{seconds:.1f} s"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: its pipes escaped (sacreBLEU signatures are full of them)."""
    return text.replace("|", "\\|")
