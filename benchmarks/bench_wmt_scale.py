"""Memory and speed of mtkit on a WMT14-sized corpus: prepare, encode once, train from the stored tokens.

WMT14 En-De has 4.5M training pairs. Preparing, tokenizing and training on a corpus that size must
keep memory bounded: the training data is encoded once into a compact store on disk
(``data.cache_dir``), which batching reads lazily and later runs reuse. This script measures that on a
stand-in corpus of the same size, built from Multi30k, in stages that each run ``python -m mtkit`` in
a child process whose resident memory (RssAnon, RssFile in /proc/PID/status) is sampled every 0.2 s;
a stage's peak is the kernel's high-water mark of that child's resident memory (``os.wait4``'s ru_maxrss).

1. build: a mirror of WMT14 En-De's Hub repository (what ``mtkit prepare --mirror`` reads), as a
   ``git clone`` of wmt/wmt14 lays it out: MIRROR/wmt/wmt14/README.md (a dataset card declaring the de-en
   config) and de-en/*.parquet (train in three shards, as on the Hub, validation and test in one each),
   with ``--pairs`` training pairs. Each pair joins 2-4 random Multi30k
   task-1 pairs, the same picks on both sides, so that nearly all pairs are distinct and about 25 words a
   side, as in WMT. Multi30k val and test_2016_flickr stand in for newstest2013 and 2014. Written a row
   group at a time; kept in the work folder and reused while ``mirror.json`` there records the same size
   and seed.
2. prepare: ``mtkit prepare wmt14_en_de --mirror`` into a fresh folder, offline, through ``datasets`` with
   an empty ``HF_HOME`` in the work folder (so the conversion to its Arrow cache is measured too); its
   line counts are checked.
3. tokenizer: an 8k joint unigram SentencePiece model trained on Multi30k train (given to training as
   ``tokenizer.model``, so that training measures encoding, not tokenizer training).
4. train, cold: ``--steps`` updates with an empty ``data.cache_dir``: the corpus is encoded into the
   store first. Encoding throughput and the store's size come from the store's meta.json.
5. train, warm: the same in a new run folder, the store kept: training alone, the store reused.
6. train, Multi30k: the same settings on Multi30k's 29,000 pairs, so that the warm run's peak minus
   this one's is what 155 times more training data costs in memory.

The work folder (``--work``) is kept, so a second run reuses the mirror. Run from the repository root::

    python benchmarks/bench_wmt_scale.py --json wmt_scale.json
    python benchmarks/bench_wmt_scale.py --pairs 50000 --work /tmp/mtkit-wmt-small   # a quick check
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mtkit.data.corpora import CORPORA

REPO = Path(__file__).resolve().parents[1]
CORPUS = CORPORA["wmt14_en_de"]
RECIPE = REPO / "recipes" / "multi30k_en_de.yaml"
SAMPLE_S = 0.2
ROW_GROUP = 50_000  # rows per parquet row group
# Multi30k pairs joined into one synthetic pair, and how often: 2.2 on average, about 25 words a side
# (Multi30k has 11.9 English and 11.1 German words per sentence). Never one alone: Multi30k has only
# 29,000 of those, and repeats would be dropped by prepare's deduplication.
JOIN_SIZES, JOIN_WEIGHTS = (2, 3, 4), (0.85, 0.12, 0.03)
SCHEMA = pa.schema([("translation", pa.struct([("de", pa.string()), ("en", pa.string())]))])
# The de-en config's parquet shards in wmt/wmt14, per split of the dataset.
SHARDS = {"train": 3, "validation": 1, "test": 1}
CARD = """---
configs:
- config_name: de-en
  data_files:
  - split: train
    path: de-en/train-*
  - split: validation
    path: de-en/validation-*
  - split: test
    path: de-en/test-*
