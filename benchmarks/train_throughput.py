"""Training throughput, efficiency and memory of a model preset at each precision on this machine.

What is measured (default: the Multi30k recipe's model, transformer-small with an 8k joint vocabulary,
on Multi30k task 1 en-de with the recipe's 4,096-token batches, with sinusoidal positions as fairseq's
transformer has them; ``--set model.positions=rotary`` trains the recipe's own):

1. Matmul peak: GFLOP/s of an n x n x n ``torch.mm`` in fp32 and bf16 (n = 2048 on a CPU, with the
   torch thread count in effect; 8192 on a GPU, fp32 without TF32), best of a few repeats after a
   warm-up. This is the yardstick for MFU.
2. Training: real (non-pad) target tokens/s, updates/s and seconds/update over ``--steps`` timed
   updates of the real training loop (``Trainer.update_groups`` feeding ``Trainer.train_step``, batches made
   ahead by the feed thread as train.prefetch says) on the corpus's batches, after ``--warmup`` updates.
   MFU is the analytic training FLOPs (see ``train_flops``) per second over each measured peak. Beside it,
   what making an update's batches (gathering and padding them) costs when timed alone.
   With ``--host-overhead`` the model keeps the preset's layers and the batches their size, but its width
   shrinks to 8 and its vocabulary to 1,000 pieces: the arithmetic is then almost nothing, and an update's
   time is its host time (Python, operator dispatch, the loop, and any batch making left in it).
3. Peak memory: each precision trains in its own child process, which reports its peak RSS
   (and on a GPU its peak allocated GPU memory). Children run under the allocator the ``mtkit``
   command would use (mimalloc where installed; ``MTKIT_ALLOCATOR=system`` for glibc's).
4. With ``--fairseq PYTHON`` (an environment made by ``benchmarks/peer_env.sh``), fairseq trains the
   same model in the same run as its users run it: ``fairseq-preprocess`` over the same SentencePiece
   pieces with a joined dictionary, then ``fairseq-train`` with the recipe's shape, batches
   (``--max-tokens`` counts padded tokens per side as ``train.batch_tokens`` does), optimizer,
   schedule, label smoothing and clipping, fp32 on the CPU. Its figure is target tokens (fairseq's
   ``wpb``) over the seconds of the same updates, from its per-update log.
5. With ``--profile``, each precision's timed updates run once more under torch.profiler, and the
   operators that took the most self time are printed (stderr): where an update's time goes.

Run from the repository root::

    python benchmarks/train_throughput.py --run runs/multi30k_en_de --json train.json
    python benchmarks/train_throughput.py --preset transformer-base --precisions bf16 --steps 10
    python benchmarks/train_throughput.py --device cuda --preset transformer-big --batch-tokens 16384
    python benchmarks/train_throughput.py --precisions bf16 --set model.positions=rotary
    python benchmarks/train_throughput.py --preset transformer-base --batch-tokens 25000 --host-overhead
    bash benchmarks/peer_env.sh .peer-fairseq
    python benchmarks/train_throughput.py --run runs/multi30k_en_de --fairseq .peer-fairseq/bin/python

Without ``--run`` or ``--tokenizer`` a SentencePiece model is trained first (untimed). The figures
are printed as a table and then one ``train_throughput ...`` line per precision with every figure
as key=value, to compare runs with grep; progress goes to stderr. Decoding speed is measured by
decode_speed.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from itertools import cycle, islice
from pathlib import Path

import torch

from mtkit import config
from mtkit.config import ModelConfig, RunConfig
from mtkit.data.parallel import Batch
from mtkit.launch import preload_environment
from mtkit.runtime import allocator_in_use, set_threads

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "multi30k_en_de.yaml"
MATMUL_SIZE = {"cpu": 2048, "cuda": 8192}
MATMUL_REPEATS = 5
WARMUP_UPDATES = 2
PRECISIONS = ("fp32", "bf16", "auto")
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


# -- measurements (each runs in the process that reports it) -------------------------------


def matmul_gflops(dtype: torch.dtype, device: str = "cpu") -> float:
    """Best-of-repeats GFLOP/s of an n x n x n matmul; the first call warms caches and kernels up."""
    n = MATMUL_SIZE[device]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so that a clock reading covers it."""
    if device == "cuda":
        torch.cuda.synchronize()


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


