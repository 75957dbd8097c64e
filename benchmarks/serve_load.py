"""Throughput and latency of ``mtkit serve`` under concurrent clients, against ``mtkit translate``.

Starts ``mtkit serve MODEL`` on 127.0.0.1 (a free port) and, for each concurrency in --clients, runs
that many clients for --seconds (in one event loop), each sending the test set one line per request
(each client from its own offset) over one keep-alive connection. It reports sentences/s, p50/p95/p99 latency and
failed requests per concurrency, and the server's resident memory: peak, and sampled once a second,
at the start and the end of the run (with --soak SECONDS, a last round at the highest concurrency
for that long, so that growth shows). For reference, the same lines through ``mtkit translate -i``
(batch throughput, the model's load time taken out), one line at a time through the library, and the
server's continuous search without HTTP, as many lines always in it as the most clients.

    python benchmarks/serve_load.py --model runs/multi30k_en_de/average-last5.safetensors \\
        --src ../shared/data/multi30k/test_2016_flickr.en.gz
    python benchmarks/serve_load.py ... --clients 64 --seconds 30 --soak 600   # the memory soak

With --models NAME=PATH ... (several), it measures one server of all of them against one process per model: first
that the server's answers (each request naming its model) are ``mtkit translate``'s of each model on --check lines;
then, for each setting, the most clients spread evenly over the models for --seconds: every model in one server,
the same server with --max-loaded 2 (fewer models in memory than asked for), and one server per model, all at once.
It reports sentences/s and p50/p95 latency per model, failures, the servers' peak resident memory together, and the
loads and evictions /metrics counted.

    python benchmarks/serve_load.py --src ../shared/data/multi30k/test_2016_flickr.en.gz --clients 64 \
        --models avg=runs/earlier/average-last3.safetensors best=runs/earlier/best \
        u1600=runs/earlier/checkpoints/update-00001600
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MIB = 1024 * 1024


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int, field_name: str = "VmRSS") -> float:
    """A /proc/PID/status memory field (VmRSS now, VmHWM the peak), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {field_name} for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (/proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mtkit_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mtkit", *args]


class Server:
    """``mtkit serve`` in a child process, ready once /health answers 200."""

    def __init__(
        self, args: argparse.Namespace, models: list[str] | None = None, log: Path | None = None, threads: int = 0
    ) -> None:
        """``models``: what `mtkit serve` is told to serve (its model by default); ``log``: its output (--log);
        ``threads``: its torch threads (--threads by default)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        served = models if models is not None else [str(args.model)]
        command = mtkit_command("serve", *served, "--port", str(self.port), *args.serve_args)
        log = log or args.log
        self.log = open(log, "w", encoding="utf-8")  # noqa: SIM115 - open while the server runs
        env = environment(args) | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"mtkit serve exited with {self.process.returncode}; see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"mtkit serve was not ready after 300 s; see {log}")

    def stop(self) -> int:
        self.process.terminate()
        code = self.process.wait(timeout=120)
        self.log.close()
        return code


def environment(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}


@dataclass
class Round:
    clients: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    server_cpu_s: float = 0.0  # CPU time the server used in the round
    client_cpu_s: float = 0.0  # ...and the clients (this process): the two share the machine's cores

    def row(self) -> dict[str, float]:
        ms = sorted(1000 * t for t in self.latencies)

        def pct(p: float) -> float:
            return ms[min(len(ms) - 1, int(p * len(ms)))] if ms else float("nan")

        return {
            "clients": self.clients,
            "sentences_per_s": len(ms) / self.seconds,
            "p50_ms": pct(0.50),
            "p95_ms": pct(0.95),
            "p99_ms": pct(0.99),
            "requests": len(ms),
            "failed": self.failures,
            "rss_start_mib": self.rss_start_mib,
            "rss_end_mib": self.rss_end_mib,
            "server_cores": self.server_cpu_s / self.seconds,
            "client_cores": self.client_cpu_s / self.seconds,
        }


async def client(
    port: int, lines: list[str], offset: int, stop_at: float, result: Round, model: str | None = None
) -> None:
    """One client: POST /v1/translate, one line per request (for ``model``, where given), back to back on one
    kept-alive connection.

    HTTP/1.1 is written and read by hand over asyncio streams: the load generator shares the server's
    cores, and this costs a tenth of the CPU time per request that a thread per client with httpx does.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = offset
    try:
        while time.monotonic() < stop_at:
            request = {"text": lines[i % len(lines)]} | ({"model": model} if model else {})
            body = json.dumps(request).encode()
            head = "POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            start = time.perf_counter()
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status, headers = await read_head(reader)
            answer = await reader.readexactly(int(headers["content-length"]))
            elapsed = time.perf_counter() - start
            if status == 200 and len(json.loads(answer)["translations"]) == 1:
                result.latencies.append(elapsed)
            else:
                result.failures += 1
            i += 1
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError):
        result.failures += 1
    finally:
        writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status code and headers (names lower-cased)."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    return int(lines[0].split()[1]), {name.lower(): value for name, value in headers.items()}


