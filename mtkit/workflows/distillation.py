"""Sequence-level knowledge distillation in `mtkit run` (Kim and Rush, 2016): a small, fast student trained on
a teacher's translations of the training data.

Stages before the student's training, each resumable and recorded in RUN/stages.json like the run's others:

1. ``teacher``: the models ``distillation.teacher`` names, or one `mtkit run` of ``distillation.teacher_recipe``
   per seed into RUN/teacher-SEED (each trained, averaged and scored on its test set as any run is; the later
   seeds take the first one's tokenizer). Several models decode as an ensemble. They must translate the run's
   direction and share one tokenizer, which the student takes: a config that names another tokenizer or
   another vocabulary size is refused in one line before the student trains.
2. ``distil``: the teacher translates the training source by beam search into RUN/distilled.TGT.scored, in
   parts that a stopped run keeps (mtkit.translation.resumable), keyed with the device and precision they are
   decoded in (``auto`` resolved), so that a run resumed where ``auto`` means another precision never joins
   parts of both; SIGINT/SIGTERM stops it at once (``StageStopped``). Per line: the length-normalised
   log-probability of the translation kept, a tab, and that translation. With ``nbest`` > 1 the one kept is
   the closest of the teacher's n best to the line's reference, by sentence chrF.
3. ``filter``: RUN/distilled/ receives the pairs kept, train.SRC and train.TGT, line-aligned, and
   filters.json, what each filter dropped: empty translations (a student would learn to stop at once), pairs
   whose length ratio in tokens exceeds ``max_ratio`` (repetitions and omissions), then the ``drop_worst``
   fraction of the rest that the teacher scored lowest.
4. ``pair filter``, with ``pair_filter``: RUN/dual-filtered/ receives the pairs of RUN/distilled/ that
   dual conditional cross-entropy keeps (mtkit.workflows.pair_filtering), the teacher as the forward model unless
   another is named.
5. ``shortlist``: RUN/shortlist.safetensors from the pairs the student trains on, for the student's decoding.

The student then trains on RUN/distilled/ (RUN/dual-filtered/ with ``pair_filter``) and validates on the run's real
validation set. A teacher whose training train.max_time cut short makes the run's verdict "incomplete" (its Stage
says why). After its test set is scored, the student is compared with its teacher (mtkit.workflows.comparison).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mtkit.config import ConfigError, RunConfig, ShortlistConfig, TokenizerConfig, read_config
from mtkit.data.directions import corpus_files, directions
from mtkit.data.parallel import DataError, count_lines, is_tsv, iter_lines, reading
from mtkit.decoding.line_translator import Translation
from mtkit.files import atomic_write_directory
from mtkit.model.checkpoint import weights_file
from mtkit.workflows.pair_filtering import PairsToFilter, check_settings, filter_stage
from mtkit.workflows.stages import Stage, StageRecord, decoding, run_stage

log = logging.getLogger("mtkit")

DISTILLED_DIR = "distilled"
DUAL_FILTERED_DIR = "dual-filtered"
FILTERS_FILE = "filters.json"
SHORTLIST_FILE = "shortlist.safetensors"
FILTER_CHUNK = 10_000  # pairs whose tokens are counted at once

RunTeacher = Callable[[RunConfig, Path], dict]  # `mtkit run` of a teacher's config into a folder: its report


@dataclass(frozen=True)
class Distillation:
    """What the stages before the student's training leave for it and for the report."""

    cfg: RunConfig  # the student's: the distilled pairs, the teacher's tokenizer
    teachers: tuple[Path, ...]  # the teacher's models, an ensemble when several
    filters: dict[str, int]  # pairs translated, dropped by each filter (dual_cross_entropy: pair_filter's), kept
    shortlist: Path | None


