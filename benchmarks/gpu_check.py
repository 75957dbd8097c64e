"""Correctness and speed of training and translation on one CUDA GPU, as one short run.

For a lent GPU machine with a time limit: every phase appends its figures to ``OUT/gpu_check.json``
as soon as it ends, so a run cut short still reports what it measured. Phases:

1. ``mtkit doctor``.
2. Matmul peak (bf16 and fp32, 8192^3), the yardstick for MFU.
3. The Multi30k recipe in bf16 on the GPU (its own tokenizer, the recipe's 2,400 updates), then
   fp16 (loss scaling; overflow skips counted), fp32, and bf16 with ``--compile``, each for a
   shorter budget: target tokens/s, MFU, peak GPU memory, final validation BLEU.
4. Eager and compiled training without dropout: per-update losses side by side.
5. A real CUDA out-of-memory: a batch far above a capped memory budget is skipped and counted,
   and the next update trains normally.
6. Translation of test_2016_flickr with beam 5 in fp32 and bf16: sentences/s and BLEU.

Usage (from the repository root): ``python benchmarks/gpu_check.py --data-dir DIR --out OUT``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "multi30k_en_de.yaml"


def record(out: Path, name: str, value) -> None:
    path = out / "gpu_check.json"
    figures = json.loads(path.read_text()) if path.is_file() else {}
    figures[name] = value
    path.write_text(json.dumps(figures, indent=1))
    print(f"== {name}: {json.dumps(value)[:2000]}", flush=True)


def mtkit(*args: str, log: Path) -> float:
    """Run ``python -m mtkit ARGS`` with its output in ``log``; returns wall seconds."""
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "mtkit", *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode:
        print(log.read_text()[-3000:], flush=True)
        raise SystemExit(f"mtkit {' '.join(args[:2])} failed with exit status {done.returncode}")
    return time.perf_counter() - start


def matmul_tflops(dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1000) / 1e12


def summarise_run(run: Path) -> dict:
    """Throughput (mean over train log lines after the first), skip counters and last validation."""
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    valid = [e for e in events if e["event"] == "valid"]
    speeds = [e["tgt_tokens_per_s"] for e in train[1:]] or [train[-1]["tgt_tokens_per_s"]]
    last = train[-1]
    return {
        "updates": last["step"],
        "tgt_tokens_per_s": sum(speeds) / len(speeds),
        "first_loss": train[0]["loss"],
        "last_loss": last["loss"],
        "overflow_skips": last["overflow_skips"],
        "oom_skips": last["oom_skips"],
        "valid_bleu": valid[-1].get("valid_bleu") if valid else None,
        "valid_loss": valid[-1]["valid_loss"] if valid else None,
        "peak_gpu_mem_gib": last.get("peak_gpu_mem_gib"),
    }


def flops_per_target_token(data_dir: Path, base: Path) -> float:
    """Training matmul FLOPs per real target token over the recipe's first epoch of batches."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from train_throughput import bench_config, train_flops

    from mtkit.data.parallel import collate, read_parallel, token_batches
    from mtkit.data.tokenizer import Tokenizer

    cfg = bench_config(data_dir / "train.en.gz", data_dir / "train.de.gz", base / "spm.model", "bf16", 0)
    tok = Tokenizer(base / "spm.model")
    src, tgt = (tok.encode(side) for side in read_parallel(cfg.data.train_src, cfg.data.train_tgt))
    order = token_batches([len(s) for s in src], [len(t) for t in tgt], cfg.train.batch_tokens, seed=1)
    batches = [collate([src[i] for i in b], [tgt[i] for i in b]) for b in order]
    return sum(train_flops(b, cfg.model, tok.vocab_size) for b in batches) / sum(b.target_tokens for b in batches)


def phase_training(args, out: Path, data: list[str], peak: float, fp32_peak: float) -> Path:
    d = args.data_dir.resolve()
    base = out / "run_bf16"
    seconds = mtkit("train", str(RECIPE), "--out", str(base), *data, "--set", "train.device=cuda", log=out / "bf16.log")
    summary = summarise_run(base)
    flops = flops_per_target_token(d, base)
    summary.update(wall_s=seconds, mfu_of_bf16_peak=summary["tgt_tokens_per_s"] * flops / (peak * 1e12))
    record(out, "train_bf16_recipe", summary)
    spm = ["--set", f"tokenizer.model={base / 'spm.model'}"]
    short = ["--set", "train.max_steps=600", "--set", "train.valid_every=600", "--set", "train.save_every=600"]
    for name, extra in (
        ("fp16", ["--precision", "fp16"]),
        ("fp32", ["--precision", "fp32"]),
        ("bf16_compile", ["--compile"]),
    ):
        run = out / f"run_{name}"
        seconds = mtkit(
            "train",
            str(RECIPE),
            "--out",
            str(run),
            *data,
            *spm,
            *short,
            "--set",
            "train.device=cuda",
            *extra,
            log=out / f"{name}.log",
        )
        summary = {**summarise_run(run), "wall_s": seconds}
        summary["mfu_of_bf16_peak"] = summary["tgt_tokens_per_s"] * flops / (peak * 1e12)
        if name == "fp32":
            summary["mfu_of_fp32_peak"] = summary["tgt_tokens_per_s"] * flops / (fp32_peak * 1e12)
        record(out, f"train_{name}_600", summary)
    return base


