"""The report of `mtkit run` (RUN/report.md and RUN/report.json, with RUN/curves.png when matplotlib is installed).

It gives the test scores with their signatures (COMET's too, with recipe.comet), says whether they fall in the
recipe's expected range ("incomplete" instead when train.max_time stopped a training before its max_steps: the
run's own, a reverse model's or a teacher's, each named in report.json's ``incomplete``), the hardware and
precision training ran in, and each stage's wall clock. It describes the hypothesis it scores from the record made
with that hypothesis: the decode settings (the translate note, report.json's test.decode) and the SHA-256 of the
model that wrote it (report.json's test.model_sha256; its first 12 digits in the eval note). A distilled student's
report sets it beside its teacher (mtkit.workflows.comparison).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtkit.files import atomic_write_text
from mtkit.model.run_folder import METRICS_FILE
from mtkit.scoring.comet_names import SCORE_NAMES
from mtkit.scoring.learned_metrics import DECIMALS
from mtkit.training.validation import tracked_metric

if TYPE_CHECKING:
    from mtkit.config import RunConfig
    from mtkit.workflows.distillation import Distillation
    from mtkit.workflows.stages import Stage

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
CURVES = "curves.png"


def build_report(
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
    judges; with ``distillation``, the teacher and the student compared (distillation_section)."""
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
            **_best_validation(valid, cfg.train.best_metric),
            "validations": [_validation(v) for v in valid],
        },
        "distillation": distillation,
        "curves": plot,
        "stages": [asdict(s) for s in stages],
        "seconds": sum(s.seconds for s in stages),
    }


def distillation_section(distillation: Distillation, comparison: dict) -> dict:
    """The report's ``distillation``: the teacher, the filters' counts, the shortlist and the comparison."""
    return {
        "teachers": [str(t) for t in distillation.teachers],
        "filters": distillation.filters,
        "shortlist": str(distillation.shortlist) if distillation.shortlist else None,
        "comparison": comparison,
    }


def _training_records(out: Path) -> dict[str, list[dict]]:
    """RUN/metrics.jsonl's records by event (train, valid, start, done), each with an int step; a torn or edited
    line, or a record whose fields have the wrong types, is skipped, not fatal."""
    numbers = {
        "train": ("loss",),
        "valid": ("valid_loss", "valid_bleu", "valid_comet"),
        "start": (),
        "done": ("max_steps",),
    }
    texts = {"start": ("hardware", "precision", "reason"), "done": ("stopped_by", "reason")}
    events: dict[str, list[dict]] = {event: [] for event in numbers}
    path = out / METRICS_FILE
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
        optional = {"valid_bleu": 0.0, "valid_comet": 0.0}  # validation without BLEU or COMET
        if all(isinstance(record.get(key, optional.get(key)), (int, float)) for key in numbers[event]) and all(
            isinstance(record.get(key), str) for key in texts.get(event, ())
        ):
            events[event].append(record)
    return events


def _validation(record: dict) -> dict:
    """A validation as the report lists it; per direction too where the run validates several."""
    entry = {"step": record["step"], "bleu": record.get("valid_bleu"), "loss": record["valid_loss"]}
    if "valid_comet" in record:  # train.valid_comet
        entry["comet"] = record["valid_comet"]
    for metric in ("bleu", "comet"):
        by_direction = record.get(f"valid_{metric}_by_direction")
        if isinstance(by_direction, dict) and all(isinstance(v, (int, float)) for v in by_direction.values()):
            entry[f"{metric}_by_direction"] = by_direction
    return entry