def distil(
    cfg: RunConfig, out: Path, stages: list[Stage], record: StageRecord, run_teacher: RunTeacher
) -> Distillation:
    """Run the teacher, distil, filter and shortlist stages into ``out``; ``run_teacher`` trains a teacher from its
    recipe's config (`mtkit run`)."""
    if cfg.backtranslation.monolingual:
        raise ConfigError("a run distils or back-translates, not both: train the teacher with back-translation")
    pair_filter = cfg.pair_filter
    check_settings(pair_filter, "reverse", "distilled")
    source, reference = training_files(cfg)
    lines = count_lines(source)
    if lines is None or lines != count_lines(reference):
        raise DataError(f"{source}: distillation needs plain text files of as many lines as {reference}")
    teachers = _teachers(cfg, out, stages, run_teacher)
    tokenizer = student_tokenizer(cfg, teachers)
    scored = _distil(cfg, teachers, Path(source), Path(reference), out, stages, record)
    folder, filters = _filter(cfg, tokenizer, Path(source), scored, out, stages, record)
    if pair_filter.enabled:
        ((src, tgt),) = directions(cfg.data)
        forward = (Path(pair_filter.forward),) if pair_filter.forward else teachers
        reverse = Path(pair_filter.reverse)
        pairs = PairsToFilter(folder / f"train.{src}", folder / f"train.{tgt}", (src, tgt), forward, reverse)
        folder = out / DUAL_FILTERED_DIR
        kept = filter_stage(pair_filter, pairs, folder, cfg.train.device, stages, record)
        filters = {**filters, "dual_cross_entropy": filters["kept"] - kept, "kept": kept}
    student = student_config(cfg, folder, tokenizer)
    shortlist = _shortlist(cfg, tokenizer, folder, out, stages, record) if cfg.distillation.shortlist else None
    return Distillation(student, teachers, filters, shortlist)


def training_files(cfg: RunConfig) -> tuple[str, str]:
    """The training source the teacher translates and its references: the run's one corpus."""
    data = cfg.data
    pairs = directions(data)
    if len(pairs) != 1 or len(data.corpora) > 1:
        raise ConfigError("distillation trains a student of one direction on one corpus; give data.corpora one corpus")
    if data.corpora:
        files = corpus_files(data)[0]
        source, reference = files.train_src, files.train_tgt
    else:
        source, reference = data.train_src, data.train_tgt
    if not reference or is_tsv(source):
        raise ConfigError("distillation reads the training source and its references from two files, not a .tsv")
    return source, reference


def _teachers(cfg: RunConfig, out: Path, stages: list[Stage], run_teacher: RunTeacher) -> tuple[Path, ...]:
    """The teacher's models: given, or trained now from the teacher recipe, one per seed."""
    d = cfg.distillation
    if d.teacher:
        stages.append(Stage("teacher", 0.0, False, "given: " + ", ".join(d.teacher)))
        return tuple(Path(t) for t in d.teacher)
    from mtkit.training.init_from import read_trained_model

    models: list[Path] = []
    for seed in d.teacher_seeds:
        teacher = read_config(d.teacher_recipe)
        if teacher.distillation.enabled or teacher.backtranslation.monolingual:
            raise ConfigError(f"{d.teacher_recipe}: a teacher recipe trains one model, with no stages before it")
        teacher = replace(teacher, train=replace(teacher.train, seed=seed))
        if models:  # an ensemble shares one vocabulary: the first teacher's
            first = read_trained_model(models[0])[1].tokenizer
            files = {key: getattr(first, key) for key in ("model", "src_model", "tgt_model")}
            teacher = replace(teacher, tokenizer=replace(teacher.tokenizer, **files))
        with run_stage(stages, f"teacher {seed}") as stage:
            report = run_teacher(teacher, out / f"teacher-{seed}")
            bleu = next(s["value"] for s in report["scores"] if s["name"] == "BLEU")
            # its train and eval stages always run: it ran when any other stage of it did
            stage.ran = any(s["ran"] for s in report["stages"] if s["name"] not in ("train", "eval"))
            stage.note = f"seed {seed}: {report['model']}, test BLEU {bleu:.2f}"
            # its training stopped early
            stage.incomplete = "; ".join(f"teacher {seed}'s {why}" for why in report["incomplete"])
        models.append(Path(report["model"]))
    return tuple(models)


