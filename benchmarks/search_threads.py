"""Several models' continuous searches, without a server: stepped in turn by one thread, or each by a thread of its
own, with torch on --torch-threads threads; sentences/s over --seconds, each search kept --in-flight lines full.

What `mtkit serve` of several models chooses between (mtkit.serving.searches.ModelSteps):

    python benchmarks/search_threads.py --src ../shared/data/multi30k/test_2016_flickr.en.gz --mode in-turn \\
        --torch-threads 2 --models runs/earlier/average-last3.safetensors runs/earlier/best \\
        runs/earlier/checkpoints/update-00001600
    python benchmarks/search_threads.py ... --mode threads --torch-threads 1
"""

from __future__ import annotations

import argparse
import gzip
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import mtkit
from mtkit.decoding.continuous import LineSearch


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def keep_full(search: LineSearch, numbers: Iterator[int], lines: list[str], in_flight: int) -> None:
    while len(search) < in_flight:
        number = next(numbers)
        search.add(number, lines[number % len(lines)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, nargs="+", required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--mode", choices=["in-turn", "threads"], required=True)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=21)
    parser.add_argument("--seconds", type=float, default=25.0)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    lines = read_lines(args.src)
    searches = [LineSearch(mtkit.load(model)) for model in args.models]
    for search in searches:  # warm up: the first steps allocate
        keep_full(search, iter(range(10**6, 2 * 10**6)), lines, args.in_flight)
        for _ in range(30):
            search.step()
        search.drop(set(range(10**6, 2 * 10**6)))
    numbers = [iter(range(k * 1000, 10**6)) for k in range(len(searches))]
    done = [0] * len(searches)
    stop_at = time.monotonic() + args.seconds

    def step(k: int) -> None:
        done[k] += len(searches[k].step())
        keep_full(searches[k], numbers[k], lines, args.in_flight)

    def run_alone(k: int) -> None:
        while time.monotonic() < stop_at:
            step(k)

    start = time.perf_counter()
    if args.mode == "in-turn":
        while time.monotonic() < stop_at:
            for k in range(len(searches)):
                step(k)
    else:
        threads = [threading.Thread(target=run_alone, args=(k,)) for k in range(len(searches))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    elapsed = time.perf_counter() - start
    each = ", ".join(f"{count / elapsed:.1f}" for count in done)
    print(f"{args.mode} torch_threads={args.torch_threads}: {sum(done) / elapsed:.1f} sentences/s ({each})")


if __name__ == "__main__":
    main()
