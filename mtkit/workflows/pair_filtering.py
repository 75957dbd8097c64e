"""The dual conditional cross-entropy filter (mtkit.translation.pair_filter) as a stage of a chain of `mtkit run`:
the distilled pairs, or the back-translated ones, scored by a forward and a reverse model and the best kept.

The stage writes a folder, FOLDER/train.SRC and FOLDER/train.TGT (the pairs kept, in order), filter.json (the
counts) and, with ``pair_filter.scores``, scores.tsv (every pair's score); RUN/stages.json records the pairs, models
and settings it was made from, so that a re-run redoes it only when one of them changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtkit.config import ConfigError, PairFilterConfig
from mtkit.data.parallel import DataError, count_lines
from mtkit.files import atomic_write_directory
from mtkit.model.checkpoint import weights_file
from mtkit.model.loading import resolve
from mtkit.workflows.stages import Stage, StageRecord, decoding, run_stage

STAGE = "pair filter"
COUNTS_FILE = "filter.json"
SCORES_FILE = "scores.tsv"
COUNTS = ("pairs", "kept", "over_max_score", "beyond_keep")


@dataclass(frozen=True)
class PairsToFilter:
    """A chain's pairs and the models that judge them."""

    source: Path
    target: Path
    langs: tuple[str, str]  # (source, target) languages
    forward: tuple[Path, ...]  # several: an ensemble (a distillation's teachers)
    reverse: Path


def check_settings(settings: PairFilterConfig, required: str, chain: str) -> None:
    """Before any stage runs: ConfigError when the filter is on without the ``required`` model ("forward" or
    "reverse"), which a ``chain`` ("distilled", "back-translated") cannot stand in for; DataError for a model
    setting that names no model weights."""
    if settings.enabled and not getattr(settings, required):
        direction = "source to target" if required == "forward" else "target to source"
        raise ConfigError(f"pair_filter needs a {required} model ({direction}) for {chain} pairs")
    for key in ("forward", "reverse"):
        model = getattr(settings, key)
        if model and not weights_file(resolve(Path(model))).is_file():
            raise DataError(f"{model}: pair_filter.{key} names no model (a run directory, checkpoint or .safetensors)")


def filter_stage(
    settings: PairFilterConfig, pairs: PairsToFilter, folder: Path, device: str, stages: list[Stage],
    record: StageRecord,
) -> int:  # fmt: skip
    """Run the stage into ``folder`` (see the module docstring); the number of pairs kept."""
    from mtkit.translation.pair_filter import filter_pair_files, load_scorer

    src, tgt = pairs.langs
    kept = (folder / f"train.{src}", folder / f"train.{tgt}")
    inputs = {"source": record.digests.of(pairs.source), "target": record.digests.of(pairs.target)}
    inputs |= {f"forward {i}": record.digests.of(weights_file(resolve(m))) for i, m in enumerate(pairs.forward)}
    inputs["reverse"] = record.digests.of(weights_file(resolve(pairs.reverse)))
    decoded = decoding(device)  # bf16 and fp32 score a pair a little differently
    made_with = {"keep": settings.keep, "max_score": settings.max_score, "scores": settings.scores, **decoded}
    also = (kept[0], folder / COUNTS_FILE, *((folder / SCORES_FILE,) if settings.scores else ()))
    with run_stage(stages, STAGE) as stage:
        if stage.out_of_date(record, kept[1], inputs, made_with, also=also):
            precision = decoded["precision"]
            forward = load_scorer(list(pairs.forward), src, tgt, "pair_filter.forward", device, precision)
            reverse = load_scorer(pairs.reverse, tgt, src, "pair_filter.reverse", device, precision)

            def fill(tmp: Path) -> None:
                table = tmp / SCORES_FILE if settings.scores else None
                outputs = (tmp / kept[0].name, tmp / kept[1].name)
                summary = filter_pair_files(forward, reverse, pairs.source, pairs.target, *outputs, settings, table)
                (tmp / COUNTS_FILE).write_text(json.dumps(summary.to_dict(), indent=1) + "\n")

            atomic_write_directory(folder, fill)
        counts = _read_counts(folder / COUNTS_FILE)
        dropped = f"{counts['over_max_score']:,} over max_score, {counts['beyond_keep']:,} beyond keep"
        stage.note = f"{counts['kept']:,} of {counts['pairs']:,} pairs kept ({dropped})"
    if not counts["kept"]:
        raise DataError(f"{pairs.target}: pair_filter kept none of its {counts['pairs']:,} pairs")
    if not count_lines(kept[0]) == count_lines(kept[1]) == counts["kept"]:  # never train on misaligned pairs
        raise DataError(f"{folder}: {kept[0].name} and {kept[1].name} are not line-aligned; delete {folder} to redo it")
    return counts["kept"]


def _read_counts(path: Path) -> dict[str, int]:
    """filter.json as the stage wrote it; DataError for anything else."""
    try:
        counts = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_size < 4096 else None
    except (OSError, ValueError, RecursionError):
        counts = None
    if not isinstance(counts, dict) or not all(type(counts.get(k)) is int for k in COUNTS):
        raise DataError(f"{path}: not the filter counts mtkit wrote; delete {path.parent} to redo it")
    return {k: counts[k] for k in COUNTS}
