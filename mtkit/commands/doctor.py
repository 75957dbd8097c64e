"""``mtkit doctor``: what a run would use on this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mtkit.commands.common import examples

commands = typer.Typer()
GEMM_NAMES = {"aten": "ATen's matrix product", "onednn": "oneDNN over packed weights"}  # runtime's *_gemm choices


@commands.command("doctor", epilog=examples("mtkit doctor", "mtkit doctor --path runs/ --json"))
def doctor_command(
    path: Annotated[
        Path,
        typer.Option(
            "--path", help="Where runs will be written (for free disk; a folder not made yet: its nearest parent)."
        ),
    ] = Path("."),
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """What a run will use here: torch, CPU, CUDA/NCCL, GPUs, bf16/fp16 support and what precision auto picks,
    int8 decoding and the library of fp32 decoding's output projection, threads, allocator, memory, disk."""
    from mtkit.runtime import environment_report

    report = environment_report(path)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in report["gpus"]) or "none"
    backends = ", ".join(name for name, ok in report["distributed_backends"].items() if ok) or "none"
    rows = [
        ("torch", f"{report['torch']} (CUDA {report['cuda_version'] or 'not built'})"),
        (
            "CPU",
            f"{report['cpu']} ({report['cpu_capability']}), native bf16: "
            f"{'yes' if report['cpu_bf16_instructions'] else 'no'}",
        ),
        ("threads", str(report["threads"])),
        ("memory allocator", report["allocator"]),
        ("GPUs", gpus),
        ("distributed backends", backends),
        ("precisions", "; ".join(f"{dev}: {', '.join(p) or '-'}" for dev, p in report["precisions"].items())),
        (
            "precision auto",
            "; ".join(
                f"{dev}: {c['precision']} ({c['reason'].removeprefix('auto: ')})"
                for dev, c in report["auto_precision"].items()
            ),
        ),
        ("int8 decoding", f"cpu ({report['int8_decoding']['reason'].removeprefix('asked for; ')})"),
        ("fp32 output projection", GEMM_NAMES[report["fp32_vocabulary_gemm"]]),
        ("bf16 decoding products", GEMM_NAMES[report["bf16_decoding_gemm"]]),
        ("memory available", f"{report['memory_available_gib']} GiB"),
        ("disk free", f"{report['disk_free_gib']} GiB at {report['disk_path']}{_not_there(path)}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        typer.echo(f"{name:<{width}}  {value}")


def _not_there(path: Path) -> str:
    """Why the free disk is not measured at ``path`` itself, if it is not."""
    return "" if path.exists() else f" ({path} does not exist: its nearest existing parent)"
