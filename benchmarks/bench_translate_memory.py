"""Memory of `mtkit translate` on a long input: does it stay flat from the first chunk to the last?

Feeds ``--lines`` lines (Multi30k train.en, cycled; 1,000,000 by default) through a pipe into
``mtkit translate RUN`` and reads its output from another, as a shell pipeline would. It samples
the translator's resident memory (VmRSS) every half second and reports it at 10%, 50% and 100% of
the input, with the kernel's peak figure, and checks that exactly one output line came back per input line.

The search settings default to beam 1 and outputs of at most 2 tokens, so a million lines take
minutes rather than hours on a CPU; memory per batch is set by --batch-size and --batch-tokens,
which are the same for any beam, and the input is held a chunk (10,000 lines) at a time.

    python benchmarks/bench_translate_memory.py --run runs/multi30k_en_de --json memory.json
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def resident_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="trained run directory")
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "multi30k")
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--max-len-a", type=float, default=0.0)
    p.add_argument("--max-len-b", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = p.parse_args()

    with gzip.open(args.data_dir / "train.en.gz", "rt", encoding="utf-8") as f:
        corpus = f.read().splitlines()
    cmd = [sys.executable, "-m", "mtkit", "translate", str(args.run), "--beam", str(args.beam)]
    cmd += ["--max-len-a", str(args.max_len_a), "--max-len-b", str(args.max_len_b)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def feed() -> None:
        """Blocks of 1,000 lines, as fast as the pipe takes them (like zcat upstream)."""
        lines = itertools.islice(itertools.cycle(corpus), args.lines)
        while block := list(itertools.islice(lines, 1000)):
            child.stdin.write("".join(line + "\n" for line in block).encode("utf-8"))
        child.stdin.close()

    samples: list[tuple[int, float]] = []  # (output lines so far, resident MiB)
    written = 0

    def sample() -> None:
        while child.poll() is None:
            rss = resident_mib(child.pid)
            if rss is not None:
                samples.append((written, rss))
            time.sleep(0.5)

    start = time.perf_counter()
    threading.Thread(target=feed, daemon=True).start()
    threading.Thread(target=sample, daemon=True).start()
    for _ in child.stdout:
        written += 1
    code = child.wait()
    seconds = time.perf_counter() - start
    if code:
        sys.exit(f"mtkit translate failed with exit status {code}")

    def at(fraction: float) -> float:
        """Resident memory at the first sample taken once this fraction of the output was written."""
        return next((rss for done, rss in samples if done >= fraction * args.lines), samples[-1][1])

    figures = {
        "lines_in": args.lines,
        "lines_out": written,
        "seconds": seconds,
        "lines_per_s": written / seconds,
        "rss_mib_at_10pct": at(0.1),
        "rss_mib_at_50pct": at(0.5),
        "rss_mib_at_end": samples[-1][1],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,  # the kernel's exact peak
    }
    for name, value in figures.items():
        print(f"{name:<18}{value:>14,.1f}" if isinstance(value, float) else f"{name:<18}{value:>14,}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if written != args.lines:
        sys.exit(f"{written} output lines for {args.lines} input lines")


if __name__ == "__main__":
    main()