---
The synthetic WMT14-sized corpus of benchmarks/bench_wmt_scale.py, laid out as the Hub repository wmt/wmt14.
"""
MIB = 1024 * 1024
PRECISION_HELP = (
    "train.precision (default fp32: on a CPU, bf16's oneDNN kernel cache grows with every new batch shape, "
    "to about 5 GiB over a full Multi30k run, and would hide the data's share of memory)"
)


@dataclass
class Stage:
    name: str
    seconds: float
    peak_rss_mib: float  # the kernel's high-water mark of resident memory
    anon_mib: float | None = None  # the largest RssAnon sampled (heap: Python objects, tensors)
    file_mib: float | None = None  # the largest RssFile sampled (mapped files: libraries, a store read by mmap)
    exit_code: int = 0
    marks: dict[str, float] = field(default_factory=dict)  # seconds until the first log line of each kind
    notes: str = ""


# -- measuring a child ----------------------------------------------------------------------


def memory_kib(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of a live process in KiB; empty once it has gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = (line.partition(":") for line in text.splitlines())
    return {name: int(value.split()[0]) for name, _, value in fields if name in ("RssAnon", "RssFile")}


def run_stage(name: str, cmd: list[str], log_path: Path, marks: dict[str, str] | None = None) -> Stage:
    """Run ``cmd``, its stdout and stderr going to ``log_path``, sampling its memory while it runs.

    ``marks`` maps a name to a regular expression: the seconds until the first matching output line.
    """
    patterns = {mark: re.compile(pattern) for mark, pattern in (marks or {}).items()}
    seen: dict[str, float] = {}
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()
    start = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def sample() -> None:
        while not done.is_set():
            for key, kib in memory_kib(child.pid).items():
                peaks[key] = max(peaks[key], kib)
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with open(log_path, "w", encoding="utf-8", buffering=1) as log:  # line-buffered: follow it with tail -f
        for line in child.stdout:
            log.write(line)
            for mark, pattern in patterns.items():
                if mark not in seen and pattern.search(line):
                    seen[mark] = time.perf_counter() - start
    _, status, usage = os.wait4(child.pid, 0)  # unlike Popen.wait, also gives this child's own peak
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen is told
    anon, file = (peaks[key] / 1024 for key in ("RssAnon", "RssFile"))
    return Stage(name, seconds, usage.ru_maxrss / 1024, anon, file, child.returncode, seen)


class BenchFailed(Exception):
    """A stage failed or left no usable result; the message says which and where to look."""


def run_recorded(stages: list[Stage], name: str, cmd: list[str], log_path: Path, marks: dict | None = None) -> Stage:
    """``run_stage``, the result added to ``stages``; BenchFailed with the child's last output line if it failed."""
    stage = run_stage(name, cmd, log_path, marks)
    stages.append(stage)
    if stage.exit_code:
        lines = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        last = lines[-1] if lines else "no output"
        raise BenchFailed(f"{name} failed with exit status {stage.exit_code}: {last} (log: {log_path})")
    return stage


def mtkit(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "mtkit", *map(str, args)]


# -- 1. the synthetic mirror --------------------------------------------------------------


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def joined_pairs(en: list[str], de: list[str], seed: int) -> Iterator[tuple[str, str]]:
    """Endless (en, de) pairs, each 2-4 random Multi30k pairs joined with spaces, the same picks on both sides."""
    rng = random.Random(seed)
    while True:
        size = rng.choices(JOIN_SIZES, JOIN_WEIGHTS)[0]
        picks = [rng.randrange(len(en)) for _ in range(size)]
        yield " ".join(en[i] for i in picks), " ".join(de[i] for i in picks)


def write_parquet(path: Path, pairs: Iterator[tuple[str, str]]) -> tuple[int, int, int]:
    """Rows {"translation": {"de", "en"}} a row group at a time; (rows, English words, German words)."""
    rows = en_words = de_words = 0
    with pq.ParquetWriter(path, SCHEMA) as writer:
        while chunk := list(islice(pairs, ROW_GROUP)):
            en, de = zip(*chunk)
            column = pa.StructArray.from_arrays([pa.array(de), pa.array(en)], names=["de", "en"])
            writer.write_table(pa.Table.from_arrays([column], schema=SCHEMA))
            rows += len(chunk)
            en_words += sum(s.count(" ") + 1 for s in en)
            de_words += sum(s.count(" ") + 1 for s in de)
    return rows, en_words, de_words


