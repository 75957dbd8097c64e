"""Does reduced precision train as well? Validation BLEU after the same number of updates, per precision.

Speed from bf16 counts only if the model learns as well as in fp32. This trains the Multi30k recipe
(same seed, data order and tokenizer) once per precision for ``--steps`` updates with ``mtkit
train``, then reads the validation figures at the last update from each run's metrics.jsonl:
valid BLEU (beam search, as the recipe validates), valid loss, and the mean target tokens/s of
the training log lines. The first precision is the reference for the BLEU difference. Two runs
differ in their rounding and so drift apart; ``--seed`` (train.seed: initialisation, dropout and
batch order) shows how far two runs of one precision spread anyway, the yardstick for that difference.

Run from the repository root (about 40 minutes on a 2-core CPU at the default 1,200 updates)::

    python benchmarks/precision_parity.py --run runs/multi30k_en_de --steps 1200

Output: a table, then one ``precision_parity`` line per precision with every figure as key=value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from train_throughput import MULTI30K, RECIPE, REPO


def train(args: argparse.Namespace, precision: str, out: Path) -> dict:
    """Train at ``precision`` into ``out``; the last validation record and the mean logged speed."""
    overrides = {
        "data.train_src": args.src,
        "data.train_tgt": args.tgt,
        "data.valid_src": args.valid_src,
        "data.valid_tgt": args.valid_tgt,
        "data.cache_dir": out.parent / "encoded",
        "tokenizer.model": args.tokenizer or args.run / "spm.model",
        "train.max_steps": args.steps,
        "train.valid_every": args.steps,
        "train.save_every": args.steps,
        "train.log_every": min(50, args.steps),
        "train.device": args.device,
        "train.seed": args.seed,
    }
    cmd = [sys.executable, "-m", "mtkit", "train", str(RECIPE), "--out", str(out), "--precision", precision]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    print(f"training {precision} for {args.steps} updates ...", file=sys.stderr, flush=True)
    with open(out.parent / f"{precision}.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode:
        sys.exit(f"precision_parity: training in {precision} failed; see {out.parent / f'{precision}.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["event"] == "valid"][-1]
    speeds = [r["tgt_tokens_per_s"] for r in records if r["event"] == "train"]
    return {
        "step": valid["step"],
        "seed": args.seed,
        "valid_bleu": valid["valid_bleu"],
        "valid_loss": valid["valid_loss"],
        "tokens_per_s": sum(speeds) / len(speeds),
    }


def render(results: dict[str, dict]) -> str:
    reference = next(iter(results.values()))["valid_bleu"]
    out = [f"{'precision':<10}{'updates':>8}{'valid BLEU':>12}{'vs first':>10}{'valid loss':>12}{'tgt tok/s':>11}"]
    for name, r in results.items():
        r["bleu_delta"] = r["valid_bleu"] - reference
        out.append(
            f"{name:<10}{r['step']:>8}{r['valid_bleu']:>12.2f}{r['bleu_delta']:>+10.2f}"
            f"{r['valid_loss']:>12.4f}{r['tokens_per_s']:>11,.0f}"
        )
    out.append("")
    for name, r in results.items():
        out.append(
            f"precision_parity precision={name} seed={r['seed']} steps={r['step']} valid_bleu={r['valid_bleu']:.2f} "
            f"bleu_delta={r['bleu_delta']:+.2f} valid_loss={r['valid_loss']:.4f} tokens_per_s={r['tokens_per_s']:.0f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=MULTI30K / "train.en.gz")
    p.add_argument("--tgt", type=Path, default=MULTI30K / "train.de.gz")
    p.add_argument("--valid-src", type=Path, default=MULTI30K / "val.en.gz")
    p.add_argument("--valid-tgt", type=Path, default=MULTI30K / "val.de.gz")
    p.add_argument("--run", type=Path, help="a trained run directory whose tokenizer to use")
    p.add_argument("--tokenizer", type=Path, help="a joint SentencePiece model to use")
    p.add_argument("--steps", type=int, default=1200, help="updates per precision")
    p.add_argument("--precisions", type=lambda s: s.split(","), default=["fp32", "bf16"], help="first = reference")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=1, help="train.seed: another seed shows how far runs spread anyway")
    p.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args(argv)
    if not (args.run or args.tokenizer):
        p.error("give --run or --tokenizer: every precision must use the same tokenizer")
    with tempfile.TemporaryDirectory(prefix="precision_parity.") as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = {precision: train(args, precision, root / precision) for precision in args.precisions}
    print(render(results))


if __name__ == "__main__":
    main()
