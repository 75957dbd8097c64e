"""A recipe end to end: prepare, train, average, translate the test set, score, report.

Each stage leaves files in the run directory that the next run recognises, so re-running after an
interruption (or after changing only the decoding) redoes only what is missing or out of date:
prepare keeps prepare.json, training resumes from its newest checkpoint (and stops at once when it
is done), the average and the translation are redone only when older than what they come from.

The report (RUN/report.md and RUN/report.json, with RUN/curves.png when matplotlib is installed)
gives the test scores with their signatures, says whether they fall in the recipe's expected range,
and lists each stage's wall clock.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mtkit.checkpoint import atomic_write_text
from mtkit.config import ConfigError, RunConfig

log = logging.getLogger("mtkit")

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
CURVES = "curves.png"


@dataclass
class Stage:
    name: str
    seconds: float
    ran: bool  # False: its output was already up to date
    note: str = ""


def run_recipe(
    cfg: RunConfig, recipe: Path, out: Path, mirror: str | None, train: Callable[[RunConfig, Path], None]
) -> dict:
    """Run every stage of ``cfg``'s recipe into ``out``; returns the report. ``train(cfg, out)`` trains."""
    stages: list[Stage] = []
    cfg, test = _prepare(cfg, out, mirror, stages)

    start = time.perf_counter()
    train(cfg, out)
    stages.append(Stage("train", time.perf_counter() - start, True))

    model = _average(cfg, out, stages)
    hyp_path = _translate(cfg, model, test[0], out, stages)

    from mtkit.data import read_lines
    from mtkit.metrics import score

    start = time.perf_counter()
    scores = score(read_lines(hyp_path), [read_lines(test[1])], ("bleu", "chrf", "ter"))
    stages.append(Stage("eval", time.perf_counter() - start, True))

    report = _report(cfg, recipe, out, model, test, hyp_path, scores, stages)
    _write_report(out, report)
    return report


def _prepare(cfg: RunConfig, out: Path, mirror: str | None, stages: list[Stage]) -> tuple[RunConfig, tuple[Path, Path]]:
    """The config with data.* pointing at the prepared corpus, and the test (source, reference) files."""
    r = cfg.recipe
    if not r.corpus:
        raise ConfigError("recipe.corpus is not set: `mtkit run` needs a corpus from `mtkit prepare --list`")
    from mtkit.corpora import corpus
    from mtkit.prepare import RECORD, prepare

    spec = corpus(r.corpus)
    if (spec.src_lang, spec.tgt_lang) != (cfg.data.src_lang, cfg.data.tgt_lang):
        raise ConfigError(
            f"recipe.corpus {spec.name} is {spec.src_lang}->{spec.tgt_lang}, "
            f"but data.src_lang/tgt_lang say {cfg.data.src_lang}->{cfg.data.tgt_lang}"
        )
    data_dir = Path(r.data_dir) if r.data_dir else out / "data"
    record = data_dir / RECORD
    before = record.stat().st_mtime_ns if record.exists() else None
    start = time.perf_counter()
    prepare(spec, data_dir, mirror)
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
    return replace(cfg, data=data), (Path(path("test", src)), Path(path("test", tgt)))


def _newer(target: Path, *sources: Path) -> bool:
    """``target`` exists and was written after every one of ``sources``."""
    return target.exists() and all(target.stat().st_mtime_ns >= s.stat().st_mtime_ns for s in sources if s.exists())


def _average(cfg: RunConfig, out: Path, stages: list[Stage]) -> Path:
    """The model to score: the mean of the newest ``recipe.average_last`` checkpoints, or best/."""
    from mtkit.checkpoint import average, export, resolve, run_checkpoints

    k = cfg.recipe.average_last
    checkpoints = run_checkpoints(out)[-k:] if k else []
    if len(checkpoints) < 2:
        note = "recipe.average_last is 0" if not k else f"{len(checkpoints)} checkpoint(s), nothing to average"
        stages.append(Stage("average", 0.0, False, f"scoring best/ ({note})"))
        return resolve(out)
    target = out / f"average-last{k}.safetensors"
    start = time.perf_counter()
    ran = not _newer(target, *checkpoints)
    if ran:
        weights, meta = average(checkpoints)
        export(target, weights, meta, checkpoints[0])
    note = f"the newest {len(checkpoints)} checkpoints, {checkpoints[0].name} to {checkpoints[-1].name}"
    stages.append(Stage("average", time.perf_counter() - start, ran, note))
    return target


