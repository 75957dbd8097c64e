"""Speed, efficiency and memory figures for the Multi30k recipe's model on this machine.

What is measured (model: recipes/multi30k_en_de.yaml, transformer-small, 8k joint vocabulary):

1. Matmul peak: GFLOP/s of a 2048 x 2048 x 2048 ``torch.mm`` in fp32 and bf16, best of a few
   repeats after a warm-up, with the torch thread count in effect. This is the yardstick for MFU.
2. Training: real (non-pad) target tokens/s and seconds/update over ``--steps`` timed updates of
   the real ``mtkit.train.Trainer`` on the Multi30k training data, after a couple of warm-up updates.
   MFU is the analytic training FLOPs (see ``train_flops``) per second over each measured peak.
3. Peak memory: each precision trains in its own child process, which reports its peak RSS.

With ``--run``, the run's model is also timed translating test_2016_flickr with beam 5 by
``bench_translate.py`` (sentences/s, BLEU, peak memory). Run from the repository root::

    python benchmarks/bench_multi30k.py --run runs/multi30k_en_de --json bench.json

Without ``--run`` a SentencePiece model is trained first (untimed) and translation is skipped.
Figures are printed as a table on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path

import torch

from mtkit import config
from mtkit.config import ModelConfig, RunConfig
from mtkit.data import Batch
from mtkit.runtime import set_threads

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "multi30k_en_de.yaml"
MATMUL_SIZE = 2048
MATMUL_REPEATS = 5
WARMUP_UPDATES = 2
PRECISIONS = ("fp32", "bf16")


# -- measurements (each runs in the process that reports it) -------------------------------


def matmul_gflops(dtype: torch.dtype, n: int = MATMUL_SIZE) -> float:
    """Best-of-repeats GFLOP/s of an n x n x n matmul; the first call warms caches and kernels up."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def train_flops(batch: Batch, model: ModelConfig, vocab: int) -> int:
    """Matmul FLOPs of one training pass (forward + backward) over ``batch``.

    Counted from the batch shapes, 2 FLOPs per multiply-add, with backward taken as twice the
    forward. Linear layers and attention run over padded positions, since the kernels compute them;
    the output projection runs over real target tokens only, as mtkit projects nothing else. Each
    attention product (q k^T and weights @ v) costs 2 * Tq * Tk * D per sentence, and the causal
    T x T scores are counted in full. Embedding lookups, norms, softmax and the optimizer are not
    matmuls and are left out, as is usual for MFU.
    """
    b, s = batch.src.shape
    t = batch.tgt_in.size(1)
    d, ffn = model.d_model, model.ffn
    src_rows, tgt_rows = b * s, b * t

    def attention(tq: int, tk: int) -> int:
        return 2 * (2 * b * tq * tk * d)

    ffn_src, ffn_tgt = 2 * src_rows * d * ffn * 2, 2 * tgt_rows * d * ffn * 2  # up and down
    encoder_layer = 4 * 2 * src_rows * d * d + attention(s, s) + ffn_src
    decoder_layer = (
        4 * 2 * tgt_rows * d * d
        + attention(t, t)  # self-attention: q, k, v, out projections
        + 2 * 2 * tgt_rows * d * d
        + 2 * 2 * src_rows * d * d
        + attention(t, s)  # cross: q, out; k, v
        + ffn_tgt
    )
    output = 2 * batch.target_tokens * d * vocab
    return 3 * (model.encoder_layers * encoder_layer + model.decoder_layers * decoder_layer + output)


def bench_config(data_dir: Path, tokenizer: Path | str, precision: str, threads: int) -> RunConfig:
    """The recipe as it trains, pointed at ``data_dir``, with no validation or checkpoints."""
    return config.load(
        RECIPE,
        [
            f"data.train_src={data_dir / 'train.en.gz'}",
            f"data.train_tgt={data_dir / 'train.de.gz'}",
            "data.valid_src=",
            "data.valid_tgt=",
            f"tokenizer.model={tokenizer}",
            f"train.precision={precision}",
            "train.device=cpu",
            f"train.threads={threads}",
            "train.valid_every=0",
            "train.save_every=0",
        ],
    )


def measure_training(cfg: RunConfig, work: Path, steps: int) -> dict:
    """Throughput of ``steps`` Trainer updates on the recipe's batches, after warm-up updates."""
    from mtkit.train import Trainer

    trainer = Trainer(cfg, work)
    batches = trainer.corpus.batches(cfg.train.batch_tokens, seed=cfg.train.seed)
    batches = list(islice(cycle(batches), WARMUP_UPDATES + steps))
    for batch in batches[:WARMUP_UPDATES]:
        trainer.train_step([batch], batch.target_tokens)
    timed = batches[WARMUP_UPDATES:]
    start = time.perf_counter()
    for batch in timed:
        trainer.train_step([batch], batch.target_tokens)
    seconds = time.perf_counter() - start
    tokens = sum(b.target_tokens for b in timed)
    flops = sum(train_flops(b, cfg.model, trainer.tgt_tok.vocab_size) for b in timed)
    return {
        "updates": steps,
        "seconds": seconds,
        "target_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "s_per_update": seconds / steps,
        "gflop_per_update": flops / steps / 1e9,
        "gflops": flops / seconds / 1e9,
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_main(args: argparse.Namespace) -> None:
    """Training at one precision; prints its figures as one JSON line for the parent."""
    set_threads(args.threads)
    (precision,) = args.precisions
    cfg = bench_config(args.data_dir, args.tokenizer, precision, args.threads)
    result = measure_training(cfg, args.work, args.steps)
    print(json.dumps({**result, "peak_rss_mib": peak_rss_mib()}))


# -- the parent: peaks here, phases in children, then the report --------------------------


def run_child(args: argparse.Namespace, phase: str, precision: str, tokenizer: Path, work: Path) -> dict:
    """Run one phase in a fresh process, so its peak RSS is its own."""
    print(f"{phase} {precision} ...", file=sys.stderr, flush=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--phase",
        phase,
        "--precisions",
        precision,
        "--data-dir",
        str(args.data_dir),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--tokenizer",
        str(tokenizer),
        "--work",
        str(work),
    ]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"bench_multi30k: the {phase} {precision} phase failed (exit {done.returncode})")
    return json.loads(done.stdout.splitlines()[-1])


