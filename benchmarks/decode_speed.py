"""Translation speed, memory and quality on Multi30k test_2016_flickr (1,000 lines), beam 5.

Each configuration runs in a child process of its own, so its peak RSS is its own, and reports:
sentences/s counted from the first input line read to the last output line written (model loading
excluded, as for OpenNMT-py's 96 sentences/s on this machine kind), and the BLEU of that output.

Configurations:
- ``mtkit-fp32`` / ``mtkit-bf16``: mtkit's own batched beam search (``mtkit.translate.Translator``),
  with the weights in that precision.
- ``mtkit-fp32-no-early-stop`` / ``mtkit-bf16-no-early-stop``: the same, searching on until ``beam``
  hypotheses have ended (fairseq's rule) instead of stopping once the best candidate has ended.
- ``mtkit-fp32-one-at-a-time`` / ``mtkit-bf16-one-at-a-time``: the same search, one sentence per
  batch, to show that batching changes speed and not the translations (same BLEU).
- ``ct2-float32`` / ``ct2-int8``: the model exported with ``mtkit export --format ctranslate2``,
  decoded by CTranslate2 (skipped when the ctranslate2 package is missing).

Run from the repository root with a trained run directory::

    python benchmarks/bench_translate.py --run runs/multi30k_en_de --json translate.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = (
    "mtkit-fp32",
    "mtkit-bf16",
    "mtkit-fp32-no-early-stop",
    "mtkit-bf16-no-early-stop",
    "mtkit-fp32-one-at-a-time",
    "mtkit-bf16-one-at-a-time",
    "ct2-float32",
    "ct2-int8",
)
BEAM = 5


def timed_translation(translator, source: Path) -> tuple[list[str], float]:
    """Outputs and seconds from opening the input to writing the last output line."""
    from mtkit.data import read_lines
    from mtkit.translate import chunked

    with tempfile.TemporaryFile("w+", encoding="utf-8") as out:
        start = time.perf_counter()
        for translations in translator.stream(chunked(read_lines(source))):
            out.write(translations[0].text + "\n")
        out.flush()
        seconds = time.perf_counter() - start
        out.seek(0)
        return out.read().splitlines(), seconds


def make_translator(name: str, run: Path, export_dir: Path, threads: int):
    import torch

    from mtkit.checkpoint import load_for_inference
    from mtkit.config import DecodeConfig
    from mtkit.runtime import set_threads

    set_threads(threads)
    device = torch.device("cpu")
    decode = DecodeConfig(
        beam=BEAM, batch_size=1 if name.endswith("one-at-a-time") else 128, early_stop="no-early-stop" not in name
    )
    if name.startswith("ct2-"):
        from mtkit.export import CTranslate2Translator

        return CTranslate2Translator.from_dir(export_dir, decode, "cpu", "default")  # the export's own weight type
    from mtkit.translate import Translator

    dtype = torch.bfloat16 if name.startswith("mtkit-bf16") else torch.float32
    bundle = load_for_inference(run, device, dtype)
    return Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, decode, device)


def child_main(args: argparse.Namespace) -> None:
    """One configuration; prints its figures as one JSON line."""
    from mtkit.data import read_lines
    from mtkit.metrics import bleu

    translator = make_translator(args.config, args.run, args.export_dir, args.threads)
    # The fastest of --repeat passes: other tenants of a shared machine only ever slow a pass down.
    runs = [timed_translation(translator, args.data_dir / "test_2016_flickr.en.gz") for _ in range(args.repeat)]
    hyps, seconds = min(runs, key=lambda run: run[1])
    refs = read_lines(args.data_dir / "test_2016_flickr.de.gz")
    score = bleu(hyps, refs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"lines": len(hyps), "seconds": seconds, "sentences_per_s": len(hyps) / seconds}
    print(json.dumps({**result, "bleu": score.value, "signature": score.signature, "peak_rss_mib": peak}))


def run_child(args: argparse.Namespace, config: str, export_dir: Path) -> dict | None:
    print(f"{config} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--config", config, "--run", str(args.run)]
    cmd += ["--data-dir", str(args.data_dir), "--threads", str(args.threads), "--export-dir", str(export_dir)]
    cmd += ["--repeat", str(args.repeat)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        print(f"{config} failed (exit {done.returncode})", file=sys.stderr)
        return None
    return json.loads(done.stdout.splitlines()[-1])


def export(run: Path, quantization: str, out: Path) -> bool:
    """The run exported for CTranslate2; False when the ctranslate2 package is missing."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    from mtkit.export import export_ctranslate2

    export_ctranslate2(run, out, quantization)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="trained run directory (tokenizer and best/)")
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "multi30k")
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 for the default")
    p.add_argument("--repeat", type=int, default=1, help="translate the test set this many times; report the fastest")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--export-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.config:
        child_main(args)
        return
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            export_dir = Path(tmp) / config
            if config.startswith("ct2-") and not export(args.run, config.removeprefix("ct2-"), export_dir):
                print(f"{config}: skipped (pip install ctranslate2)", file=sys.stderr)
                continue
            figures[config] = run_child(args, config, export_dir)
    print(f"{'configuration':<26}{'sent/s':>9}{'seconds':>9}{'BLEU':>7}{'peak MiB':>10}")
    for name, r in figures.items():
        if r is not None:
            print(
                f"{name:<26}{r['sentences_per_s']:>9.1f}{r['seconds']:>9.1f}{r['bleu']:>7.2f}{r['peak_rss_mib']:>10,.0f}"
            )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
