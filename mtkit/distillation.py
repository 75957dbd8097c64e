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
4. ``shortlist``: RUN/shortlist.safetensors from the distilled pairs, for the student's decoding.

The student then trains on RUN/distilled/ and validates on the run's real validation set. A teacher whose
training train.max_time cut short makes the run's verdict "incomplete" (its Stage says why). After its test set
is scored, ``compare`` translates that test set with the teacher and with the student at each precision the
machine runs (fp32; bf16 where the device computes it natively; int8 on a CPU), with and without the shortlist,
the student greedily too, and the report sets BLEU, chrF, sentences/s, parameters and file sizes side by side.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mtkit.config import ConfigError, RunConfig, ShortlistConfig, TokenizerConfig, read_config
from mtkit.data.directions import corpus_files, directions
from mtkit.data.parallel import DataError, count_lines, is_tsv, iter_lines, read_lines, reading
from mtkit.decoding.translate import Translation
from mtkit.files import atomic_write_directory, atomic_write_text
from mtkit.model.checkpoint import weights_file
from mtkit.stages import Stage, StageRecord, decoding

log = logging.getLogger("mtkit")

DISTILLED_DIR = "distilled"
FILTERS_FILE = "filters.json"
SHORTLIST_FILE = "shortlist.safetensors"
COMPARISON_FILE = "comparison.json"
FILTER_CHUNK = 10_000  # pairs whose tokens are counted at once
WARMUP_LINES = 64  # translated once before each timed translation of the test set: kernels are built on first use

RunTeacher = Callable[[RunConfig, Path], dict]  # `mtkit run` of a teacher's config into a folder: its report


@dataclass(frozen=True)
class Distillation:
    """What the stages before the student's training leave for it and for the report."""

    cfg: RunConfig  # the student's: the distilled pairs, the teacher's tokenizer
    teachers: tuple[Path, ...]  # the teacher's models, an ensemble when several
    filters: dict[str, int]  # pairs translated, dropped by each filter, kept
    shortlist: Path | None


