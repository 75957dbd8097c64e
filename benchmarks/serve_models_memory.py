"""Memory of one ``mtkit serve`` of several models, with no bound and with --max-loaded: how much the bound saves.

Builds --models models of one size (random weights, different seeds; the tokenizer and data settings of --run),
serves them all from one server on 127.0.0.1, and has as many clients, one per model, ask for short translations
(greedy) at once for --seconds, so that a server with room for fewer models loads and evicts them all the time.
Reports, for each bound, the server's peak and final resident memory, the requests answered and failed, and the
loads and evictions /metrics counted; and one model's weights in memory, for scale.

    python benchmarks/serve_models_memory.py --run runs/earlier --out /tmp/serve_memory --d-model 1024 --layers 6
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import httpx
import torch
from serve_load import Server, loads_and_evictions, rss_mib

from mtkit.data.tokenizer import PAD_ID, Tokenizer
from mtkit.model.checkpoint import read_meta, weights_file
from mtkit.model.loading import resolve
from mtkit.model.transformer import build_model
from mtkit.training.run_directory import save_in_run

MIB = 1024 * 1024


def build_models(args: argparse.Namespace) -> list[Path]:
    """``args.models`` runs of the asked size, each one checkpoint of random weights beside --run's tokenizer."""
    checkpoint = resolve(args.run)
    meta, cfg = read_meta(weights_file(checkpoint))
    model_cfg = dataclasses.replace(
        cfg.model, d_model=args.d_model, ffn=4 * args.d_model, heads=args.d_model // 64,
        encoder_layers=args.layers, decoder_layers=args.layers,
    )  # fmt: skip
    cfg = dataclasses.replace(cfg, model=model_cfg)
    records = meta["tokenizer"]
    runs = []
    for seed in range(args.models):
        run = args.out / f"model-{seed}"
        if not run.exists():
            torch.manual_seed(seed)
            vocab = Tokenizer(args.run / records["src"]["file"]).vocab_size
            network = build_model(cfg.model, vocab, vocab, PAD_ID)
            run.mkdir(parents=True)
            for record in records.values():
                shutil.copy(args.run / record["file"], run / record["file"])
            save_in_run(run, 1, network.state_dict(), {"config": cfg.to_dict(), "tokenizer": records}, None, 0)
        runs.append(run)
    return runs


async def ask(url: str, model: str, stop_at: float, counts: dict[str, int]) -> None:
    """One client asking ``model`` for a short greedy translation, back to back, until ``stop_at``."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < stop_at:
            response = await http.post("/v1/translate", json={"text": "A dog runs.", "model": model, "beam": 1})
            counts["answered" if response.status_code == 200 else "failed"] += 1


def measure(args: argparse.Namespace, runs: list[Path], max_loaded: int) -> dict[str, float]:
    """One server of ``runs`` with ``max_loaded`` (0: no bound) under one client per model for --seconds."""
    options = [item for i, run in enumerate(runs) for item in ("--model", f"m{i}={run}")]
    if max_loaded:
        options += ["--max-loaded", str(max_loaded)]
    server = Server(args, [*options, "--precision", "fp32"], args.out / f"serve-{max_loaded}.log")
    counts = {"answered": 0, "failed": 0}
    stop_at = time.monotonic() + args.seconds

    async def every_client() -> None:
        await asyncio.gather(*(ask(server.url, f"m{i}", stop_at, counts) for i in range(len(runs))))

    asyncio.run(every_client())
    figures = {
        "peak_mib": rss_mib(server.process.pid, "VmHWM"),
        "end_mib": rss_mib(server.process.pid),
        **counts,
    }
    figures["loads"], figures["evictions"] = loads_and_evictions(server)
    figures["exit"] = server.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a run whose tokenizer and data settings to use")
    parser.add_argument("--out", type=Path, required=True, help="where the models and servers' logs go")
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="in the encoder, and in the decoder")
    parser.add_argument("--bounds", type=int, nargs="+", default=[0, 2], help="--max-loaded of each server; 0: none")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    args = parser.parse_args()
    args.serve_args, args.model = [], None
    runs = build_models(args)
    size = sum(path.stat().st_size for path in runs[0].rglob("*.safetensors")) / MIB
    print(f"models={len(runs)} d_model={args.d_model} layers={args.layers} weights_mib_each={size:.0f} "
          f"seconds={args.seconds} torch={torch.__version__}")  # fmt: skip
    print("| --max-loaded | peak RSS MiB | end RSS MiB | answered | failed | loads | evictions | exit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for bound in args.bounds:
        got = measure(args, runs, bound)
        print(
            f"| {bound or 'none'} | {got['peak_mib']:.0f} | {got['end_mib']:.0f} | {got['answered']} | {got['failed']} "
            f"| {got['loads']} | {got['evictions']} | {got['exit']} |"
        )


if __name__ == "__main__":
    sys.exit(main())