def _best_validation(valid: list[dict], metric: str) -> dict:
    """The report's account of the validation best/ holds, chosen as training chose it (the first with the best
    value of train.best_metric): its step, that metric and its value, and its BLEU; None where none has it."""
    scored = [v for v in valid if f"valid_{metric}" in v]
    best = max(scored, key=lambda v: tracked_metric(v, metric), default=None)
    return {
        "best_valid_step": best["step"] if best else None,
        "best_valid_metric": metric,
        "best_valid_score": best[f"valid_{metric}"] if best else None,
        "best_valid_bleu": best.get("valid_bleu") if best else None,
    }


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
    """Training and validation loss, and validation BLEU and COMET where they were scored, by update, as
    RUN/curves.png; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # run_recipe has said so
        return None
    panels = _curves(train, valid)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for axis, panel in zip(axes[0], panels):
        for label, steps, values, style in panel.lines:
            axis.plot(steps, values, style, label=label)
        axis.set(xlabel="update", ylabel=panel.ylabel, title=panel.title)
        if len(panel.lines) > 1:
            axis.legend()
    fig.tight_layout()
    tmp = out / f".{CURVES}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out / CURVES)
    return CURVES


@dataclass(frozen=True)
class Panel:
    """One panel of RUN/curves.png: its lines, each (label, updates, values, matplotlib style)."""

    title: str
    ylabel: str
    lines: list[tuple[str, list[int], list[float], str]]


def _curves(train: list[dict], valid: list[dict]) -> list[Panel]:
    """The panels of RUN/curves.png: the loss, then validation BLEU and COMET where some validation scored them."""
    panels = [
        Panel(
            "loss",
            "loss",
            [
                ("train (label-smoothed)", [t["step"] for t in train], [t["loss"] for t in train], "-"),
                ("valid", [v["step"] for v in valid], [v["valid_loss"] for v in valid], "o-"),
            ],
        )
    ]
    for key, name, title in (
        ("valid_bleu", "BLEU", "validation BLEU (sacreBLEU)"),
        ("valid_comet", "COMET", "validation COMET (train.valid_comet)"),
    ):
        scored = [v for v in valid if key in v]
        if scored:
            panels.append(Panel(title, name, [(name, [v["step"] for v in scored], [v[key] for v in scored], "o-")]))
    return panels


def write_report(out: Path, report: dict) -> None:
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
        *(f"| {s['name']} | {_value(s)} | `{_cell(s['signature'])}` |" for s in report["scores"]),
        "",
    ]
    if report.get("directions"):
        names = [s["name"] for s in report["directions"][0]["scores"]]
        lines += [
            "| direction | " + " | ".join(names) + " | hypothesis |",
            "| --- |" + " --- |" * (len(names) + 1),
            *(
                f"| {d['direction']} | "
                + " | ".join(_value(s) for s in d["scores"])
                + f" | `{Path(d['hypothesis']).name}` |"
                for d in report["directions"]
            ),
            "",
        ]
    if t["best_valid_step"] is not None:
        metric = t["best_valid_metric"]
        name, decimals = {"bleu": ("BLEU", 2), "comet": ("COMET", DECIMALS), "loss": ("loss", 3)}[metric]
        mean = " (the mean over the directions)" if report.get("directions") and metric != "loss" else ""
        lines += [
            f"Training: {t['updates']:,} updates; best validation {name}{mean} {t['best_valid_score']:.{decimals}f} "
            f"at update {t['best_valid_step']:,}, the model in best/ (train.best_metric).",
            "",
        ]
    for i, m in enumerate(t["machines"]):
        where = "Trained" if i == 0 else f"Resumed at update {m['step']:,}"
        lines += [f"{where} on {m['hardware']}, in {m['precision']} ({m['reason']}).", ""]
    if report.get("distillation"):
        lines += _render_distillation(report["distillation"])
    if report["curves"]:
        lines += [f"![training curves]({report['curves']})", ""]
    lines += ["| stage | wall clock | |", "| --- | --- | --- |"]
    for s in report["stages"]:
        done = "ran" if s["ran"] else "up to date"
        lines.append(f"| {s['name']} | {_duration(s['seconds'])} | {done}{'; ' + s['note'] if s['note'] else ''} |")
    lines += [f"| total | {_duration(report['seconds'])} | |", ""]
    return "\n".join(lines)


def _render_distillation(section: dict) -> list[str]:
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


def _origin(source: dict | None) -> str:
    """`` (hf:wmt/wmt14 de-en at commit b199e40...)``: where a Hub corpus came from; empty otherwise."""
    if not source:
        return ""
    parts = [f"hf:{source['dataset']}", *(str(source[k]) for k in ("config", "data_dir") if source.get(k))]
    revision = source.get("revision")
    return f" ({' '.join(parts)}{f' at commit {revision}' if revision else ''})"


def _value(score: dict) -> str:
    """A score as the report prints it: COMET's near 0 to 1 with 4 decimals, sacreBLEU's with 2."""
    return f"{score['value']:.{DECIMALS if score['name'] in SCORE_NAMES else 2}f}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{seconds:.1f} s"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: its pipes escaped (sacreBLEU signatures are full of them)."""
    return text.replace("|", "\\|")