def distil(
    cfg: RunConfig, out: Path, stages: list[Stage], record: StageRecord, run_teacher: RunTeacher
) -> Distillation:
    """Run the teacher, distil, filter and shortlist stages into ``out``; ``run_teacher`` trains a teacher from its
    recipe's config (`mtkit run`)."""
    if cfg.backtranslation.monolingual:
        raise ConfigError("a run distils or back-translates, not both: train the teacher with back-translation")
    source, reference = training_files(cfg)
    lines = count_lines(source)
    if lines is None or lines != count_lines(reference):
        raise DataError(f"{source}: distillation needs plain text files of as many lines as {reference}")
    teachers = _teachers(cfg, out, stages, run_teacher)
    tokenizer = student_tokenizer(cfg, teachers)
    scored = _distil(cfg, teachers, Path(source), Path(reference), out, stages, record)
    folder, filters = _filter(cfg, tokenizer, Path(source), scored, out, stages, record)
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
        start = time.perf_counter()
        report = run_teacher(teacher, out / f"teacher-{seed}")
        bleu = next(s["value"] for s in report["scores"] if s["name"] == "BLEU")
        ran = any(s["ran"] for s in report["stages"] if s["name"] not in ("train", "eval"))  # those always run
        note = f"seed {seed}: {report['model']}, test BLEU {bleu:.2f}"
        cut = "; ".join(f"teacher {seed}'s {why}" for why in report["incomplete"])  # its training stopped early
        stages.append(Stage(f"teacher {seed}", time.perf_counter() - start, ran, note, cut))
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
    ((_, tgt),) = directions(cfg.data)
    scored = out / f"{DISTILLED_DIR}.{tgt}.scored"
    inputs = {f"teacher {i}": record.digests.of(weights_file(resolve(m))) for i, m in enumerate(teachers)}
    inputs["source"] = record.digests.of(source)
    if d.nbest > 1:
        inputs["reference"] = record.digests.of(reference)
    settings = {"beam": d.beam, "nbest": d.nbest}
    start = time.perf_counter()
    entry = record.current("distil", scored, inputs, settings)
    what = f"beam {d.beam}" + (f", of the {d.nbest} best the closest to the reference by chrF" if d.nbest > 1 else "")
    if entry is None:
        from mtkit.training.stop_signals import stop_at_once
        from mtkit.translation.engines import load_translator
        from mtkit.translation.resumable import parts_folder, translate_resumably

        decoded = decoding(cfg.train.device)
        translator = load_translator(
            list(teachers), cfg.train.device, decoded["precision"], nbest=d.nbest, beam=d.beam
        ).into(tgt)
        render = _closest(_LinesAt(reference)) if d.nbest > 1 else _best
        made_from = {"inputs": inputs, "settings": settings, "decoded": decoded}  # parts of fp32 and bf16 never mix
        with stop_at_once("distilling", str(parts_folder(scored))):
            lines = translate_resumably(translator, source, scored, "distilling", render=render, made_from=made_from)
        record.write("distil", scored, inputs, settings)
        note = f"{lines:,} lines of {source} by the teacher ({what}; {decoded['precision']} on {decoded['device']})"
    else:
        note = f"{scored.name} is up to date ({what})"
    stages.append(Stage("distil", time.perf_counter() - start, entry is None, note))
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
    start = time.perf_counter()
    entry = record.current("filter", output, inputs, settings)
    if entry is None or not (folder / f"train.{src}").is_file() or not (folder / FILTERS_FILE).is_file():
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
        record.write("filter", output, inputs, settings)
        ran = True
    else:
        filters, ran = _read_filters(folder / FILTERS_FILE), False
    if not filters["kept"]:
        raise DataError(f"{scored}: the filters kept none of the teacher's {filters['translated']:,} translations")
    kept = count_lines(output)
    if kept != count_lines(folder / f"train.{src}") or kept != filters["kept"]:  # never train on misaligned pairs
        raise DataError(f"{folder}: train.{src} and train.{tgt} are not line-aligned; delete {folder} to redo it")
    dropped = ", ".join(f"{filters[k]:,} {k}" for k in ("empty", "ratio", "worst"))
    note = f"{filters['kept']:,} of {filters['translated']:,} pairs kept (dropped: {dropped})"
    stages.append(Stage("filter", time.perf_counter() - start, ran, note))
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
    """RUN/shortlist.safetensors from the distilled pairs, with `mtkit shortlist`'s defaults."""
    from mtkit.decoding.shortlist import build_shortlist, co_occurring_pairs

    ((src, tgt),) = directions(cfg.data)
    target = out / SHORTLIST_FILE
    src_tok, tgt_tok = teacher_tokenizers(tokenizer)
    files = [folder / f"train.{src}", folder / f"train.{tgt}"]
    inputs = {"source": record.digests.of(files[0]), "target": record.digests.of(files[1])}
    inputs |= {"src_tokenizer": src_tok.sha256, "tgt_tokenizer": tgt_tok.sha256}
    settings = asdict(ShortlistConfig())
    start = time.perf_counter()
    entry = record.current("shortlist", target, inputs, settings)
    if entry is None:
        sc = ShortlistConfig()
        with reading(files[0]), reading(files[1]):
            pairs = zip(iter_lines(files[0], allow_nul=True), iter_lines(files[1], allow_nul=True))
            chunks = co_occurring_pairs(src_tok, tgt_tok, pairs, sc.pairs)
            build_shortlist(chunks, src_tok, tgt_tok, sc.per_source, sc.frequent).save(target)
        record.write("shortlist", target, inputs, settings)
    note = f"{target.name}: {settings['per_source']} candidates per source token, {settings['frequent']} frequent"
    stages.append(Stage("shortlist", time.perf_counter() - start, entry is None, note))
    return target


def compare(
    cfg: RunConfig, distillation: Distillation, student: Path, source: Path, reference: Path, out: Path,
    stages: list[Stage], record: StageRecord,
) -> dict:  # fmt: skip
    """Teacher and student translating the test set at each precision, with and without the shortlist: the
    report's ``distillation.comparison`` (RUN/comparison.json), remade only when a model, the test set or a
    setting changed."""
    from mtkit.model.loading import resolve
    from mtkit.runtime import pick_device

    device = pick_device(cfg.train.device)
    target = out / COMPARISON_FILE
    models = {"teacher": distillation.teachers, "student": (student,)}
    inputs = {
        f"{name} {i}": record.digests.of(weights_file(resolve(m)))
        for name, paths in models.items()
        for i, m in enumerate(paths)
    }
    inputs |= {"source": record.digests.of(source), "reference": record.digests.of(reference)}
    if distillation.shortlist is not None:
        inputs["shortlist"] = record.digests.of(distillation.shortlist)
    settings = {"decode": asdict(cfg.decode), "precisions": _precisions(device), "device": str(device)}
    start = time.perf_counter()
    entry = record.current("compare", target, inputs, settings)
    if entry is None:
        comparison = _measure(cfg, models, distillation.shortlist, source, reference, settings["precisions"])
        atomic_write_text(target, json.dumps(comparison, indent=1) + "\n")
        record.write("compare", target, inputs, settings)
    else:
        comparison = json.loads(target.read_text(encoding="utf-8"))
    note = f"{len(comparison['rows'])} translations of {source.name}, {', '.join(settings['precisions'])}"
    stages.append(Stage("compare", time.perf_counter() - start, entry is None, note))
    return comparison