def shard_sizes(total: int, shards: int) -> list[int]:
    return [total // shards + (i < total % shards) for i in range(shards)]


def shard_paths(repo: Path) -> dict[str, list[Path]]:
    """The parquet shards of each split of the dataset, named as in wmt/wmt14."""
    return {
        split: [repo / "de-en" / f"{split}-{i:05d}-of-{count:05d}.parquet" for i in range(count)]
        for split, count in SHARDS.items()
    }


def build_mirror(m30k: Path, mirror: Path, pairs: int, seed: int) -> dict:
    """CORPUS's Hub repository under MIRROR/wmt/wmt14, where `mtkit prepare --mirror MIRROR` looks for it."""
    repo = mirror / CORPUS.dataset.path
    (repo / "de-en").mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text(CARD, encoding="utf-8")
    en, de = read_gz(m30k / "train.en.gz"), read_gz(m30k / "train.de.gz")
    stream = joined_pairs(en, de, seed)
    shards = shard_paths(repo)
    rows = en_words = de_words = 0
    for path, size in zip(shards["train"], shard_sizes(pairs, SHARDS["train"])):
        counts = write_parquet(path, islice(stream, size))
        rows, en_words, de_words = rows + counts[0], en_words + counts[1], de_words + counts[2]
    for split, prefix in (("validation", "val"), ("test", "test_2016_flickr")):
        pair_lines = zip(read_gz(m30k / f"{prefix}.en.gz"), read_gz(m30k / f"{prefix}.de.gz"))
        write_parquet(shards[split][0], pair_lines)
    size = sum(p.stat().st_size for p in repo.rglob("*.parquet"))
    return {"pairs": rows, "seed": seed, "words_per_side": [en_words / rows, de_words / rows], "mib": size / MIB}


def mirror_stage(args: argparse.Namespace, mirror: Path, record_path: Path) -> tuple[Stage | None, dict]:
    """Build the mirror unless one of this size and seed is there already; its build stage, if it ran."""
    repo = mirror / CORPUS.dataset.path
    files = [repo / "README.md", *(p for paths in shard_paths(repo).values() for p in paths)]
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = None
    ready = record is not None and all(p.is_file() for p in files)
    if ready and (args.skip_build or (record["pairs"], record["seed"]) == (args.pairs, args.seed)):
        return None, record
    if args.skip_build:
        raise BenchFailed(f"--skip-build: no complete mirror in {mirror} (or no {record_path})")
    shutil.rmtree(mirror, ignore_errors=True)
    start = time.perf_counter()
    record = build_mirror(args.data_dir, mirror, args.pairs, args.seed)
    seconds = time.perf_counter() - start
    record["seconds"] = seconds
    record_path.write_text(json.dumps(record, indent=1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # built in this process
    note = f"{record['pairs']:,} pairs, {record['mib']:,.0f} MiB parquet (in-process)"
    return Stage("build mirror", seconds, peak, notes=note), record


def offline_hf_home(folder: Path) -> None:
    """An empty ``HF_HOME`` for the children, offline: the Arrow conversion is measured, and nothing is fetched."""
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.update(HF_HOME=str(folder), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


# -- 2. prepare ---------------------------------------------------------------------------------


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(MIB), b""))


def check_prepared(data: Path, mirror_pairs: int) -> dict:
    """prepare.json against the files written: every split's two sides have the recorded line count."""
    record = json.loads((data / "prepare.json").read_text())
    for split, figures in record["splits"].items():
        counts = {lang: count_lines(data / f"{split}.{lang}") for lang in CORPUS.langs}
        if set(counts.values()) != {figures["lines"]}:
            raise BenchFailed(f"prepare: {split} has {counts} lines, prepare.json says {figures['lines']}")
    clean = record["splits"]["train"]["clean"]
    if clean["read"] != mirror_pairs:
        raise BenchFailed(f"prepare read {clean['read']:,} training pairs from a mirror of {mirror_pairs:,}")
    return record


# -- 4, 5. training ---------------------------------------------------------------------------


def train_command(args: argparse.Namespace, run: Path, spm: Path, train: tuple[Path, Path] | None = None) -> list[str]:
    """``mtkit train`` on the prepared corpus, or on the ``train`` (source, target) files given."""
    data, cache = args.work / "data", args.work / "cache"
    train_src, train_tgt = train or (data / "train.en", data / "train.de")
    settings = {
        "data.train_src": train_src,
        "data.train_tgt": train_tgt,
        "data.valid_src": data / "valid.en",
        "data.valid_tgt": data / "valid.de",
        "data.cache_dir": cache,
        "tokenizer.model": spm,
        "train.precision": args.precision,
        "train.max_steps": args.steps,
        "train.log_every": min(10, args.steps),
        "train.valid_every": 0,  # validate once, at the end...
        "train.valid_bleu": "false",  # ...on loss alone: decoding the valid set is not what is measured
        "train.best_metric": "loss",
        "train.save_every": 0,  # the final checkpoint only
    }
    overrides = [item for key, value in settings.items() for item in ("--set", f"{key}={value}")]
    return mtkit("train", RECIPE, "--out", run, *overrides)


# "training data: kept N pairs...": the store is open; "update 10/N ...": the first training log line.
TRAIN_MARKS = {"data_ready_s": r"training data: kept", "first_log_s": r"update \d+/\d+ "}


def steps_reached(run: Path) -> int:
    """The last update logged in metrics.jsonl."""
    try:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    except OSError:
        return 0
    return max((r["step"] for r in records if r.get("event") == "train"), default=0)


def find_store(cache: Path) -> Path:
    """The folder of the newest meta.json under the cache: the token store training wrote."""
    metas = sorted(cache.rglob("meta.json"), key=lambda p: p.stat().st_mtime)
    if not metas:
        raise BenchFailed(f"no meta.json under {cache}: training wrote no token store there (data.cache_dir)")
    return metas[-1].parent


def store_snapshot(store: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}


def encoding_figures(store: Path, data: Path) -> dict:
    """Throughput of the encoding recorded in the store's meta.json, and the store's size against the text's."""
    meta = json.loads((store / "meta.json").read_text())
    missing = [key for key in ("pairs", "src_tokens", "tgt_tokens", "encode_seconds") if key not in meta]
    if missing:
        raise BenchFailed(f"{store / 'meta.json'} lacks {', '.join(missing)}")
    seconds = meta["encode_seconds"]
    store_bytes = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    text_bytes = sum((data / f"train.{lang}").stat().st_size for lang in CORPUS.langs)
    return {
        "store": str(store),
        "meta": meta,
        "pairs_per_s": meta["pairs"] / seconds,
        "tokens_per_s": (meta["src_tokens"] + meta["tgt_tokens"]) / seconds,
        "tokens_per_pair": (meta["src_tokens"] + meta["tgt_tokens"]) / meta["pairs"],
        "store_mib": store_bytes / MIB,
        "text_mib": text_bytes / MIB,
        "store_to_text": store_bytes / text_bytes,
    }


def train_notes(stage: Stage, steps: int) -> str:
    times = ", ".join(f"{mark.removesuffix('_s').replace('_', ' ')} at {s:.1f} s" for mark, s in stage.marks.items())
    return f"{steps} updates; {times}"


# -- the report --------------------------------------------------------------------------------


def print_table(stages: list[Stage]) -> None:
    def mib(value: float | None) -> str:
        return f"{value:>10,.0f}" if value is not None else f"{'-':>10}"

    print(f"{'stage':<16}{'wall s':>9}{'peak MiB':>10}{'anon MiB':>10}{'file MiB':>10}  notes")
    for s in stages:
        print(f"{s.name:<16}{s.seconds:>9,.1f}{mib(s.peak_rss_mib)}{mib(s.anon_mib)}{mib(s.file_mib)}  {s.notes}")


def print_encoding(figures: dict) -> None:
    meta = figures["meta"]
    print(
        f"encoding: {meta['pairs']:,} pairs in {meta['encode_seconds']:,.1f} s = "
        f"{figures['pairs_per_s']:,.0f} pairs/s, "
        f"{figures['tokens_per_s']:,.0f} tokens/s ({figures['tokens_per_pair']:.1f} tokens/pair)"
    )
    print(
        f"store: {figures['store_mib']:,.1f} MiB on disk for {figures['text_mib']:,.1f} MiB of text "
        f"({figures['store_to_text']:.2f}x), {figures['store']}"
    )


def run_stages(args: argparse.Namespace, stages: list[Stage]) -> dict:
    """Stages 1-5 in order, each appended to ``stages`` as it ends; the figures besides the stages."""
    work, logs = args.work, args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    built, mirror = mirror_stage(args, work / "mirror", work / "mirror.json")
    stages += [built] if built else []
    print(f"mirror: {mirror['pairs']:,} pairs, {mirror['mib']:,.0f} MiB in {work / 'mirror'}", file=sys.stderr)

    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    offline_hf_home(work / "hf-home")
    cmd = mtkit("prepare", CORPUS.name, "--mirror", work / "mirror", "--out", data)
    stage = run_recorded(stages, "prepare", cmd, logs / "prepare.log")
    prepared = check_prepared(data, mirror["pairs"])
    kept = prepared["splits"]["train"]["clean"]["kept"]
    stage.notes = f"kept {kept:,} of {mirror['pairs']:,} pairs; line counts checked"

    tok = work / "tok"
    cmd = mtkit("tokenizer", "train", "--src", args.data_dir / "train.en.gz", "--tgt", args.data_dir / "train.de.gz")
    cmd += ["-o", str(tok), "--vocab-size", "8000", "--type", "unigram"]
    stage = run_recorded(stages, "tokenizer", cmd, logs / "tokenizer.log")
    stage.notes = "8k joint unigram on Multi30k train"

    cache, spm = work / "cache", tok / "spm.model"
    for folder in (cache, work / "run1", work / "run2"):
        shutil.rmtree(folder, ignore_errors=True)
    cmd = train_command(args, work / "run1", spm)
    stage = run_recorded(stages, "train cold", cmd, logs / "run1.log", TRAIN_MARKS)
    stage.notes = train_notes(stage, steps_reached(work / "run1")) + "; encodes into the store"
    store = find_store(cache)
    encoding = encoding_figures(store, data)

    before = store_snapshot(store)
    cmd = train_command(args, work / "run2", spm)
    stage = run_recorded(stages, "train warm", cmd, logs / "run2.log", TRAIN_MARKS)
    reused = store_snapshot(store) == before
    stage.notes = train_notes(stage, steps_reached(work / "run2"))
    stage.notes += "; store reused" if reused else "; STORE REWRITTEN"

    m30k = (args.data_dir / "train.en.gz", args.data_dir / "train.de.gz")
    cmd = train_command(args, work / "run_m30k", spm, m30k)
    shutil.rmtree(work / "run_m30k", ignore_errors=True)
    stage = run_recorded(stages, "train Multi30k", cmd, logs / "run_m30k.log", TRAIN_MARKS)
    stage.notes = train_notes(stage, steps_reached(work / "run_m30k")) + "; 29,000 pairs, for reference"
    return {"mirror": mirror, "prepare": prepared, "encoding": encoding, "store_reused": reused}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4_500_000, help="training pairs in the synthetic corpus")
    p.add_argument("--work", type=Path, default=Path("/tmp/mtkit-wmt-scale"), help="work folder (kept)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=REPO.parent / "shared" / "data" / "multi30k",
        help="Multi30k task 1: {train,val,test_2016_flickr}.{en,de}.gz",
    )
    p.add_argument("--steps", type=int, default=100, help="training updates per run")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help=PRECISION_HELP)
    p.add_argument("--seed", type=int, default=1, help="seed of the synthetic corpus")
    p.add_argument("--skip-build", action="store_true", help="use the mirror in --work as it is")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = p.parse_args()
    args.work = args.work.resolve()

    stages: list[Stage] = []
    try:
        figures = run_stages(args, stages)
    except BenchFailed as err:
        print_table(stages)
        sys.exit(f"error: {err}")
    print_table(stages)
    print_encoding(figures["encoding"])
    if args.json:
        settings = {"steps": args.steps, "precision": args.precision, "work": str(args.work)}
        args.json.write_text(json.dumps({**settings, "stages": [asdict(s) for s in stages], **figures}, indent=1))


if __name__ == "__main__":
    main()