def phase_compile_equivalence(out: Path, data: list[str], base: Path) -> None:
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        run = out / f"nodrop_{name}"
        mtkit(
            "train",
            str(RECIPE),
            "--out",
            str(run),
            *data,
            "--set",
            f"tokenizer.model={base / 'spm.model'}",
            "--set",
            "model.dropout=0",
            "--set",
            "train.max_steps=30",
            "--set",
            "train.log_every=1",
            "--set",
            "train.valid_every=0",
            "--set",
            "train.valid_bleu=false",
            "--set",
            "train.best_metric=loss",
            "--set",
            "train.device=cuda",
            *extra,
            log=out / f"nodrop_{name}.log",
        )
        events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [round(e["loss"], 5) for e in events if e["event"] == "train"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses["eager"], losses["compiled"]))
    record(out, "compile_vs_eager", {**losses, "max_relative_difference": worst})


def phase_oom(out: Path, data_dir: Path, base: Path) -> None:
    """A group of batches far over a capped memory budget is skipped; the next update trains."""
    from mtkit.config import read_config
    from mtkit.training.trainer import Trainer

    overrides = [
        f"data.train_src={data_dir / 'train.en.gz'}",
        f"data.train_tgt={data_dir / 'train.de.gz'}",
        "data.valid_src=",
        "data.valid_tgt=",
        f"tokenizer.model={base / 'spm.model'}",
        "train.device=cuda",
        "train.precision=bf16",
        "model.preset=transformer-big",
    ]
    trainer = Trainer(read_config(RECIPE, overrides), out / "oom_run")
    torch.cuda.set_per_process_memory_fraction(12 / (torch.cuda.get_device_properties(0).total_memory / 2**30))
    corpus = trainer.corpus
    huge = corpus.batch_indices(400_000, seed=1)[0]
    small = corpus.batch_indices(4096, seed=1)[0]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.train_step([corpus.collate(huge)], corpus.target_tokens(huge))
    unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    torch.cuda.reset_peak_memory_stats()
    after = trainer.train_step([corpus.collate(small)], corpus.target_tokens(small))
    record(
        out,
        "oom_recovery",
        {
            "huge_batch_sentences": len(huge),
            "skipped": stats["skipped"],
            "params_unchanged_after_skip": unchanged,
            "next_update": {"skipped": after["skipped"], "loss": after["loss"]},
            "next_update_peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        },
    )
    torch.cuda.set_per_process_memory_fraction(1.0)


def phase_translation(out: Path, data_dir: Path, base: Path) -> None:
    from mtkit.data.parallel import read_lines
    from mtkit.scoring.metrics import bleu

    refs = read_lines(data_dir / "test_2016_flickr.de.gz")
    for precision in ("fp32", "bf16"):
        hyp = out / f"test.{precision}.de"
        seconds = mtkit(
            "translate",
            str(base),
            "-i",
            str(data_dir / "test_2016_flickr.en.gz"),
            "-o",
            str(hyp),
            "--beam",
            "5",
            "--precision",
            precision,
            "--device",
            "cuda",
            log=out / f"translate_{precision}.log",
        )
        hyps = read_lines(hyp)
        record(
            out,
            f"translate_{precision}",
            {
                "lines": len(hyps),
                "wall_s_incl_startup": seconds,
                "sentences_per_s": len(hyps) / seconds,
                "bleu": bleu(hyps, refs).value,
            },
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True, help="folder with the Multi30k *.gz files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--phases", default="doctor,peak,train,compile,oom,translate")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    d = args.data_dir.resolve()
    data = [
        "--set",
        f"data.train_src={d / 'train.en.gz'}",
        "--set",
        f"data.train_tgt={d / 'train.de.gz'}",
        "--set",
        f"data.valid_src={d / 'val.en.gz'}",
        "--set",
        f"data.valid_tgt={d / 'val.de.gz'}",
    ]
    if "doctor" in phases:
        report = subprocess.run([sys.executable, "-m", "mtkit", "doctor", "--json"], capture_output=True, text=True)
        record(out, "doctor", json.loads(report.stdout))
    peaks = {"bf16": 790.0, "fp32": 60.0}  # replaced by the measured values when phase peak runs
    base = out / "run_bf16"

    def peak_phase() -> None:
        peaks.update(bf16=matmul_tflops(torch.bfloat16), fp32=matmul_tflops(torch.float32))
        record(out, "matmul_tflops", peaks)

    steps = {
        "peak": peak_phase,
        "train": lambda: phase_training(args, out, data, peaks["bf16"], peaks["fp32"]),
        "compile": lambda: phase_compile_equivalence(out, data, base),
        "oom": lambda: phase_oom(out, d, base),
        "translate": lambda: phase_translation(out, d, base),
    }
    for name in phases:
        if name in steps:
            try:
                steps[name]()
            except (Exception, SystemExit) as err:  # report and go on: the other phases still tell something
                record(out, f"{name}_failed", f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