def bench_config(
    src: Path,
    tgt: Path,
    tokenizer: Path | str,
    precision: str,
    threads: int,
    preset: str | None = None,
    batch_tokens: int | None = None,
    device: str = "cpu",
    extra: list[str] = (),
) -> RunConfig:
    """The recipe as it trains, on ``src``/``tgt``, with no validation or checkpoints; ``extra`` overrides last."""
    overrides = [
        f"data.train_src={src}",
        f"data.train_tgt={tgt}",
        "data.valid_src=",
        "data.valid_tgt=",
        f"tokenizer.model={tokenizer}",
        f"train.precision={precision}",
        f"train.device={device}",
        f"train.threads={threads}",
        "train.valid_every=0",
        "train.save_every=0",
        "model.positions=sinusoidal",  # fairseq's transformer has these, so both train one model
    ]
    overrides += [f"model.preset={preset}"] if preset else []
    overrides += [f"train.batch_tokens={batch_tokens}"] if batch_tokens else []
    return config.read_config(RECIPE, [*overrides, *extra])


def measure_training(cfg: RunConfig, work: Path, steps: int, warmup: int, profile: bool = False) -> dict:
    """Throughput of ``steps`` updates of the training loop (the Trainer's batches, made as train.prefetch says,
    and its ``train_step``), after ``warmup`` updates; with ``profile``, the next ``steps`` updates under
    torch.profiler, its operators' self time printed to stderr. ``collate_s_per_update``: what making an update's
    batches costs on its own, timed apart on the same batches."""
    from mtkit.training.trainer import Trainer

    cfg = replace(cfg, train=replace(cfg.train, max_steps=warmup + steps * (2 if profile else 1)))
    trainer = Trainer(cfg, work)
    groups = trainer.update_groups()

    def train(count: int) -> list:
        taken = []
        for _ in range(count):
            group = next(groups)
            trainer.train_step(group.batches, group.tokens)
            trainer.progress.step += 1
            taken.append(group)
        return taken

    train(warmup)
    device = cfg.train.device
    synchronize(device)
    start = time.perf_counter()
    timed = train(steps)
    synchronize(device)
    seconds = time.perf_counter() - start
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train(steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)
    trainer.cleanup()
    indices = trainer.corpus.batch_indices(cfg.train.batch_tokens, cfg.train.seed, trainer.buckets.multiple)
    indices = list(islice(cycle(indices), steps * cfg.train.accum))
    start = time.perf_counter()
    for batch in indices:
        trainer.corpus.collate(batch, trainer.buckets)
    collate_seconds = time.perf_counter() - start
    batches = [batch for group in timed for batch in group.batches]
    tokens = sum(group.tokens for group in timed)
    flops = sum(train_flops(b, cfg.model, trainer.tgt_tok.vocab_size) for b in batches)
    return {
        "updates": steps,
        "seconds": seconds,
        "target_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "updates_per_s": steps / seconds,
        "s_per_update": seconds / steps,
        "collate_s_per_update": collate_seconds / steps,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "gflop_per_update": flops / steps / 1e9,
        "gflops": flops / seconds / 1e9,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --host-overhead: the preset's layers, heads and batches with almost no arithmetic in them, so that an update's
# time is what the host spends on it (Python, operator dispatch, the training loop); a 1,000-piece vocabulary, trained
# for it, keeps the output projection small too while sentences keep about their length in pieces.
HOST_OVERHEAD = ["model.d_model=8", "model.heads=2", "model.ffn=8", "tokenizer.vocab_size=1000"]


def config_for(args: argparse.Namespace, precision: str, tokenizer: Path | str) -> RunConfig:
    extra = [*(HOST_OVERHEAD if args.host_overhead else []), *args.set]
    return bench_config(
        args.src, args.tgt, tokenizer, precision, args.threads, args.preset, args.batch_tokens, args.device, extra
    )


def child_main(args: argparse.Namespace) -> None:
    """Training at one precision; prints its figures as one JSON line for the parent."""
    set_threads(args.threads)
    (precision,) = args.precisions
    cfg = config_for(args, precision, args.tokenizer)
    result = measure_training(cfg, args.work, args.steps, args.warmup, args.profile)
    print(json.dumps({**result, "peak_rss_mib": peak_rss_mib(), "allocator": allocator_in_use()}))


# -- the parent: peaks here, training in children, then the report ------------------------


def run_child(args: argparse.Namespace, precision: str, tokenizer: Path, work: Path) -> dict:
    """Train at ``precision`` in a fresh process, so its peak RSS is its own."""
    print(f"training {precision} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--precisions", precision]
    cmd += ["--src", str(args.src), "--tgt", str(args.tgt), "--tokenizer", str(tokenizer), "--work", str(work)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    cmd += ["--profile"] if args.profile else []
    cmd += ["--host-overhead"] if args.host_overhead else []
    cmd += ["--device", args.device]
    cmd += ["--preset", args.preset] if args.preset else []
    cmd += ["--batch-tokens", str(args.batch_tokens)] if args.batch_tokens else []
    cmd += [arg for override in args.set for arg in ("--set", override)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=preload_environment())
    if done.returncode:
        sys.exit(f"train_throughput: training in {precision} failed (exit {done.returncode})")
    return json.loads(done.stdout.splitlines()[-1])


def run_tokenizer(args: argparse.Namespace, work: Path) -> Path:
    """The given tokenizer, the run's, or one trained now (untimed) on the training data (with --host-overhead,
    always: its own small one)."""
    if args.tokenizer and not args.host_overhead:
        return args.tokenizer
    if args.run and not args.host_overhead:
        return args.run / "spm.model"
    from mtkit.data.parallel import iter_parallel
    from mtkit.training.tokenizers import prepare_tokenizers

    print("training the SentencePiece model (no --run or --tokenizer given) ...", file=sys.stderr, flush=True)
    cfg = config_for(args, "fp32", "")
    prepare_tokenizers(cfg, work, lambda: iter_parallel(cfg.data.train_src, cfg.data.train_tgt))
    return work / "spm.model"


# -- the peer: fairseq in its own environment ----------------------------------------------

# fairseq-train's entry point, then fairseq's version and the process's peak RSS as one JSON line.
FAIRSEQ_TRAIN = """\
import json, resource, sys
from fairseq_cli.train import cli_main  # first: it sets up the logging that the log lines come from
import fairseq
sys.argv[0] = "fairseq-train"
cli_main()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"version": fairseq.__version__, "peak_rss_mib": peak}))
"""


def fairseq_data(args: argparse.Namespace, cfg: RunConfig, tokenizer: Path, work: Path) -> Path:
    """The training pairs as the run's SentencePiece pieces, binarized by fairseq-preprocess (untimed)."""
    import sentencepiece as spm

    from mtkit.data.parallel import iter_parallel

    print("fairseq: pieces and fairseq-preprocess ...", file=sys.stderr, flush=True)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    src_lang, tgt_lang = cfg.data.src_lang, cfg.data.tgt_lang
    pieces = work / "pieces"
    pieces.mkdir(parents=True)
    with open(pieces / f"train.{src_lang}", "w") as src, open(pieces / f"train.{tgt_lang}", "w") as tgt:
        for source, target in iter_parallel(cfg.data.train_src, cfg.data.train_tgt):
            src.write(" ".join(sp.encode(source, out_type=str)) + "\n")
            tgt.write(" ".join(sp.encode(target, out_type=str)) + "\n")
    binary = work / "bin"
    cmd = [str(args.fairseq), "-m", "fairseq_cli.preprocess", "--source-lang", src_lang, "--target-lang", tgt_lang]
    cmd += ["--trainpref", str(pieces / "train"), "--destdir", str(binary), "--joined-dictionary", "--workers", "2"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return binary


def fairseq_command(args: argparse.Namespace, cfg: RunConfig, binary: Path) -> list[str]:
    """fairseq-train with the recipe's model, batches, optimizer and schedule, in fp32 on the CPU."""
    m, t = cfg.model, cfg.train
    cmd = [str(args.fairseq), "-c", FAIRSEQ_TRAIN, str(binary), "--arch", "transformer", "--cpu"]
    for side in ("encoder", "decoder"):
        cmd += [f"--{side}-layers", str(getattr(m, f"{side}_layers")), f"--{side}-embed-dim", str(m.d_model)]
        cmd += [f"--{side}-ffn-embed-dim", str(m.ffn), f"--{side}-attention-heads", str(m.heads)]
        cmd += [f"--{side}-normalize-before"] if m.norm == "pre" else []
    cmd += ["--share-all-embeddings"] if m.tie_embeddings else []
    cmd += ["--dropout", str(m.dropout), "--attention-dropout", str(m.attention_dropout)]
    cmd += ["--activation-dropout", str(m.activation_dropout)]
    cmd += ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9", "--lr", str(t.lr)]
    cmd += ["--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(t.warmup), "--clip-norm", str(t.clip_norm)]
    cmd += ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", str(t.label_smoothing)]
    cmd += ["--max-tokens", str(t.batch_tokens), "--required-batch-size-multiple", "1", "--seed", str(t.seed)]
    cmd += ["--max-update", str(args.warmup + args.steps), "--disable-validation", "--no-save"]
    return cmd + ["--log-format", "json", "--log-interval", "1"]


def run_fairseq(args: argparse.Namespace, cfg: RunConfig, tokenizer: Path, work: Path) -> dict:
    """fairseq's fp32 training figures over the same number of updates, after the same warm-up."""
    binary = fairseq_data(args, cfg, tokenizer, work / "fairseq")
    print("training fairseq fp32 ...", file=sys.stderr, flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    cmd = fairseq_command(args, cfg, binary)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=work / "fairseq")
    if done.returncode:
        sys.exit(f"train_throughput: fairseq-train failed (exit {done.returncode})")
    lines = done.stdout.splitlines()
    updates = [json.loads(line.rsplit(" | ", 1)[1]) for line in lines if "| train_inner |" in line]
    params = [re.search(r"num\. shared model params: ([\d,]+)", line) for line in lines]
    params = [int(m[1].replace(",", "")) for m in params if m]
    timed = updates[args.warmup :]
    if len(timed) != args.steps:
        sys.exit(f"train_throughput: fairseq logged {len(updates)} updates, expected {args.warmup + args.steps}")
    tokens = sum(float(u["wpb"]) for u in timed)
    seconds = sum(float(u["wpb"]) / float(u["wps"]) for u in timed)
    return {
        **json.loads(lines[-1]),  # version, peak_rss_mib
        "updates": args.steps,
        "seconds": seconds,
        "target_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "updates_per_s": args.steps / seconds,
        "parameters": params[0] if params else 0,
    }


def add_mfu(train: dict, peaks: dict) -> None:
    """Model FLOPs utilisation of each training result against each measured matmul peak."""
    for result in train.values():
        result["mfu"] = {name: result["gflops"] / peak for name, peak in peaks.items()}


def render(figures: dict) -> str:
    """The figures as a table, then one greppable key=value line per precision."""
    peaks = figures["matmul_gflops"]
    gpu = figures["device"] != "cpu"
    allocator = next(iter(figures["train"].values()))["allocator"]
    out = [
        f"{figures['corpus']} | {figures['preset']}, {figures['parameters']:,} parameters | "
        f"torch {figures['torch']} | {allocator} allocator | {figures['device']}"
        + ("" if gpu else f", {figures['threads']} threads")
        + "".join(f" | --set {o}" for o in figures["overrides"]),
        "",
        f"matmul peak ({figures['matmul_size']}^3): " + "   ".join(f"{k} {v:,.1f} GFLOP/s" for k, v in peaks.items()),
        "",
        f"training: {figures['steps']} timed updates after {figures['warmup']} warm-up,"
        f" batch_tokens {figures['batch_tokens']}",
        *[
            f"{name}: {r['s_per_update'] * 1e3:,.1f} ms per update, of which making its batches alone takes "
            f"{r['collate_s_per_update'] * 1e3:,.1f} ms (done ahead by a thread under train.prefetch > 0)"
            for name, r in figures["train"].items()
        ],
        f"{'precision':<10}{'tgt tok/s':>11}{'upd/s':>8}{'GFLOP/upd':>11}{'GFLOP/s':>9}"
        f"{'MFU fp32pk':>12}{'MFU bf16pk':>12}{'peak MiB':>10}" + (f"{'GPU MiB':>10}" if gpu else ""),
    ]
    for name, r in figures["train"].items():
        out.append(
            f"{name:<10}{r['tokens_per_s']:>11,.0f}{r['updates_per_s']:>8.3f}{r['gflop_per_update']:>11.1f}"
            f"{r['gflops']:>9.1f}{r['mfu']['fp32']:>12.1%}{r['mfu']['bf16']:>12.1%}{r['peak_rss_mib']:>10,.0f}"
            + (f"{r['peak_gpu_mib']:>10,.0f}" if gpu else "")
        )
    peer = figures.get("peer")
    if peer:
        name = f"fairseq {peer['version']} fp32"
        out.append(
            f"{name}: {peer['tokens_per_s']:,.0f} tgt tok/s, {peer['updates_per_s']:.3f} upd/s, "
            f"{peer['parameters']:,} parameters, peak {peer['peak_rss_mib']:,.0f} MiB"
        )
        out += [
            f"mtkit {precision} / fairseq fp32: {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x"
            for precision, r in figures["train"].items()
        ]
    out.append("")
    for name, r in figures["train"].items():
        out.append(
            f"train_throughput device={figures['device'].replace(' ', '_')} preset={figures['preset']} "
            f"precision={name} batch_tokens={figures['batch_tokens']} "
            + "".join(f"set={o} " for o in figures["overrides"])
            + f"tokens_per_s={r['tokens_per_s']:.0f} updates_per_s={r['updates_per_s']:.3f} "
            f"ms_per_update={r['s_per_update'] * 1e3:.2f} collate_ms_per_update={r['collate_s_per_update'] * 1e3:.2f} "
            f"gflops={r['gflops']:.1f} mfu_fp32_peak={r['mfu']['fp32']:.3f} mfu_bf16_peak={r['mfu']['bf16']:.3f} "
            f"peak_rss_mib={r['peak_rss_mib']:.0f}" + (f" peak_gpu_mib={r['peak_gpu_mib']:.0f}" if gpu else "")
        )
    if peer:
        out.append(
            f"train_throughput peer=fairseq version={peer['version']} precision=fp32 "
            f"batch_tokens={figures['batch_tokens']} tokens_per_s={peer['tokens_per_s']:.0f} "
            f"updates_per_s={peer['updates_per_s']:.3f} peak_rss_mib={peer['peak_rss_mib']:.0f}"
        )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=MULTI30K / "train.en.gz", help="training source file")
    p.add_argument("--tgt", type=Path, default=MULTI30K / "train.de.gz", help="training target file")
    p.add_argument("--run", type=Path, help="a trained run directory whose tokenizer to use")
    p.add_argument("--tokenizer", type=Path, help="a joint SentencePiece model to use")
    p.add_argument("--preset", help="model.preset (default: the Multi30k recipe's transformer-small)")
    p.add_argument("--batch-tokens", type=int, help="train.batch_tokens (default: the recipe's)")
    p.add_argument(
        "--set", action="append", default=[], help="any config override, e.g. --set model.positions=rotary (repeatable)"
    )
    p.add_argument("--steps", type=int, default=20, help="timed training updates per precision")
    p.add_argument("--warmup", type=int, default=WARMUP_UPDATES, help="untimed updates first")
    p.add_argument(
        "--profile", action="store_true", help="then profile the timed updates again: operators by self time"
    )
    p.add_argument(
        "--precisions",
        type=lambda s: s.split(","),
        default=["fp32", "bf16"],
        help="comma-separated: fp32,bf16,auto (auto: bf16 where the device computes it natively, else fp32)",
    )
    p.add_argument(
        "--host-overhead",
        action="store_true",
        help="shrink the arithmetic to almost nothing (d_model 16, a 1,000-piece vocabulary), keeping the preset's "
        "layers and batches: the time of an update is then its host time",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train and measure the peak")
    p.add_argument(
        "--fairseq", type=Path, help="python of an environment with fairseq (benchmarks/peer_env.sh): train it too"
    )
    p.add_argument("--json", type=Path, help="also write all figures to this JSON file")
    # Internal: how the parent starts a child for one precision.
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in args.precisions:
        if name not in PRECISIONS:
            p.error(f"--precisions: {name!r} is not one of {', '.join(PRECISIONS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    set_threads(args.threads)
    print("matmul peaks ...", file=sys.stderr, flush=True)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {name: matmul_gflops(dtype, args.device) for name, dtype in dtypes.items()}
    with tempfile.TemporaryDirectory(prefix="train_throughput.") as tmp:
        work = Path(tmp)
        tokenizer = run_tokenizer(args, work)
        train = {p: run_child(args, p, tokenizer, work / p) for p in args.precisions}
        cfg = config_for(args, args.precisions[0], tokenizer)
        peer = run_fairseq(args, cfg, tokenizer, work) if args.fairseq else None
    add_mfu(train, peaks)
    figures = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "corpus": f"{args.src.name} / {args.tgt.name}",
        "preset": cfg.model.preset,
        "overrides": [*(HOST_OVERHEAD if args.host_overhead else []), *args.set],
        "parameters": next(iter(train.values()))["parameters"],
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_tokens": cfg.train.batch_tokens,
        "matmul_size": MATMUL_SIZE[args.device],
        "matmul_gflops": peaks,
        "train": train,
        **({"peer": peer} if peer else {}),
    }
    print(render(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