def _precisions(device: Any) -> list[str]:
    """The precisions worth timing on ``device``: fp32, bf16 where it is native, int8 on a CPU."""
    from mtkit.runtime import choose_precision, cpu_features, gpu_capability

    native_bf16 = choose_precision("bf16", device.type, cpu_features(), gpu_capability(device)).native
    return ["fp32", *(["bf16"] if native_bf16 else []), *(["int8"] if device.type == "cpu" else [])]


def _measure(
    cfg: RunConfig, models: dict[str, tuple[Path, ...]], shortlist: Path | None, source: Path, reference: Path,
    precisions: list[str],
) -> dict:  # fmt: skip
    """Each model's size, and its translations of ``source`` timed and scored, one row per setting."""
    import torch

    from mtkit.model.loading import load_for_inference, resolve
    from mtkit.model.transformer import count_parameters
    from mtkit.runtime import pick_device
    from mtkit.scoring.metrics import corpus_scores
    from mtkit.translation.engines import load_translator

    device = pick_device(cfg.train.device)
    ((_, tgt),) = directions(cfg.data)
    lines, references = read_lines(source), read_lines(reference)
    sizes, rows = {}, []
    for name, paths in models.items():
        files = [weights_file(resolve(p)) for p in paths]
        bundles = [load_for_inference(path, torch.device("cpu")) for path in paths]
        parameters = sum(count_parameters(bundle.model) for bundle in bundles)
        del bundles
        sizes[name] = {"models": [str(p) for p in paths], "parameters": parameters,
                       "file_bytes": sum(f.stat().st_size for f in files)}  # fmt: skip
        beams = dict.fromkeys([cfg.decode.beam, *([1] if name == "student" else [])])
        for precision in precisions:
            for listed in [None, *([shortlist] if shortlist else [])]:
                translator = load_translator(
                    list(paths), cfg.train.device, precision, shortlist=listed, **asdict(cfg.decode)
                ).into(tgt)
                for beam in beams:
                    translator.translate(lines[:WARMUP_LINES], beam=beam)
                    start = time.perf_counter()
                    hypotheses = translator.translate(lines, beam=beam)
                    seconds = time.perf_counter() - start
                    bleu, chrf = corpus_scores(hypotheses, [references], ("bleu", "chrf"))
                    rows.append({
                        "model": name, "precision": precision, "shortlist": listed is not None, "beam": beam,
                        "bleu": bleu.value, "chrf": chrf.value, "sentences_per_s": len(lines) / seconds,
                        "seconds": seconds,
                    })  # fmt: skip
    return {"device": str(device), "threads": torch.get_num_threads(), "sentences": len(lines), "models": sizes,
            "rows": rows}  # fmt: skip


def report_section(distillation: Distillation, comparison: dict) -> dict:
    """The report's ``distillation``: the teacher, the filters' counts, the shortlist and the comparison."""
    return {
        "teachers": [str(t) for t in distillation.teachers],
        "filters": distillation.filters,
        "shortlist": str(distillation.shortlist) if distillation.shortlist else None,
        "comparison": comparison,
    }


def render_section(section: dict) -> list[str]:
    """The report's Markdown lines for its ``distillation``."""
    c, f = section["comparison"], section["filters"]
    teachers = ", ".join(f"`{t}`" for t in section["teachers"])
    lines = [
        f"Distilled from {teachers}: {f['kept']:,} of {f['translated']:,} training pairs kept "
        f"({f['empty']:,} empty, {f['ratio']:,} beyond the length ratio, {f['worst']:,} scored lowest dropped).",
        "",
    ]
    for name, size in c["models"].items():
        lines.append(f"- {name}: {size['parameters']:,} parameters, {size['file_bytes'] / 2**20:.1f} MiB")
    lines += [
        "",
        f"The test set ({c['sentences']:,} sentences) on {c['device']}, {c['threads']} threads:",
        "",
        "| model | precision | shortlist | beam | BLEU | chrF | sentences/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in c["rows"]:
        listed = "yes" if r["shortlist"] else "no"
        lines.append(
            f"| {r['model']} | {r['precision']} | {listed} | {r['beam']} | {r['bleu']:.2f} | {r['chrf']:.2f} | "
            f"{r['sentences_per_s']:.1f} |"
        )
    return [*lines, ""]
