"""This CPU's row of docs/benchmarks.md: training and decoding speed on Multi30k, each figure the range of its runs.

1. The CPU: lscpu's model name, family and model, and the flags mtkit's kernels depend on (avx2,
   avx512f, avx512_vnni, avx512_bf16, amx_bf16); cores, torch, and the precision ``auto`` picks here.
2. A model to decode with: ``--run RUN`` (default runs/earlier), trained there first where it holds
   none, by ``mtkit run`` with the recipe's earlier settings (``EARLIER`` in docs/benchmarks.md: the
   model of the decoding tables there); its vocabulary shortlist (``mtkit shortlist`` over the
   training pairs), made if missing.
3. ``--rounds`` rounds (at least 3, as runs on these machines differ by 15-20%), each running
   A, B and C in turn, so that the runs of one figure are spread over the whole sitting:

   A. benchmarks/train_throughput.py: mtkit fp32 and ``auto`` (the precision it resolves to here;
      one run when that is fp32), then fairseq fp32 in the environment of benchmarks/peer_env.sh
      (built first where it is missing; ``--no-fairseq`` leaves fairseq out);
   B. benchmarks/decode_speed.py, mtkit's engine: fp32, bf16 and int8 at beam 5, without and with
      the shortlist;
   C. benchmarks/decode_speed.py, CTranslate2 int8 used natively (its own ``translate_batch``),
      without and with the shortlist as its vocabulary map (skipped without the ctranslate2 package).

Printed: every run's figures, one ``cpu_row`` line per figure and run; each figure as the range
min-max of its runs, with the ratios taken within each round; then the markdown header and row to
paste into docs/benchmarks.md. Progress goes to stderr.

Run from the repository root::

    python benchmarks/cpu_row.py                      # trains runs/earlier first if it holds no model
    python benchmarks/cpu_row.py --run runs/earlier --rounds 3 --json cpu_row.json
    python benchmarks/cpu_row.py --run RUN --rounds 1 --steps 1 --warmup 0 --lines 10 --no-fairseq  # a check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mtkit.runtime import resolve_precision

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "multi30k_en_de.yaml"
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
# The recipe's earlier settings (docs/benchmarks.md), which made runs/earlier, the model of its decoding tables.
EARLIER = (
    "model.positions=sinusoidal",
    "model.dropout=0.1",
    "train.max_steps=2400",
    "train.save_every=400",
    "recipe.average_last=3",
)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
DECODE_PRECISIONS = ("fp32", "bf16", "int8")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_or_exit(command: list[str], what: str) -> None:
    """Run a step the measurements need; stop here, saying which, if it fails (its own output says why)."""
    if subprocess.run(command, cwd=REPO).returncode:
        sys.exit(f"cpu_row: {what} failed")


# -- the machine -------------------------------------------------------------------------------


def cpu_description() -> dict:
    """lscpu's model name, family, model and vendor, the flags that matter to mtkit, and the cores."""
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("Flags", "").split())
    auto = resolve_precision("auto", torch.device("cpu"))
    return {
        "model_name": fields.get("Model name", "unknown"),
        "vendor": fields.get("Vendor ID", ""),
        "family": fields.get("CPU family", ""),
        "model": fields.get("Model", ""),
        "flags": {flag: flag in flags for flag in FLAGS},
        "cpus": int(fields.get("CPU(s)", "0") or 0),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "auto": auto.precision,
        "auto_reason": auto.reason,
    }


# -- what the measurements need ----------------------------------------------------------------


def trained_model(args: argparse.Namespace) -> Path:
    """``--run``, trained first by ``mtkit run`` with the recipe's earlier settings where it holds no model yet
    (neither a report of a finished run nor a best/ checkpoint; mtkit run resumes what an interrupted one began)."""
    run = args.run
    if (run / "report.json").is_file() or (run / "best").is_dir():
        return run
    log(f"training the recipe's earlier settings into {run} ...")
    settings = [*EARLIER, *args.train_set]
    command = [sys.executable, "-m", "mtkit", "run", str(RECIPE), "--out", str(run), "--mirror", str(args.data_dir)]
    run_or_exit([*command, *(a for s in settings for a in ("--set", s))], f"training {run}")
    return run


def shortlist_of(run: Path, data_dir: Path) -> Path:
    """RUN/shortlist.safetensors, made from the training pairs where it is missing."""
    path = run / "shortlist.safetensors"
    if not path.is_file():
        log(f"building {path} ...")
        pairs = ["--src", str(data_dir / "train.en.gz"), "--tgt", str(data_dir / "train.de.gz")]
        command = [sys.executable, "-m", "mtkit", "shortlist", str(run), *pairs, "-o", str(path)]
        run_or_exit(command, f"building {path}")
    return path


