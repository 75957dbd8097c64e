"""Peak memory and time of encoding one long input, with and without an attention window.

Each case runs in a fresh process, so one case's allocator cache cannot hide another's peak. The
figure is the peak resident memory during ``model.encode`` above what the process held just before
(model and input built). The model is the Multi30k recipe's transformer-small (3 layers, d 256,
4 heads), fp32, no gradients, one sentence.

    python benchmarks/attention_memory.py --lengths 4096 --windows 0 64 256
    python benchmarks/attention_memory.py --lengths 1024 2048 4096 8192 --windows 0 64  # how it grows
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from mtkit.config import ModelConfig
from mtkit.model.transformer import build_model


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(length: int, positions: str, window: int, threads: int) -> dict:
    """One case, in this process: the peak memory and time of encoding ``length`` tokens."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        preset="transformer-small", positions=positions, attention_window=window, max_positions=length + 1
    )
    model = build_model(cfg, 8000, 8000, 0).eval()
    src = torch.randint(4, 8000, (1, length))
    pad = torch.zeros_like(src, dtype=torch.bool)
    before = current_rss_mib()
    start = time.perf_counter()
    with torch.no_grad():
        model.encode(src, pad)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"positions": positions, "window": window, "length": length, "peak_mib": peak - before, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096], help="tokens in the input")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 64, 256], help="model.attention_window values")
    p.add_argument("--positions", nargs="+", default=["sinusoidal", "relative", "rotary"], help="model.positions")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(int(args.child[2]), args.child[0], int(args.child[1]), args.threads)))
        return
    print(f"{'positions':<11} {'window':>6} {'length':>6} {'peak MiB':>9} {'seconds':>8}")
    for positions in args.positions:
        for window in args.windows:
            for length in args.lengths:
                command = [sys.executable, __file__, "--threads", str(args.threads)]
                out = subprocess.run(
                    [*command, "--child", positions, str(window), str(length)], capture_output=True, text=True
                )
                if out.returncode:
                    sys.exit(out.stderr)
                r = json.loads(out.stdout)
                print(f"{positions:<11} {window:>6} {length:>6} {r['peak_mib']:>9.1f} {r['seconds']:>8.3f}")
                print(
                    f"attention_memory positions={positions} window={window} length={length} "
                    f"peak_mib={r['peak_mib']:.1f} seconds={r['seconds']:.3f}"
                )


if __name__ == "__main__":
    main()