def run_tokenizer(args: argparse.Namespace, work: Path) -> Path:
    """The run's tokenizer, or one trained now (untimed) on the training data."""
    if args.run:
        return args.run / "spm.model"
    from mtkit.data import iter_parallel
    from mtkit.train import prepare_tokenizers

    print("training the SentencePiece model (no --run given) ...", file=sys.stderr, flush=True)
    cfg = bench_config(args.data_dir, "", "fp32", args.threads)
    prepare_tokenizers(cfg, work, lambda: iter_parallel(cfg.data.train_src, cfg.data.train_tgt))
    return work / "spm.model"


def add_mfu(train: dict, peaks: dict) -> None:
    """Model FLOPs utilisation of each training result against each measured matmul peak."""
    for result in train.values():
        result["mfu"] = {name: result["gflops"] / peak for name, peak in peaks.items()}


def render(figures: dict) -> str:
    """A plain-text report of all figures."""
    peaks = figures["matmul_gflops"]
    out = [
        f"Multi30k en-de, transformer-small | torch {figures['torch']} | {figures['threads']} threads",
        "",
        f"matmul peak ({MATMUL_SIZE}^3): " + "   ".join(f"{k} {v:,.1f} GFLOP/s" for k, v in peaks.items()),
        "",
        f"training: {figures['steps']} timed updates after {WARMUP_UPDATES} warm-up,"
        f" batch_tokens {figures['batch_tokens']}",
        f"{'precision':<10}{'tgt tok/s':>11}{'s/update':>10}{'GFLOP/upd':>11}{'GFLOP/s':>9}"
        f"{'MFU fp32pk':>12}{'MFU bf16pk':>12}{'peak MiB':>10}",
    ]
    for name, r in figures["train"].items():
        out.append(
            f"{name:<10}{r['tokens_per_s']:>11,.0f}{r['s_per_update']:>10.3f}{r['gflop_per_update']:>11.1f}"
            f"{r['gflops']:>9.1f}{r['mfu']['fp32']:>12.1%}{r['mfu']['bf16']:>12.1%}{r['peak_rss_mib']:>10,.0f}"
        )
    out.append("")
    if figures["translate"] is None:
        out.append("translation: skipped (needs a trained run directory: --run RUN_DIR)")
    else:
        out.append("translation (bench_translate.py): beam 5, the 1,000 lines of test_2016_flickr, cpu")
        out.append(f"{'precision':<10}{'sent/s':>9}{'seconds':>9}{'BLEU':>7}{'peak MiB':>10}")
        for name, r in figures["translate"].items():
            out.append(
                f"{name:<10}{r['sentences_per_s']:>9.1f}{r['seconds']:>9.1f}{r['bleu']:>7.2f}{r['peak_rss_mib']:>10,.0f}"
            )
    return "\n".join(out)


def translation(args: argparse.Namespace, work: Path) -> dict:
    """Beam-5 decoding speed, BLEU and peak memory of the run's model, measured by bench_translate.py."""
    import bench_translate

    child_args = argparse.Namespace(run=args.run, data_dir=args.data_dir, threads=args.threads, repeat=1)
    return {p: bench_translate.run_child(child_args, f"mtkit-{p}", work) for p in args.precisions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, help="a trained run directory: its tokenizer, and its model to translate with")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=REPO.parent / "shared" / "data" / "multi30k",
        help="folder with train.{en,de}.gz and test_2016_flickr.{en,de}.gz",
    )
    p.add_argument("--steps", type=int, default=20, help="timed training updates per precision")
    p.add_argument(
        "--precisions", type=lambda s: s.split(","), default=list(PRECISIONS), help="comma-separated: fp32,bf16"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    p.add_argument("--json", type=Path, help="also write all figures to this JSON file")
    # Internal: how the parent starts a child for one phase.
    p.add_argument("--phase", choices=("train",), help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in args.precisions:
        if name not in PRECISIONS:
            p.error(f"--precisions: {name!r} is not one of {', '.join(PRECISIONS)}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase:
        child_main(args)
        return
    set_threads(args.threads)
    print("matmul peaks ...", file=sys.stderr, flush=True)
    peaks = {name: matmul_gflops(dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    with tempfile.TemporaryDirectory(prefix="bench_multi30k.") as tmp:
        work = Path(tmp)
        tokenizer = run_tokenizer(args, work)
        train = {p: run_child(args, "train", p, tokenizer, work) for p in args.precisions}
        translate = translation(args, work) if args.run else None
    add_mfu(train, peaks)
    figures = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "batch_tokens": config.load(RECIPE).train.batch_tokens,
        "matmul_gflops": peaks,
        "train": train,
        "translate": translate,
    }
    print(render(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