def student_tokenizer(cfg: RunConfig, teachers: tuple[Path, ...]) -> TokenizerConfig:
    """The student's tokenizer section: the teacher's tokenizer files and settings. ConfigError, in one line, for a
    teacher of another direction, teachers of different tokenizers, or a config that asks for another tokenizer."""
    from mtkit.training.init_from import read_trained_model, settle_tokenizer

    (direction,) = directions(cfg.data)
    first: tuple[Path, Any, RunConfig] | None = None
    for model in teachers:
        ckpt, theirs = read_trained_model(model)
        if direction not in directions(theirs.data):
            trained = ", ".join(f"{s}->{t}" for s, t in directions(theirs.data))
            raise ConfigError(f"the teacher {model} translates {trained}, not {direction[0]}->{direction[1]}")
        if first is None:
            first = (model, ckpt, theirs)
        elif _digests(ckpt) != _digests(first[1]):
            raise ConfigError(
                f"the teachers {first[0]} and {model} have different tokenizers: an ensemble shares one vocabulary"
            )
    assert first is not None  # DistillationConfig names at least one teacher
    model, ckpt, theirs = first
    keeps = "a student reads and writes its teacher's pieces"
    return settle_tokenizer(cfg.tokenizer, theirs.tokenizer, ckpt.meta["tokenizer"], f"the teacher {model}", keeps)


def _digests(ckpt: Any) -> dict[str, str]:
    return {side: record["sha256"] for side, record in ckpt.meta["tokenizer"].items()}


def _distil(
    cfg: RunConfig, teachers: tuple[Path, ...], source: Path, reference: Path, out: Path, stages: list[Stage],
    record: StageRecord,
) -> Path:  # fmt: skip
    """The teacher's translation of the training source, each line with its score (see the module docstring)."""
    from mtkit.model.loading import resolve

    d = cfg.distillation
    ((src, tgt),) = directions(cfg.data)
    scored = out / f"{DISTILLED_DIR}.{tgt}.scored"
    inputs = {f"teacher {i}": record.digests.of(weights_file(resolve(m))) for i, m in enumerate(teachers)}
    inputs["source"] = record.digests.of(source)
    if d.nbest > 1:
        inputs["reference"] = record.digests.of(reference)
    settings = {"beam": d.beam, "nbest": d.nbest}
    what = f"beam {d.beam}" + (f", of the {d.nbest} best the closest to the reference by chrF" if d.nbest > 1 else "")
    with run_stage(stages, "distil") as stage:
        if stage.out_of_date(record, scored, inputs, settings):
            from mtkit.training.stop_signals import stop_at_once
            from mtkit.translation.engines import load_translator
            from mtkit.translation.resumable import parts_folder, translate_resumably

            decoded = decoding(cfg.train.device)
            translator = load_translator(
                list(teachers), cfg.train.device, decoded["precision"], nbest=d.nbest, beam=d.beam
            ).into(tgt, src)
            render = _closest(_LinesAt(reference)) if d.nbest > 1 else _best
            made_from = {"inputs": inputs, "settings": settings, "decoded": decoded}  # parts of fp32 and bf16 never mix
            with stop_at_once("distilling", str(parts_folder(scored))):
                lines = translate_resumably(
                    translator, source, scored, "distilling", render=render, made_from=made_from
                )
            where = f"{decoded['precision']} on {decoded['device']}"
            stage.note = f"{lines:,} lines of {source} by the teacher ({what}; {where})"
        else:
            stage.note = f"{scored.name} is up to date ({what})"
    return scored


def _best(index: int, hypotheses: list[Translation]) -> str:
    return _scored_line(hypotheses[0])


def _scored_line(hypothesis: Translation) -> str:
    return f"{hypothesis.score:.6g}\t{hypothesis.text.replace(chr(9), ' ')}"


def _closest(references: _LinesAt) -> Callable[[int, list[Translation]], str]:
    """A render for translate_resumably: of a line's hypotheses, the one of highest sentence chrF against its
    reference (the better-ranked one on a tie)."""
    from mtkit.scoring.metrics import sentence_scores

    def render(index: int, hypotheses: list[Translation]) -> str:
        texts = [h.text for h in hypotheses]
        chrf = sentence_scores(texts, [[references[index]] * len(texts)], ("chrf",))[0].values
        return _scored_line(hypotheses[max(range(len(texts)), key=lambda i: (chrf[i], -i))])

    return render


