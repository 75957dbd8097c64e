"""Correctness and speed of training and translation on one CUDA GPU, as one short run.

For a GPU machine held for a limited time: every phase appends its figures to ``OUT/gpu_check.json``,
and its results as lines of ``OUT/summary.txt``, as soon as it ends, so a run cut short still
reports what it measured. Phases (``--phases``, in the order given):

- ``doctor``: ``mtkit doctor``.
- ``peak``: matmul peak (bf16 and fp32, 8192^3), the yardstick for MFU.
- ``recipe``: the Multi30k recipe end to end in bf16 on the GPU, as its docs run it (``mtkit run``:
  its own tokenizer, all of its updates with their validations, the mean of its last checkpoints,
  test_2016_flickr translated with beam 5 and scored): the wall clock of training and of the whole
  command, target tokens/s, MFU, peak GPU memory, best validation BLEU, and the test BLEU against
  the recipe's expected range. With ``--time-limit`` the run is stopped when the time is up (its
  checkpoint saved), and what it did by then is recorded.
- ``precisions``: fp16 (loss scaling; overflow skips counted), fp32, and bf16 with ``--compile``,
  600 updates each with the recipe run's tokenizer.
- ``compile``: eager and compiled training without dropout: per-update losses side by side.
- ``torchrun``: fp32 training without dropout launched through torchrun (``mtkit train
  --nproc-per-node 1``, whose rank must say that it joined a process group: NCCL on a GPU) against
  the same training in a single process: both loss series and their largest difference.
- ``oom``: a real CUDA out-of-memory: a batch far above a capped memory budget is skipped and
  counted, and the next update trains normally.
- ``translate``: test_2016_flickr with beam 5 in fp32 and bf16: sentences/s and BLEU.

Usage (from the repository root): ``python benchmarks/gpu_check.py --data-dir DIR --out OUT``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "multi30k_en_de.yaml"
PHASES = ("doctor", "peak", "recipe", "precisions", "compile", "torchrun", "oom", "translate")
STOP_GRACE_S = 25  # how long a stopped run may take to save its checkpoint and exit


def record(out: Path, name: str, value) -> None:
    """Add ``name``'s figures to OUT/gpu_check.json (replacing earlier ones of that name) and print them."""
    path = out / "gpu_check.json"
    figures = json.loads(path.read_text()) if path.is_file() else {}
    figures[name] = value
    path.write_text(json.dumps(figures, indent=1))
    print(f"== {name}: {json.dumps(value)[:2000]}", flush=True)


def note(out: Path, line: str) -> None:
    """Append one result line to OUT/summary.txt, at once, and print it."""
    with open(out / "summary.txt", "a", encoding="utf-8") as f:
        f.write(line + "\n")
    print(line, flush=True)


