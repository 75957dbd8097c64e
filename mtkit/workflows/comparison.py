"""A distilled student set beside its teacher, once the student's test set is scored: both translate that test set
at each precision the machine runs (fp32; bf16 where the device computes it natively; int8 on a CPU), with and
without the shortlist, the student greedily too, for the report's table of BLEU, chrF, sentences/s, parameters and
file sizes (RUN/comparison.json, the ``compare`` stage).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtkit.config import RunConfig
from mtkit.data.directions import directions
from mtkit.data.parallel import read_lines
from mtkit.files import atomic_write_text
from mtkit.model.checkpoint import weights_file
from mtkit.workflows.stages import Stage, StageRecord, run_stage

if TYPE_CHECKING:
    from mtkit.workflows.distillation import Distillation

COMPARISON_FILE = "comparison.json"
WARMUP_LINES = 64  # translated once before each timed translation of the test set: kernels are built on first use


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
    precisions = _precisions(device)
    settings = {"decode": asdict(cfg.decode), "precisions": precisions, "device": str(device)}
    with run_stage(stages, "compare") as stage:
        if stage.out_of_date(record, target, inputs, settings):
            comparison = _measure(cfg, models, distillation.shortlist, source, reference, precisions)
            atomic_write_text(target, json.dumps(comparison, indent=1) + "\n")
        else:
            comparison = json.loads(target.read_text(encoding="utf-8"))
        stage.note = f"{len(comparison['rows'])} translations of {source.name}, {', '.join(precisions)}"
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
    ((src, tgt),) = directions(cfg.data)
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
                ).into(tgt, src)
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