def fairseq_python(args: argparse.Namespace) -> Path | None:
    """The python of the fairseq environment, built by peer_env.sh where it is missing; None with --no-fairseq."""
    if args.no_fairseq:
        return None
    python = args.fairseq or REPO / ".peer-fairseq" / "bin" / "python"
    if not python.exists():
        env = python.parent.parent
        log(f"building the fairseq environment {env} (benchmarks/peer_env.sh, about 5 minutes) ...")
        run_or_exit(["bash", str(REPO / "benchmarks" / "peer_env.sh"), str(env)], f"building {env}")
    return python


# -- one run of each measurement ---------------------------------------------------------------


def run_json(command: list[str], json_path: Path) -> dict | None:
    """Run a benchmark that writes ``--json json_path``; its figures, or None if it failed."""
    done = subprocess.run([*command, "--json", str(json_path)], cwd=REPO, stdout=subprocess.DEVNULL)
    if done.returncode or not json_path.is_file():
        log(f"failed (exit {done.returncode}): {' '.join(command)}")
        return None
    return json.loads(json_path.read_text())


def training_run(args: argparse.Namespace, cpu: dict, run: Path, fairseq: Path | None, work: Path) -> dict:
    """A: target tokens/s of mtkit fp32 and auto, and of fairseq fp32; mtkit fp32's share of the fp32 matmul peak."""
    precisions = ["fp32"] if cpu["auto"] == "fp32" else ["fp32", cpu["auto"]]
    command = [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--run", str(run)]
    command += ["--src", str(args.data_dir / "train.en.gz"), "--tgt", str(args.data_dir / "train.de.gz")]
    command += ["--precisions", ",".join(precisions), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--threads", str(args.threads)] + (["--fairseq", str(fairseq)] if fairseq else [])
    figures = run_json(command, work / "train.json")
    if figures is None:
        return {}
    train = figures["train"]
    found = {"train_fp32": train["fp32"]["tokens_per_s"], "train_auto": train[cpu["auto"]]["tokens_per_s"]}
    found["train_fp32_mfu_percent"] = 100 * train["fp32"]["mfu"]["fp32"]  # against the fp32 matmul peak
    if "peer" in figures:
        found["train_fairseq_fp32"] = figures["peer"]["tokens_per_s"]
        found["train_auto_over_fairseq"] = found["train_auto"] / found["train_fairseq_fp32"]
    return found


def decoding_run(args: argparse.Namespace, run: Path, shortlist: Path, engine: str, work: Path) -> dict:
    """B (engine mtkit) or C (ct2native, int8): sentences/s at beam 5, without and with the shortlist."""
    precisions = DECODE_PRECISIONS if engine == "mtkit" else ("int8",)
    command = [sys.executable, str(REPO / "benchmarks" / "decode_speed.py"), "--run", str(run)]
    command += ["--data-dir", str(args.data_dir), "--engines", engine, "--precisions", ",".join(precisions)]
    command += ["--beams", str(args.beam), "--early-stop", "on", "--shortlist", str(shortlist)]
    command += ["--repeat", str(args.repeat), "--threads", str(args.threads)]
    command += ["--lines", str(args.lines)] if args.lines else []
    records = run_json(command, work / f"decode_{engine}.json")
    found = {}
    for record in (records or {}).values():
        if record is not None:
            name = "ct2_int8" if engine == "ct2native" else record["precision"]
            found[f"decode_{name}" + ("_shortlist" if record["shortlist"] else "")] = record["sentences_per_s"]
    return found


def with_ratios(found: dict) -> dict:
    """A round's figures with its ratios: mtkit int8 over CTranslate2 int8, measured in the same round."""
    if "decode_int8" in found and "decode_ct2_int8" in found:
        found["decode_int8_over_ct2_int8"] = found["decode_int8"] / found["decode_ct2_int8"]
    return found


# -- the report --------------------------------------------------------------------------------


def spread(values: list[float], digits: int) -> str:
    """min-max of a figure's runs (one value alone when they agree to the digits shown, or there is one)."""
    if not values:
        return "-"
    low, high = f"{min(values):,.{digits}f}", f"{max(values):,.{digits}f}"
    return low if low == high else f"{low}-{high}"


def ranges(rounds: list[dict]) -> dict[str, str]:
    """Each figure as the range of its runs; ratios with two decimals and an x, speeds with none or one."""
    names = [name for found in rounds for name in found]
    figures = {}
    for name in dict.fromkeys(names):
        values = [found[name] for found in rounds if name in found]
        figures[name] = spread(values, 2) + "x" if "_over_" in name else spread(values, 1 if "decode" in name else 0)
    return figures


def markdown(cpu: dict, figures: dict[str, str]) -> list[str]:
    """The header, separator and row of this CPU for docs/benchmarks.md."""
    flags = ", ".join(flag for flag, present in cpu["flags"].items() if present) or "none of them"
    auto = cpu["auto"]

    def f(name: str) -> str:
        return figures.get(name, "-")

    mtkit_decoding = " / ".join(f(f"decode_{p}") for p in DECODE_PRECISIONS)
    shortlisted = " / ".join(f(f"decode_{p}_shortlist") for p in DECODE_PRECISIONS)
    header = [
        "CPU (`lscpu`)",
        "flags",
        "CPUs, torch",
        "`auto`",
        "training, target tokens/s: fp32 / auto / fairseq fp32",
        "fp32 training, % of the fp32 matmul peak",
        "auto / fairseq",
        "beam 5, sentences/s: fp32 / bf16 / int8",
        "with the shortlist: fp32 / bf16 / int8",
        "CTranslate2 int8 / with the vocabulary map",
        "int8 / CTranslate2 int8",
    ]
    row = [
        f"{cpu['model_name']} (family {cpu['family']}, model {cpu['model']})",
        flags,
        f"{cpu['cpus']}, torch {cpu['torch']}",
        auto,
        f"{f('train_fp32')} / {f('train_auto')} / {f('train_fairseq_fp32')}",
        f("train_fp32_mfu_percent"),
        f("train_auto_over_fairseq"),
        mtkit_decoding,
        shortlisted,
        f"{f('decode_ct2_int8')} / {f('decode_ct2_int8_shortlist')}",
        f("decode_int8_over_ct2_int8"),
    ]
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), "| " + " | ".join(row) + " |"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run",
        type=Path,
        default=REPO / "runs" / "earlier",
        help="the run to decode with, trained first where it holds no model (default: runs/earlier)",
    )
    p.add_argument("--data-dir", type=Path, default=MULTI30K, help="the Multi30k *.gz files")
    p.add_argument("--rounds", type=int, default=3, help="runs of each figure, interleaved A B C A B C ...")
    p.add_argument("--steps", type=int, default=40, help="timed training updates per run (train_throughput.py)")
    p.add_argument("--warmup", type=int, default=2, help="untimed training updates first")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1, help="passes over the test set per decoding run; the fastest")
    p.add_argument("--lines", type=int, help="decode only the first N test lines (a quick check)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 for the default")
    p.add_argument("--fairseq", type=Path, help="python of a fairseq environment (default: .peer-fairseq/bin/python)")
    p.add_argument("--no-fairseq", action="store_true", help="leave fairseq out")
    p.add_argument("--train-set", action="append", default=[], help="an extra override for training --run (repeatable)")
    p.add_argument("--json", type=Path, help="also write the CPU, every run's figures and the ranges here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    args.data_dir = args.data_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cpu = cpu_description()
    flags = " ".join(f"{flag}={'yes' if present else 'no'}" for flag, present in cpu["flags"].items())
    print(f"cpu: {cpu['model_name']} | vendor {cpu['vendor']}, family {cpu['family']}, model {cpu['model']}")
    print(f"cpu flags: {flags}")
    reason = cpu["auto_reason"].removeprefix("auto: ")
    print(f"cpus {cpu['cpus']}, torch {cpu['torch']} ({cpu['threads']} threads)")
    print(f"precision auto: {cpu['auto']} ({reason})")
    run = trained_model(args)
    shortlist = shortlist_of(run, args.data_dir)
    fairseq = fairseq_python(args)
    ct2 = importlib.util.find_spec("ctranslate2") is not None
    if not ct2:
        log("CTranslate2: skipped (pip install ctranslate2)")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="cpu_row.") as tmp:
        for number in range(1, args.rounds + 1):
            work = Path(tmp) / str(number)
            work.mkdir()
            log(f"round {number} of {args.rounds}: A training")
            found = training_run(args, cpu, run, fairseq, work)
            log(f"round {number} of {args.rounds}: B decoding, mtkit")
            found |= decoding_run(args, run, shortlist, "mtkit", work)
            if ct2:
                log(f"round {number} of {args.rounds}: C decoding, CTranslate2 int8")
                found |= decoding_run(args, run, shortlist, "ct2native", work)
            rounds.append(with_ratios(found))
            for name, value in found.items():
                print(f"cpu_row round={number} figure={name} value={value:.4g}", flush=True)
    figures = ranges(rounds)
    print()
    for name, text in figures.items():
        print(f"{name}: {text}")
    print()
    print("\n".join(markdown(cpu, figures)))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "rounds": rounds, "ranges": figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