def mtkit(*args: str, log: Path, limit: float | None = None) -> tuple[float, bool]:
    """Run ``python -m mtkit ARGS`` with its output in ``log``: (wall seconds, whether it finished). Past ``limit``
    seconds it gets SIGTERM, upon which training saves its checkpoint and exits."""
    start = time.perf_counter()
    with open(log, "w") as f:
        child = subprocess.Popen([sys.executable, "-m", "mtkit", *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            return time.perf_counter() - start, False
    if child.returncode:
        print(log.read_text()[-3000:], flush=True)
        raise SystemExit(f"mtkit {' '.join(args[:2])} failed with exit status {child.returncode}")
    return time.perf_counter() - start, True


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


def read_events(run: Path) -> list[dict]:
    """The run's metrics.jsonl records; none before training has started."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def summarise_run(run: Path) -> dict:
    """Throughput (mean over train log lines after the first), skip counters and last validation."""
    events = read_events(run)
    train = [e for e in events if e["event"] == "train"]
    valid = [e for e in events if e["event"] == "valid"]
    speeds = [e["tgt_tokens_per_s"] for e in train[1:]] or [e["tgt_tokens_per_s"] for e in train]
    last = train[-1] if train else {}
    return {
        "updates": max((e["step"] for e in train + valid), default=0),
        "tgt_tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "first_loss": train[0]["loss"] if train else None,
        "last_loss": last.get("loss"),
        "overflow_skips": last.get("overflow_skips"),
        "oom_skips": last.get("oom_skips"),
        "valid_bleu": valid[-1].get("valid_bleu") if valid else None,
        "valid_loss": valid[-1]["valid_loss"] if valid else None,
        "validations_s": sum(e.get("valid_seconds", 0.0) for e in valid),
        "peak_gpu_mem_gib": last.get("peak_gpu_mem_gib"),
    }


def flops_per_target_token(data_dir: Path, tokenizer: Path) -> float:
    """Training matmul FLOPs per real target token over the recipe's first epoch of batches."""
    from train_throughput import bench_config, train_flops

    from mtkit.data.parallel import collate, read_parallel, token_batches
    from mtkit.data.tokenizer import Tokenizer

    cfg = bench_config(data_dir / "train.en.gz", data_dir / "train.de.gz", tokenizer, "bf16", 0)
    tok = Tokenizer(tokenizer)
    src, tgt = (tok.encode(side) for side in read_parallel(cfg.data.train_src, cfg.data.train_tgt))
    order = token_batches([len(s) for s in src], [len(t) for t in tgt], cfg.train.batch_tokens, seed=1)
    batches = [collate([src[i] for i in b], [tgt[i] for i in b]) for b in order]
    return sum(train_flops(b, cfg.model, tok.vocab_size) for b in batches) / sum(b.target_tokens for b in batches)


def minutes(seconds: float) -> str:
    whole, rest = divmod(round(seconds), 60)
    return f"{whole} min {rest} s" if whole else f"{seconds:.1f} s"


def fresh(run: Path) -> Path:
    """``run``, emptied: a run directory left by an earlier check would be resumed, not trained."""
    shutil.rmtree(run, ignore_errors=True)
    return run


def phase_recipe(args, out: Path, peak: float) -> None:
    """The recipe as ``mtkit run`` runs it, in bf16 on the GPU; training and the whole command timed."""
    from mtkit.config import read_config

    run = fresh(out / "recipe")
    sets = [f"train.device={args.device}", "train.precision=bf16", *args.set]
    command = ["run", str(RECIPE), "--out", str(run), "--mirror", str(args.data_dir.resolve())]
    seconds, finished = mtkit(
        *command, *(a for s in sets for a in ("--set", s)), log=out / "recipe.log", limit=args.time_limit
    )
    summary = {**summarise_run(run), "wall_s": seconds, "finished": finished}
    if not finished:
        summary["max_steps"] = read_config(RECIPE, sets).train.max_steps
        record(out, "recipe_bf16", summary)
        rate, done, total = summary["tgt_tokens_per_s"], summary["updates"], summary["max_steps"]
        where = "after training" if done == total else f"at update {done:,} of {total:,}"
        pace = f"; at that pace all {total:,} updates take about {minutes(seconds * total / done)}" if done else ""
        note(
            out,
            f"multi30k recipe, bf16: CUT by the time limit after {minutes(seconds)} of `mtkit run`, {where}"
            + (f" ({rate:,.0f} target tokens/s)" if rate else "")
            + (pace if done < total else "")
            + "; no test BLEU",
        )
        return
    report = json.loads((run / "report.json").read_text())
    stages = {stage["name"]: stage["seconds"] for stage in report["stages"]}
    bleu = next(score for score in report["scores"] if score["name"] == "BLEU")
    expected = report["expected"]
    summary.update(
        train_s=stages.get("train"),
        stages_s=stages,
        test_bleu=bleu["value"],
        bleu_signature=bleu["signature"],
        expected_bleu=[expected["bleu_min"], expected["bleu_max"]],
        verdict=report["verdict"],
        best_valid_bleu=report["training"]["best_valid_bleu"],
    )
    record(out, "recipe_bf16", summary)
    rate, memory = summary["tgt_tokens_per_s"], summary["peak_gpu_mem_gib"]
    note(
        out,
        f"multi30k recipe, bf16: training {minutes(summary['train_s'])} for {summary['updates']:,} updates "
        f"(its tokenizer and {summary['validations_s']:.0f} s of validations included: "
        f"{minutes(summary['train_s'] - summary['validations_s'])} without the validations"
        + (f"; {rate:,.0f} target tokens/s" if rate else "")
        + (f"; peak GPU memory {memory:.2f} GiB" if memory else "")
        + f"); the whole `mtkit run` {minutes(seconds)}",
    )
    best = summary["best_valid_bleu"]
    note(
        out,
        f"multi30k recipe, bf16: test BLEU {summary['test_bleu']:.2f} (expected {expected['bleu_min']}-"
        f"{expected['bleu_max']}: {summary['verdict']})" + (f"; best validation BLEU {best:.2f}" if best else ""),
    )
    if rate and args.device == "cuda":
        flops = flops_per_target_token(args.data_dir.resolve(), run / "spm.model")
        summary["mfu_of_bf16_peak"] = rate * flops / (peak * 1e12)
        record(out, "recipe_bf16", summary)
        note(out, f"multi30k recipe, bf16: MFU {summary['mfu_of_bf16_peak']:.2%} of the measured bf16 peak")


def phase_precisions(args, out: Path, data: list[str], tokenizer: Path, peaks: dict) -> None:
    flops = flops_per_target_token(args.data_dir.resolve(), tokenizer)
    short = ["--set", "train.max_steps=600", "--set", "train.valid_every=600", "--set", "train.save_every=600"]
    for name, extra in (
        ("fp16", ["--precision", "fp16"]),
        ("fp32", ["--precision", "fp32"]),
        ("bf16_compile", ["--compile"]),
    ):
        run = fresh(out / f"run_{name}")
        seconds, _ = mtkit(
            "train",
            str(RECIPE),
            "--out",
            str(run),
            *data,
            "--set",
            f"tokenizer.model={tokenizer}",
            *short,
            *extra,
            log=out / f"{name}.log",
        )
        summary = {**summarise_run(run), "wall_s": seconds}
        summary["mfu_of_bf16_peak"] = summary["tgt_tokens_per_s"] * flops / (peaks["bf16"] * 1e12)
        if name == "fp32":
            summary["mfu_of_fp32_peak"] = summary["tgt_tokens_per_s"] * flops / (peaks["fp32"] * 1e12)
        record(out, f"train_{name}_600", summary)


def no_dropout_losses(out: Path, name: str, data: list[str], tokenizer: Path, steps: int, extra: list[str]) -> list:
    """Per-update training losses of the recipe's model without dropout for ``steps`` updates, no validation."""
    run = fresh(out / name)
    settings = [
        f"tokenizer.model={tokenizer}",
        "model.dropout=0",
        "model.attention_dropout=0",
        "model.activation_dropout=0",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.valid_every=0",
        "train.valid_bleu=false",
        "train.best_metric=loss",
    ]
    command = ["train", str(RECIPE), "--out", str(run), *data, *(a for s in settings for a in ("--set", s))]
    mtkit(*command, *extra, log=out / f"{name}.log")
    return [e["loss"] for e in read_events(run) if e["event"] == "train"]


def largest_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """The largest absolute and relative difference of two loss series, update by update."""
    pairs = list(zip(a, b))
    return max(abs(x - y) for x, y in pairs), max(abs(x - y) / abs(x) for x, y in pairs)


def phase_compile_equivalence(out: Path, data: list[str], tokenizer: Path) -> None:
    losses = {
        name: no_dropout_losses(out, f"nodrop_{name}", data, tokenizer, 30, extra)
        for name, extra in (("eager", []), ("compiled", ["--compile"]))
    }
    _, worst = largest_difference(losses["eager"], losses["compiled"])
    record(out, "compile_vs_eager", {**losses, "max_relative_difference": worst})


def phase_torchrun(args, out: Path, data: list[str], tokenizer: Path) -> None:
    """The same fp32 training through torchrun (one process) and alone: the rank joins a group, losses agree."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    fp32 = ["--precision", "fp32"]
    steps = args.torchrun_steps
    torchrun = no_dropout_losses(out, "torchrun_fp32", data, tokenizer, steps, [*fp32, "--nproc-per-node", "1"])
    single = no_dropout_losses(out, "single_fp32", data, tokenizer, steps, fp32)
    joined_line = f"rank 0 of 1 joined ({backend})"
    joined = joined_line in (out / "torchrun_fp32.log").read_text()
    absolute, relative = largest_difference(torchrun, single) if torchrun and single else (None, None)
    record(
        out,
        "torchrun_vs_single",
        {
            "backend": backend,
            "joined": joined,
            "torchrun_losses": torchrun,
            "single_losses": single,
            "max_abs_difference": absolute,
            "max_relative_difference": relative,
        },
    )
    status = "ok" if joined and len(torchrun) == len(single) == steps else "FAILED"
    why = "" if joined else f": the rank never logged {joined_line!r}"
    note(
        out,
        f"torchrun --nproc-per-node 1 ({backend}) against one process, fp32, no dropout: {status}{why}; "
        f"{len(torchrun)} and {len(single)} updates, largest loss difference "
        + (f"{absolute:.2e} ({relative:.2e} relative)" if absolute is not None else "none to compare"),
    )
    note(out, "torchrun losses: " + " ".join(f"{x:.5f}" for x in torchrun))
    note(out, "one-process losses: " + " ".join(f"{x:.5f}" for x in single))


def phase_oom(out: Path, data_dir: Path, tokenizer: Path) -> None:
    """A group of batches far over a capped memory budget is skipped; the next update trains."""
    from mtkit.config import read_config
    from mtkit.training.trainer import Trainer

    overrides = [
        f"data.train_src={data_dir / 'train.en.gz'}",
        f"data.train_tgt={data_dir / 'train.de.gz'}",
        "data.valid_src=",
        "data.valid_tgt=",
        f"tokenizer.model={tokenizer}",
        "train.device=cuda",
        "train.precision=bf16",
        "model.preset=transformer-big",
    ]
    trainer = Trainer(read_config(RECIPE, overrides), fresh(out / "oom_run"))
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


def phase_translation(args, out: Path, base: Path) -> None:
    from mtkit.data.parallel import read_lines
    from mtkit.scoring.metrics import bleu

    data_dir = args.data_dir.resolve()
    refs = read_lines(data_dir / "test_2016_flickr.de.gz")
    for precision in ("fp32", "bf16"):
        hyp = out / f"test.{precision}.de"
        seconds, _ = mtkit(
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
            args.device,
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


def phase_list(text: str) -> list[str]:
    phases = text.split(",")
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {', '.join(unknown)}; the phases: {', '.join(PHASES)}")
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True, help="folder with the Multi30k *.gz files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--phases", type=phase_list, default=list(PHASES), help=f"comma-separated: {','.join(PHASES)}")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="a joint SentencePiece model for the phases after recipe (default: the recipe run's, OUT/recipe)",
    )
    p.add_argument("--time-limit", type=float, help="seconds the recipe's `mtkit run` may take before it is stopped")
    p.add_argument("--torchrun-steps", type=int, default=30, help="updates of each torchrun phase training")
    p.add_argument(
        "--set", action="append", default=[], help="a config override for every training of the check (repeatable)"
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
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
        "--set",
        f"train.device={args.device}",
        *(a for s in args.set for a in ("--set", s)),
    ]
    base = out / "recipe"
    tokenizer = (args.tokenizer or base / "spm.model").resolve()
    peaks = {"bf16": 790.0, "fp32": 60.0}  # replaced by the measured values when phase peak runs

    def doctor_phase() -> None:
        report = subprocess.run([sys.executable, "-m", "mtkit", "doctor", "--json"], capture_output=True, text=True)
        record(out, "doctor", json.loads(report.stdout))

    def peak_phase() -> None:
        peaks.update(bf16=matmul_tflops(torch.bfloat16), fp32=matmul_tflops(torch.float32))
        record(out, "matmul_tflops", peaks)
        note(out, f"matmul peak (8192^3): bf16 {peaks['bf16']:.0f} TFLOP/s, fp32 {peaks['fp32']:.0f} TFLOP/s")

    steps = {
        "doctor": doctor_phase,
        "peak": peak_phase,
        "recipe": lambda: phase_recipe(args, out, peaks["bf16"]),
        "precisions": lambda: phase_precisions(args, out, data, tokenizer, peaks),
        "compile": lambda: phase_compile_equivalence(out, data, tokenizer),
        "torchrun": lambda: phase_torchrun(args, out, data, tokenizer),
        "oom": lambda: phase_oom(out, d, tokenizer),
        "translate": lambda: phase_translation(args, out, base),
    }
    for name in args.phases:
        try:
            steps[name]()
        except (Exception, SystemExit) as err:  # report and go on: the other phases still tell something
            record(out, f"{name}_failed", f"{type(err).__name__}: {err}")
            note(out, f"gpu_check.py {name}: failed ({type(err).__name__}: {err})")


if __name__ == "__main__":
    main()