def load_round(server: Server, lines: list[str], clients: int, seconds: float) -> Round:
    """``clients`` clients in one event loop, each sending one line per request until ``seconds`` have passed."""
    result = Round(clients, rss_start_mib=rss_mib(server.process.pid))
    stop_at = time.monotonic() + seconds

    async def every_client() -> None:
        await asyncio.gather(
            *(client(server.port, lines, k * len(lines) // clients, stop_at, result) for k in range(clients))
        )

    server_cpu, client_cpu = cpu_seconds(server.process.pid), time.process_time()
    start = time.perf_counter()
    asyncio.run(every_client())
    result.seconds = time.perf_counter() - start
    result.server_cpu_s = cpu_seconds(server.process.pid) - server_cpu
    result.client_cpu_s = time.process_time() - client_cpu
    result.rss_end_mib = rss_mib(server.process.pid)
    return result


def batch_reference(args: argparse.Namespace, lines: list[str]) -> float:
    """Sentences/s of ``mtkit translate -i`` on the lines, its start-up (loading the model) taken out."""

    def timed(path: Path) -> float:
        start = time.perf_counter()
        command = mtkit_command("translate", str(args.model), "-i", str(path), "-o", str(path) + ".out")
        subprocess.run(command, check=True, env=environment(args), capture_output=True)
        return time.perf_counter() - start

    work = args.log.parent
    one, every = work / "serve_load.one.txt", work / "serve_load.all.txt"
    one.write_text(lines[0] + "\n", encoding="utf-8")
    every.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return (len(lines) - 1) / (timed(every) - timed(one))


def alone_latency_ms(args: argparse.Namespace, lines: list[str]) -> float:
    """Median time to translate one line alone through the library, in a child process."""
    script = f"""
import statistics, sys, time, torch, mtkit
torch.set_num_threads({args.threads})
translator = mtkit.load({str(args.model)!r})
lines = sys.stdin.read().splitlines()
translator.translate(lines[:5])
times = []
for line in lines:
    start = time.perf_counter()
    translator.translate([line])
    times.append(time.perf_counter() - start)
print(1000 * statistics.median(times))
"""
    return child_figure(args, script, lines[:200])


def search_bound(args: argparse.Namespace, lines: list[str], in_flight: int) -> float:
    """Sentences/s of the server's continuous search alone, in a child process: ``in_flight`` lines always in it
    (one joins as one is done), no HTTP. What the server would give if answering HTTP cost nothing."""
    script = f"""
import sys, time, torch, mtkit
from mtkit.decoding.continuous import LineSearch
torch.set_num_threads({args.threads})
search = LineSearch(mtkit.load({str(args.model)!r}))
lines = sys.stdin.read().splitlines()
for pass_number in range(2):  # the second pass is timed, the first warms up
    queue = iter(range(len(lines)))
    for _ in range({in_flight}):
        i = next(queue)
        search.add(i, lines[i])
    done, start = 0, time.perf_counter()
    while len(search):
        for _ in search.step():
            done += 1
            i = next(queue, None)
            if i is not None:
                search.add(i, lines[i])
print(done / (time.perf_counter() - start))
"""
    return child_figure(args, script, lines)


def child_figure(args: argparse.Namespace, script: str, lines: list[str]) -> float:
    """The number a Python ``script`` prints last, run in a child process with ``lines`` on its stdin.

    Each reference runs in a process of its own, with the server's environment, so that none of them
    shares torch's threads or memory with this one.
    """
    done = subprocess.run(
        [sys.executable, "-c", script],
        input="\n".join(lines),
        capture_output=True,
        text=True,
        env=environment(args),
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def spread_round(
    targets: list[tuple[str, int, str | None]], pids: list[int], lines: list[str], clients: int, seconds: float
) -> dict[str, Round]:
    """``clients`` clients spread evenly over ``targets`` (model name, port, the model a request names or None), in
    one event loop for ``seconds``: a round per model; ``pids``, the servers', for their CPU time."""
    results = {name: Round(0) for name, _, _ in targets}
    stop_at = time.monotonic() + seconds

    async def every_client() -> None:
        jobs = []
        for k in range(clients):
            name, port, model = targets[k % len(targets)]
            results[name].clients += 1
            jobs.append(client(port, lines, k * len(lines) // clients, stop_at, results[name], model))
        await asyncio.gather(*jobs)

    server_cpu = sum(cpu_seconds(pid) for pid in pids)
    start = time.perf_counter()
    asyncio.run(every_client())
    elapsed = time.perf_counter() - start
    for result in results.values():
        result.seconds = elapsed
        result.server_cpu_s = (sum(cpu_seconds(pid) for pid in pids) - server_cpu) / len(results)
    return results


def served_answers(server: Server, model: str, lines: list[str]) -> list[str]:
    """The server's translation of each line by ``model``, one request a line (as the load sends them)."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        return [
            http.post("/v1/translate", json={"text": line, "model": model}).json()["translations"][0] for line in lines
        ]


def translated(args: argparse.Namespace, path: str, lines: list[str]) -> list[str]:
    """``mtkit translate``'s output for ``lines`` with the model at ``path``."""
    source = args.log.parent / "serve_load.check.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    command = mtkit_command("translate", path, "-i", str(source), "-o", str(source) + ".out")
    subprocess.run(command, check=True, env=environment(args), capture_output=True)
    return Path(str(source) + ".out").read_text(encoding="utf-8").splitlines()


def loads_and_evictions(server: Server) -> tuple[int, int]:
    """The model loads and evictions a server's /metrics counted."""
    from prometheus_client.parser import text_string_to_metric_families

    counted = {"mtkit_model_loads_total": 0.0, "mtkit_model_evictions_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name in counted:
                counted[sample.name] += sample.value
    return int(counted["mtkit_model_loads_total"]), int(counted["mtkit_model_evictions_total"])


def models_main(args: argparse.Namespace, lines: list[str]) -> None:
    """One server of several models against one process per model (the module's docstring)."""
    models = dict(given.split("=", 1) for given in args.models)
    clients = max(args.clients)
    print(f"models={models} lines={len(lines)} threads={args.threads} clients={clients} seconds={args.seconds}")
    options = [item for name, path in models.items() for item in ("--model", f"{name}={path}")]
    check = lines[: args.check]
    server = Server(args, options)
    mismatches = {name: sum(a != b for a, b in zip(served_answers(server, name, check), translated(args, path, check)))
                  for name, path in models.items()}  # fmt: skip
    print(f"answers_differing_from_mtkit_translate={mismatches} (of {len(check)} lines each)")
    settings: dict[str, tuple[list[Server], list[tuple[str, int, str | None]]]] = {}
    if "one" in args.settings:
        settings["one server"] = ([server], [(name, server.port, name) for name in models])
    if "bounded" in args.settings:
        bounded = Server(args, [*options, "--max-loaded", "2"], args.log.with_suffix(".bounded.log"))
        settings["one server, --max-loaded 2"] = ([bounded], [(name, bounded.port, name) for name in models])
    if "apart" in args.settings:
        threads = args.apart_threads or args.threads
        apart = [
            Server(args, [str(path)], args.log.with_suffix(f".{name}.log"), threads) for name, path in models.items()
        ]
        setting = f"a process per model, {threads} thread{'s' if threads > 1 else ''} each"
        settings[setting] = (apart, [(name, each.port, None) for name, each in zip(models, apart)])
    print("| setting | model | clients | sentences/s | p50 ms | p95 ms | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    peaks = {}
    for setting, (servers, targets) in settings.items():
        rounds = spread_round(targets, [each.process.pid for each in servers], lines, clients, args.seconds)
        for name, result in rounds.items():
            row = result.row()
            print(
                f"| {setting} | {name} | {result.clients} | {row['sentences_per_s']:.1f} | {row['p50_ms']:.0f} "
                f"| {row['p95_ms']:.0f} | {row['failed']} |"
            )
        total = sum(len(result.latencies) for result in rounds.values()) / next(iter(rounds.values())).seconds
        peaks[setting] = sum(rss_mib(each.process.pid, "VmHWM") for each in servers)
        counted = loads_and_evictions(servers[0]) if len(servers) == 1 else None
        print(f"| {setting} | all | {clients} | {total:.1f} | | | {sum(r.failures for r in rounds.values())} |")
        print(f"#  {setting}: peak RSS {peaks[setting]:.0f} MiB, model loads and evictions {counted}")
    codes = [server.stop()] + [
        each.stop() for servers, _ in settings.values() for each in servers if each is not server
    ]
    print(f"server_exits={codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the model to serve (or --models)")
    parser.add_argument("--models", nargs="+", metavar="NAME=PATH", help="several models, to compare with one each")
    parser.add_argument(
        "--check", type=int, default=100, help="with --models: lines each model's answers are checked on"
    )
    parser.add_argument(
        "--settings", nargs="+", choices=["one", "bounded", "apart"], default=["one", "bounded", "apart"],
        help="with --models: one server of them all, the same with --max-loaded 2, a process per model",
    )  # fmt: skip
    parser.add_argument("--apart-threads", type=int, default=0, help="torch threads of each process per model")
    parser.add_argument("--src", type=Path, required=True, help="the test set's source side, one line per request")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each round")
    parser.add_argument("--soak", type=float, default=0.0, help="then one round this long at the most clients")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server and the references")
    parser.add_argument("--log", type=Path, default=Path("serve_load.log"), help="the server's output")
    parser.add_argument("serve_args", nargs="*", help="more `mtkit serve` options, after --")
    args = parser.parse_args()
    lines = [line for line in read_lines(args.src) if line.strip()]
    if args.models:
        return models_main(args, lines)
    if args.model is None:
        parser.error("give --model, or --models")

    print(f"model={args.model} lines={len(lines)} threads={args.threads}")
    batch = batch_reference(args, lines)
    alone = alone_latency_ms(args, lines)
    bound = search_bound(args, lines, max(args.clients))
    print(f"translate_batch_sentences_per_s={batch:.1f} one_line_alone_p50_ms={alone:.1f}")
    print(f"continuous_search_alone_{max(args.clients)}_in_flight_sentences_per_s={bound:.1f} ({bound / batch:.0%})")
    server = Server(args)
    rounds = [load_round(server, lines, clients, args.seconds) for clients in args.clients]
    if args.soak:
        rounds.append(load_round(server, lines, max(args.clients), args.soak))
    peak = rss_mib(server.process.pid, "VmHWM")
    code = server.stop()
    print(
        "| clients | sentences/s | vs translate | p50 ms | p95 ms | p99 ms | failed | RSS start-end MiB "
        "| server cores | client cores |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rounds:
        row = r.row()
        print(
            f"| {row['clients']} | {row['sentences_per_s']:.1f} | {row['sentences_per_s'] / batch:.0%} "
            f"| {row['p50_ms']:.0f} | {row['p95_ms']:.0f} | {row['p99_ms']:.0f} | {row['failed']} "
            f"| {row['rss_start_mib']:.0f}-{row['rss_end_mib']:.0f} "
            f"| {row['server_cores']:.2f} | {row['client_cores']:.2f} |"
        )
    one_client = next((r.row() for r in rounds if r.clients == 1), None)
    if one_client:
        print(f"p50_one_client_over_alone={one_client['p50_ms'] / alone:.2f}")
    print(f"server_peak_rss_mib={peak:.0f} server_exit={code}")
    print(f"failed_requests={sum(r.failures for r in rounds)}")


if __name__ == "__main__":
    main()
