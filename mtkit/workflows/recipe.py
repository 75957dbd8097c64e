"""A recipe end to end: prepare, train, average, translate the test set, score (with recipe.comet, COMET too),
report (mtkit.workflows.report).

Each stage leaves files in the run directory that the next run recognises (mtkit.workflows.stages records
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
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock

from mtkit.config import ConfigError, RunConfig
from mtkit.model.checkpoint import WEIGHTS_FILE, weights_file
from mtkit.workflows.report import build_report, distillation_section, write_report
from mtkit.workflows.stages import Digests, Stage, StageRecord, run_stage, train_stage

if TYPE_CHECKING:
    from mtkit.scoring.metrics import Score
    from mtkit.training.reporting import Reporter

log = logging.getLogger("mtkit")


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
        tests = [TestSet(f"{cfg.data.src_lang}-{cfg.data.tgt_lang}", cfg.data.tgt_lang, *test, cfg.data.src_lang)]

    record = StageRecord(out, Digests())
    distillation = None
    if cfg.distillation.enabled:
        from mtkit.workflows.distillation import distil

        def run_teacher(teacher: RunConfig, folder: Path) -> dict:
            again = ("train",) if "teacher" in restart else ()
            teacher_recipe = Path(cfg.distillation.teacher_recipe)
            return run_recipe(teacher, teacher_recipe, folder, mirror, reporter, again, "teacher")

        distillation = distil(cfg, out, stages, record, run_teacher)
        cfg = distillation.cfg
    if cfg.backtranslation.monolingual:
        from mtkit.workflows.backtranslation import back_translate

        cfg = back_translate(cfg, out, stages, record, reporter, restart)

    with run_stage(stages, "train"):
        train_stage(cfg, out, reporter, stage, "train" in restart)

    model = _average(cfg, out, stages, record)
    results = [_test(cfg, model, test, out, stages, record, several=len(tests) > 1) for test in tests]
    distilled = None
    if distillation is not None:
        from mtkit.workflows.comparison import compare

        comparison = compare(cfg, distillation, model, tests[0].source, tests[0].reference, out, stages, record)
        distilled = distillation_section(distillation, comparison)
    report = build_report(cfg, recipe, out, model, corpus, source, results, stages, distilled)
    write_report(out, report)
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
    src_lang: str = ""


def _test(
    cfg: RunConfig, model: Path, test: TestSet, out: Path, stages: list[Stage], record: StageRecord, several: bool
) -> dict:
    """Translate one test set (unless its translation is up to date) and score it (with recipe.comet, COMET too,
    its model loaded in the eval stage, so that it never sits in memory beside the translating model): its part
    of the report."""
    from mtkit.data.parallel import read_lines
    from mtkit.scoring.metrics import REPORT_METRICS, corpus_scores

    hyp_path, hyp_record = _translate(cfg, model, test, out, stages, record, several)
    with run_stage(stages, f"eval {test.direction}" if several else "eval") as stage:
        hyps, refs = read_lines(hyp_path), read_lines(test.reference)
        scores = corpus_scores(hyps, [refs], REPORT_METRICS)
        if cfg.recipe.comet:
            scores.append(_comet_score(cfg, read_lines(test.source), hyps, refs))
        stage.note = f"{hyp_path.name} from model sha256 {hyp_record['inputs']['model'][:12]}"
    return {
        "direction": test.direction,
        "source": str(test.source),
        "reference": str(test.reference),
        "hypothesis": str(hyp_path),
        "model_sha256": hyp_record["inputs"]["model"],
        "decode": hyp_record["settings"]["decode"],
        "scores": [score.to_dict() for score in scores],
    }


def _comet_score(cfg: RunConfig, sources: list[str], hyps: list[str], refs: list[str]) -> Score:
    """The test set's score by recipe.comet's model, on train.device in fp32."""
    from mtkit.scoring.comet import Comet
    from mtkit.scoring.learned_metrics import as_score

    comet = Comet.load(cfg.recipe.comet, device=cfg.train.device)
    return as_score(comet.score(sources, [hyps], [refs] if comet.needs_references else None)[0])


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
        with run_stage(stages, "prepare") as stage:
            prepared = prepare_corpus(spec, data_dir, mirror)
            stage.ran, stage.note = record.stat().st_mtime_ns != before, str(data_dir)

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
                with run_stage(stages, f"prepare {spec.name}") as stage:
                    prepare_corpus(spec, folder, mirror)
                    stage.ran, stage.note = (folder / RECORD).stat().st_mtime_ns != before, str(folder)
            corpus = replace(corpus, corpus="", prepared=str(folder))
        corpora.append(corpus)
        if folder is not None:
            folders.append(folder)
            source, reference = (folder / f"test.{lang}" for lang in (corpus.src_lang, corpus.tgt_lang))
            if source.is_file() and reference.is_file():
                tests.append(TestSet(corpus.direction, corpus.tgt_lang, source, reference, corpus.src_lang))
    if not tests:
        raise ConfigError("no corpus of data.corpora has a test split: name catalogue corpora (corpus: NAME)")
    twice = sorted({t.direction for t in tests if [u.direction for u in tests].count(t.direction) > 1})
    if twice:
        raise ConfigError(f"data.corpora has two test splits for {', '.join(twice)}: keep one corpus with a test split")
    cache = cfg.data.cache_dir or str(folders[0] / "encoded")
    return replace(cfg, data=replace(cfg.data, corpora=tuple(corpora), cache_dir=cache)), tests, None


def _average(cfg: RunConfig, out: Path, stages: list[Stage], record: StageRecord) -> Path:
    """The model to score: the mean of the newest ``recipe.average_last`` checkpoints, or best/."""
    from mtkit.model.loading import resolve
    from mtkit.model.run_folder import run_checkpoints
    from mtkit.training.averaging import write_average

    k = cfg.recipe.average_last
    checkpoints = run_checkpoints(out)[-k:] if k else []
    if len(checkpoints) < 2:
        note = "recipe.average_last is 0" if not k else f"{len(checkpoints)} checkpoint(s), nothing to average"
        stages.append(Stage("average", 0.0, False, f"scoring best/ ({note})"))
        return resolve(out)
    target = out / f"average-last{k}.safetensors"
    with run_stage(stages, "average") as stage:
        weights = [c / WEIGHTS_FILE for c in checkpoints]
        inputs = {str(w.relative_to(out)): record.digests.of(w) for w in weights}
        names = [c.name for c in checkpoints]
        if stage.out_of_date(record, target, inputs, {"average_last": k, "checkpoints": names}):
            write_average(checkpoints, target)
        stage.note = f"the newest {len(names)} checkpoints, {names[0]} to {names[-1]}"
    return target


def _translate(
    cfg: RunConfig, model: Path, test: TestSet, out: Path, stages: list[Stage], record: StageRecord, several: bool
) -> tuple[Path, dict]:
    """A test set's translation, and the record of the model, source and settings it was made with."""
    hyp_path = out / (f"test.{test.direction}.hyp.{test.tgt_lang}" if several else f"test.hyp.{test.tgt_lang}")
    with run_stage(stages, f"translate {test.direction}" if several else "translate") as stage:
        inputs = {"model": record.digests.of(weights_file(model)), "source": record.digests.of(test.source)}
        decode = asdict(cfg.decode)
        if stage.out_of_date(record, hyp_path, inputs, {"decode": decode}):
            _write_translation(cfg, model, test, hyp_path)
        stage.note = _decode_note(decode)
    return hyp_path, stage.entry


def _write_translation(cfg: RunConfig, model: Path, test: TestSet, hyp_path: Path) -> None:
    from mtkit.data.parallel import read_lines
    from mtkit.decoding.line_translator import Translator, chunked
    from mtkit.files import atomic_write
    from mtkit.model.loading import load_for_inference
    from mtkit.runtime import pick_device

    device = pick_device(cfg.train.device)
    bundle = load_for_inference(model, device)
    translator = Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, cfg.decode, device)
    translator.data = bundle.cfg.data
    translator = translator.into(test.tgt_lang, test.src_lang or None)
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
