"""Throughput and latency of `mtkit serve` under concurrent load, with and without dynamic batching.

For each ``--max-batch-sizes`` value (default 1 and 32: one sentence per search, that is no
batching, against ``mtkit serve``'s default), the script starts ``mtkit serve RUN`` as a process of
its own on a free port of 127.0.0.1, sends one warm-up request, then has ``--clients`` threads send
the first ``--lines`` lines of test_2016_flickr one line per request, back to back on a kept-alive
connection each, until every line is answered. It reports:

- sentences/s: lines answered over the seconds from the first request to the last answer;
- latency: the median, 95th and 99th percentile of a request's round trip, in ms, as the client
  measured it (queueing, batching and search included);
- the requests that got no 200, which should be none;
- the mean batch the server searched, from its debug log (``batch of N sentences``).

The clients run on the same machine and take CPU from the server: on 2 cores the figures are a
lower bound on what the server does on its own. Output: a table, then one ``serve_load key=value``
line per setting, to compare runs with grep; the servers' logs go to stderr on failure.

Run from the repository root with a trained run directory and the serve extra installed::

    python benchmarks/serve_load.py --run runs/multi30k_en_de
    python benchmarks/serve_load.py --run runs/multi30k_en_de --clients 32 --max-batch-sizes 1,8,32,64 --beam 5
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mtkit.config import ServeConfig

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Figures:
    max_batch_size: int
    sentences_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    failed: int
    mean_batch: float

    def summary(self) -> str:
        return (
            f"serve_load max_batch_size={self.max_batch_size} sentences_per_s={self.sentences_per_s:.1f} "
            f"p50_ms={self.p50_ms:.1f} p95_ms={self.p95_ms:.1f} p99_ms={self.p99_ms:.1f} "
            f"failed={self.failed} mean_batch={self.mean_batch:.1f}"
        )


def read_lines(path: Path) -> list[str]:
    opened = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")
    with opened as f:
        return f.read().splitlines()


def start_server(args: argparse.Namespace, max_batch_size: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A `mtkit serve` process and its URL, once /health answers."""
    command = [
        sys.executable, "-m", "mtkit", "--log-level", "debug", "serve", str(args.run), "--port", "0",
        "--device", args.device, "--precision", args.precision, "--max-batch-size", str(max_batch_size),
        "--max-wait-ms", str(args.max_wait_ms), "--max-queue", str(max(args.clients, ServeConfig.max_queue)),
    ]  # fmt: skip
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"serving .* at http://([\d.]+):(\d+)", log.read_text())
        if found:
            try:
                connection = http.client.HTTPConnection(found.group(1), int(found.group(2)), timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return process, f"{found.group(1)}:{found.group(2)}"
            except OSError:
                pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def post(connection: http.client.HTTPConnection, body: dict) -> int:
    connection.request("POST", "/v1/translate", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    return response.status


def load(address: str, lines: list[str], clients: int, beam: int | None) -> tuple[float, list[float], int]:
    """Seconds for every line, each request's latency in seconds, and the requests that got no 200."""
    host, port = address.split(":")
    todo = iter(enumerate(lines))
    taking = threading.Lock()
    latencies: list[float] = []
    failed = 0

    def client() -> None:
        nonlocal failed
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        while True:
            with taking:
                item = next(todo, None)
            if item is None:
                break
            body = {"text": item[1]} | ({"beam": beam} if beam else {})
            start = time.perf_counter()
            status = post(connection, body)
            took = time.perf_counter() - start
            with taking:
                latencies.append(took)
                failed += status != 200
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, latencies, failed


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1] if len(values) > 1 else values[0]


def measure(args: argparse.Namespace, lines: list[str], max_batch_size: int, log: Path) -> Figures:
    process, address = start_server(args, max_batch_size, log)
    try:
        host, port = address.split(":")
        post(http.client.HTTPConnection(host, int(port), timeout=120), {"text": lines[:8]})  # warm-up
        seconds, latencies, failed = load(address, lines, args.clients, args.beam)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    if code != 0:
        raise SystemExit(f"the server exited with status {code}:\n{log.read_text()}")
    batches = [int(n) for n in re.findall(r"batch of (\d+) sentences", log.read_text())[1:]]  # less the warm-up
    ms = [latency * 1000 for latency in latencies]
    return Figures(
        max_batch_size, len(lines) / seconds, percentile(ms, 50), percentile(ms, 95), percentile(ms, 99),
        failed, statistics.mean(batches) if batches else 0.0,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="trained run directory (tokenizer and best/)")
    p.add_argument(
        "--source",
        type=Path,
        default=REPO.parent / "shared" / "data" / "multi30k" / "test_2016_flickr.en.gz",
        help="the lines to translate, plain or .gz",
    )
    p.add_argument("--lines", type=int, default=1000, help="translate the first N lines of --source")
    p.add_argument("--clients", type=int, default=16, help="concurrent client threads, one request at a time each")
    p.add_argument(
        "--max-batch-sizes", default=f"1,{ServeConfig.max_batch_size}", help="mtkit serve --max-batch-size values"
    )
    p.add_argument("--max-wait-ms", type=float, default=ServeConfig.max_wait_ms, help="mtkit serve --max-wait-ms")
    p.add_argument("--beam", type=int, help="each request's beam (default: the model's)")
    p.add_argument("--device", default="cpu", help="mtkit serve --device")
    p.add_argument("--precision", default="fp32", help="mtkit serve --precision")
    args = p.parse_args()

    lines = [line for line in read_lines(args.source)[: args.lines] if line.strip()]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(value) for value in args.max_batch_sizes.split(",")):
            print(f"max batch size {size}: {len(lines)} lines from {args.clients} clients ...", file=sys.stderr)
            results.append(measure(args, lines, size, Path(tmp) / f"serve-{size}.log"))
    print("| --max-batch-size | sentences/s | p50 ms | p95 ms | p99 ms | mean batch | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for f in results:
        print(
            f"| {f.max_batch_size} | {f.sentences_per_s:.1f} | {f.p50_ms:.0f} | {f.p95_ms:.0f} | {f.p99_ms:.0f} "
            f"| {f.mean_batch:.1f} | {f.failed} |"
        )
    for f in results:
        print(f.summary())


if __name__ == "__main__":
    main()