def _translate(cfg: RunConfig, model: Path, source: Path, out: Path, stages: list[Stage]) -> Path:
    hyp_path = out / f"test.hyp.{cfg.data.tgt_lang}"
    start = time.perf_counter()
    ran = not _newer(hyp_path, model, source)
    if ran:
        import torch

        from mtkit.checkpoint import atomic_write, load_for_inference
        from mtkit.data import read_lines
        from mtkit.runtime import pick_device
        from mtkit.translate import Translator, chunked

        device = pick_device(cfg.train.device)
        bundle = load_for_inference(model, device, torch.float32)
        translator = Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, cfg.decode, device)

        def write(f) -> None:
            for best in translator.stream(chunked(read_lines(source))):
                f.write((best[0].text + "\n").encode("utf-8"))

        atomic_write(hyp_path, write)
    stages.append(Stage("translate", time.perf_counter() - start, ran, f"beam {cfg.decode.beam}"))
    return hyp_path


def _training_curve(out: Path) -> tuple[list[dict], list[dict]]:
    train, valid = [], []
    path = out / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        record = json.loads(line)
        (train if record.get("event") == "train" else valid if record.get("event") == "valid" else []).append(record)
    return train, valid


def _report(cfg, recipe: Path, out: Path, model: Path, test, hyp_path: Path, scores, stages: list[Stage]) -> dict:
    r = cfg.recipe
    train, valid = _training_curve(out)
    bleu = next(s for s in scores if s.name == "BLEU")
    reproduced = r.bleu_min <= bleu.value <= r.bleu_max
    best = max(valid, key=lambda v: v.get("valid_bleu", float("-inf")), default=None)
    plot = _plot(out, train, valid)
    return {
        "recipe": str(recipe),
        "corpus": r.corpus,
        "run_dir": str(out),
        "model": str(model),
        "test": {"source": str(test[0]), "reference": str(test[1]), "hypothesis": str(hyp_path)},
        "scores": [s.to_dict() for s in scores],
        "expected": {"bleu_min": r.bleu_min, "bleu_max": r.bleu_max, "source": r.expected, "hardware": r.hardware},
        "reproduced": reproduced,
        "training": {
            "updates": max((r["step"] for r in train + valid), default=0),
            "best_valid_bleu": best.get("valid_bleu") if best else None,
            "best_valid_step": best["step"] if best else None,
            "validations": [{"step": v["step"], "bleu": v.get("valid_bleu"), "loss": v["valid_loss"]} for v in valid],
        },
        "curves": plot,
        "stages": [asdict(s) for s in stages],
        "seconds": sum(s.seconds for s in stages),
    }


def _plot(out: Path, train: list[dict], valid: list[dict]) -> str | None:
    """Training loss and validation BLEU by update, as RUN/curves.png; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no training curves: pip install matplotlib (or mtkit[plot]) to draw them")
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
    atomic_write_text(out / REPORT_MD, render(report))


def render(report: dict) -> str:
    """The report as Markdown."""
    e = report["expected"]
    bleu = next(s for s in report["scores"] if s["name"] == "BLEU")
    verdict = "**reproduced**" if report["reproduced"] else "**NOT reproduced**"
    lines = [
        f"# {Path(report['recipe']).stem}",
        "",
        f"Test BLEU {bleu['value']:.2f}: {verdict} (expected {e['bleu_min']:g}-{e['bleu_max']:g}"
        + (f"; {e['source']}" if e["source"] else "")
        + ").",
        "",
        f"Corpus `{report['corpus']}`, run directory `{report['run_dir']}`, scored model `{report['model']}`"
        + (f"; the recipe expects {e['hardware']}." if e["hardware"] else "."),
        "",
        "| metric | score | signature |",
        "| --- | --- | --- |",
        *(f"| {s['name']} | {s['value']:.2f} | `{_cell(s['signature'])}` |" for s in report["scores"]),
        "",
    ]
    t = report["training"]
    if t["best_valid_bleu"] is not None:
        lines += [
            f"Training: {t['updates']:,} updates; best validation BLEU {t['best_valid_bleu']:.2f} "
            f"at update {t['best_valid_step']:,}.",
            "",
        ]
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