class _LinesAt:
    """The lines of a file by index, read forward once: each index asked for is above the one before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: Iterator[str] = iter_lines(path, allow_nul=True)
        self._next = 0

    def __getitem__(self, index: int) -> str:
        if index < self._next:
            raise IndexError(f"{self.path}: line {index + 1} was read already")
        with reading(self.path):
            line = next(itertools.islice(self._lines, index - self._next, None), None)
        if line is None:
            raise DataError(f"{self.path}: has no line {index + 1}")
        self._next = index + 1
        return line


def _filter(
    cfg: RunConfig, tokenizer: TokenizerConfig, source: Path, scored: Path, out: Path, stages: list[Stage],
    record: StageRecord,
) -> tuple[Path, dict[str, int]]:  # fmt: skip
    """RUN/distilled/: the pairs the filters keep, and filters.json (see the module docstring)."""
    d = cfg.distillation
    ((src, tgt),) = directions(cfg.data)
    folder = out / DISTILLED_DIR
    output = folder / f"train.{tgt}"
    inputs = {"source": record.digests.of(source), "scored": record.digests.of(scored)}
    settings = {"max_ratio": d.max_ratio, "drop_worst": d.drop_worst}
    with run_stage(stages, "filter") as stage:
        if stage.out_of_date(record, output, inputs, settings, also=(folder / f"train.{src}", folder / FILTERS_FILE)):
            from mtkit.translation.resumable import writing

            keep, filters = kept_pairs(cfg, tokenizer, source, scored)

            def fill(tmp: Path) -> None:
                with open(tmp / f"train.{src}", "wb") as s, open(tmp / f"train.{tgt}", "wb") as t:
                    with reading(source), reading(scored):
                        pairs = zip(iter_lines(source, allow_nul=True), _scored_lines(scored))
                        for kept, (line, (_, translation)) in zip(keep, pairs):
                            if kept:
                                with writing(folder):  # a full disk is not an error of reading the inputs
                                    s.write((line + "\n").encode("utf-8"))
                                    t.write((translation + "\n").encode("utf-8"))
                (tmp / FILTERS_FILE).write_text(json.dumps(filters, indent=1) + "\n")

            atomic_write_directory(folder, fill)
        else:
            filters = _read_filters(folder / FILTERS_FILE)
        dropped = ", ".join(f"{filters[k]:,} {k}" for k in ("empty", "ratio", "worst"))
        stage.note = f"{filters['kept']:,} of {filters['translated']:,} pairs kept (dropped: {dropped})"
    if not filters["kept"]:
        raise DataError(f"{scored}: the filters kept none of the teacher's {filters['translated']:,} translations")
    kept = count_lines(output)
    if kept != count_lines(folder / f"train.{src}") or kept != filters["kept"]:  # never train on misaligned pairs
        raise DataError(f"{folder}: train.{src} and train.{tgt} are not line-aligned; delete {folder} to redo it")
    return folder, filters


def kept_pairs(
    cfg: RunConfig, tokenizer: TokenizerConfig, source: Path, scored: Path
) -> tuple[np.ndarray, dict[str, int]]:
    """Whether each pair is kept, and how many each filter dropped."""

    d = cfg.distillation
    src_tok, tgt_tok = teacher_tokenizers(tokenizer)
    scores: list[float] = []
    empty: list[bool] = []
    too_long: list[bool] = []
    with reading(source), reading(scored):
        pairs = zip(iter_lines(source, allow_nul=True), _scored_lines(scored))
        while chunk := list(itertools.islice(pairs, FILTER_CHUNK)):
            sources, translations = [s for s, _ in chunk], [t for _, (_, t) in chunk]
            scores += [score for _, (score, _) in chunk]
            empty += [not t.strip() for t in translations]
            for a, b in zip(src_tok.encode(sources), tgt_tok.encode(translations)):
                longer, shorter = max(len(a), len(b)) + 1, min(len(a), len(b)) + 1  # eos included
                too_long.append(longer > d.max_ratio * shorter)
    is_empty, is_long = np.array(empty, bool), np.array(too_long, bool)
    keep = ~is_empty & ~is_long
    ratio = int((is_long & ~is_empty).sum())
    worst = int(d.drop_worst * keep.sum())
    if worst:
        candidates = np.flatnonzero(keep)
        lowest = candidates[np.argsort(np.array(scores)[candidates], kind="stable")[:worst]]
        keep[lowest] = False
    counts = {"translated": len(keep), "empty": int(is_empty.sum()), "ratio": ratio, "worst": worst}
    return keep, {**counts, "kept": int(keep.sum())}


def teacher_tokenizers(tokenizer: TokenizerConfig) -> tuple[Any, Any]:
    """The source and target tokenizers a settled tokenizer section names (one joint model, or one per side)."""
    from mtkit.data.tokenizer import Tokenizer

    return tuple(Tokenizer(Path(tokenizer.model or path)) for path in (tokenizer.src_model, tokenizer.tgt_model))


def _scored_lines(path: Path) -> Iterator[tuple[float, str]]:
    """The (score, translation) of each line of a scored file that the distil stage wrote."""
    for number, line in enumerate(iter_lines(path, allow_nul=True), 1):
        score, tab, translation = line.partition("\t")
        try:
            value = float(score)
        except ValueError:
            value = float("nan")
        if not tab or not np.isfinite(value):
            raise DataError(f"{path}: line {number}: not a score, a tab and a translation; delete it to redo it")
        yield value, translation


def _read_filters(path: Path) -> dict[str, int]:
    """filters.json as the filter stage wrote it; DataError for anything else."""
    keys = ("translated", "empty", "ratio", "worst", "kept")
    try:
        filters = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        filters = None
    if not isinstance(filters, dict) or not all(type(filters.get(k)) is int for k in keys):
        raise DataError(f"{path}: not the filter counts mtkit wrote; delete {path.parent} to redo it")
    return {k: filters[k] for k in keys}


def student_config(cfg: RunConfig, folder: Path, tokenizer: TokenizerConfig) -> RunConfig:
    """The run's config training on the distilled pairs in ``folder``, with the teacher's tokenizer; the validation
    set stays the real one."""
    ((src, tgt),) = directions(cfg.data)
    train_src, train_tgt = str(folder / f"train.{src}"), str(folder / f"train.{tgt}")
    data = cfg.data
    if data.corpora:
        files = corpus_files(data)[0]
        corpus = replace(
            data.corpora[0], train_src=train_src, train_tgt=train_tgt, prepared="", valid_src=files.valid_src,
            valid_tgt=files.valid_tgt,
        )  # fmt: skip
        data = replace(data, corpora=(corpus,))
    else:
        data = replace(data, train_src=train_src, train_tgt=train_tgt)
    return replace(cfg, data=data, tokenizer=tokenizer)


def _shortlist(
    cfg: RunConfig, tokenizer: TokenizerConfig, folder: Path, out: Path, stages: list[Stage], record: StageRecord
) -> Path:
    """RUN/shortlist.safetensors from the pairs in ``folder``, those the student trains on, with `mtkit shortlist`'s
    defaults."""
    from mtkit.decoding.shortlist import build_shortlist, co_occurring_pairs

    ((src, tgt),) = directions(cfg.data)
    target = out / SHORTLIST_FILE
    src_tok, tgt_tok = teacher_tokenizers(tokenizer)
    files = [folder / f"train.{src}", folder / f"train.{tgt}"]
    inputs = {"source": record.digests.of(files[0]), "target": record.digests.of(files[1])}
    inputs |= {"src_tokenizer": src_tok.sha256, "tgt_tokenizer": tgt_tok.sha256}
    settings = asdict(ShortlistConfig())
    with run_stage(stages, "shortlist") as stage:
        if stage.out_of_date(record, target, inputs, settings):
            sc = ShortlistConfig()
            with reading(files[0]), reading(files[1]):
                pairs = zip(iter_lines(files[0], allow_nul=True), iter_lines(files[1], allow_nul=True))
                chunks = co_occurring_pairs(src_tok, tgt_tok, pairs, sc.pairs)
                build_shortlist(chunks, src_tok, tgt_tok, sc.per_source, sc.frequent).save(target)
        candidates = f"{settings['per_source']} candidates per source token, {settings['frequent']} frequent"
        stage.note = f"{target.name}: {candidates}"
    return target
