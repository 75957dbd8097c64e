"""Peak memory and wall clock of ``mtkit prepare`` on a WMT14-sized corpus: a plain pyarrow reader against ``datasets``.

The same 4.5M-pair parquet files (bench_wmt_scale.py's synthetic mirror of the Hub repository wmt/wmt14,
built once and kept in the work folder) are prepared three times, each in a child process whose peak
resident memory is the kernel's high-water mark (``os.wait4``'s ru_maxrss):

- ``pyarrow``: the baseline, this script's own reader: the parquet files read by pyarrow 8,192 rows at a
  time with pre-buffering off (the catalogue's reader before its Hub corpora went through ``datasets``),
  the training split cleaned as ``mtkit prepare`` cleans it, and each split's two text files written;
- ``datasets``: ``mtkit prepare hf:FOLDER --config de-en``, FOLDER the mirror's wmt/wmt14 (the path
  ``mtkit prepare wmt14_en_de --mirror`` takes), with an empty ``HF_HOME``: the conversion to Arrow is
  measured too;
- ``datasets_cached``: the same again into a new output folder, the Arrow cache kept.

One ``key=value`` line per path. Run from the repository root::

    python benchmarks/bench_prepare_datasets.py
    python benchmarks/bench_prepare_datasets.py --pairs 50000 --work /tmp/mtkit-prepare-small   # a quick check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from bench_wmt_scale import (
    CORPUS,
    REPO,
    BenchFailed,
    Stage,
    check_prepared,
    mirror_stage,
    mtkit,
    offline_hf_home,
    run_stage,
    shard_paths,
)

SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # ours: the dataset's
BATCH_ROWS = 8192
# Line and paragraph separators, written as spaces as mtkit prepare writes them.
LINE_BREAKS = str.maketrans(dict.fromkeys("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


def parquet_pairs(paths: list[Path]) -> Iterator[tuple[str, str]]:
    """(en, de) from the translation column, file after file, a batch at a time, pre-buffering off: whole
    row groups pre-buffered held 200 MiB more for 4.5M pairs."""
    import pyarrow.parquet as pq

    for path in paths:
        with pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20) as parquet:
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=["translation"]):
                column = batch.column(0)
                yield from zip(column.field("en").to_pylist(), column.field("de").to_pylist())


def pyarrow_prepare(repo: Path, out: Path) -> None:
    """The baseline, in a child: each split read by ``parquet_pairs``, train cleaned with mtkit's default
    settings, both sides written; prepare.json with the counts that ``check_prepared`` reads."""
    from mtkit.config import CleanConfig
    from mtkit.data.clean import CleanSummary, clean_pairs

    out.mkdir(parents=True)
    shards = shard_paths(repo)
    written = {}
    for ours, theirs in SPLITS.items():
        pairs = parquet_pairs(shards[theirs])
        summary = CleanSummary() if ours == "train" else None
        if summary is not None:
            pairs = clean_pairs(pairs, CleanConfig(), summary)
        lines = 0
        with (
            open(out / f"{ours}.en", "w", encoding="utf-8") as en,
            open(out / f"{ours}.de", "w", encoding="utf-8") as de,
        ):
            for s, t in pairs:
                en.write(s.translate(LINE_BREAKS) + "\n")
                de.write(t.translate(LINE_BREAKS) + "\n")
                lines += 1
        written[ours] = {"lines": lines, **({"clean": summary.to_dict()} if summary else {})}
    (out / "prepare.json").write_text(json.dumps({"splits": written}, indent=1))


def measured(name: str, cmd: list[str], work: Path, pairs: int) -> Stage:
    """Run one prepare into a fresh folder; its line counts are checked against prepare.json."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    stage = run_stage(name, [*cmd, "--out", str(out)], work / f"{name}.log")
    if stage.exit_code:
        raise BenchFailed(f"{name} failed with exit status {stage.exit_code} (log: {work / f'{name}.log'})")
    record = check_prepared(out, pairs)
    stage.notes = f"kept={record['splits']['train']['clean']['kept']}"
    return stage


def print_row(stage: Stage, pairs: int) -> None:
    print(
        f"path={stage.name} pairs={pairs} wall_s={stage.seconds:.1f} peak_rss_mib={stage.peak_rss_mib:.0f} "
        f"anon_mib={stage.anon_mib:.0f} file_mib={stage.file_mib:.0f} {stage.notes}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4_500_000, help="training pairs in the synthetic corpus")
    p.add_argument("--work", type=Path, default=Path("/tmp/mtkit-prepare-bench"), help="work folder (kept)")
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "multi30k")
    p.add_argument("--seed", type=int, default=1, help="seed of the synthetic corpus")
    p.add_argument("--num-proc", type=int, help="prepare --num-proc for the datasets path")
    p.add_argument("--pyarrow-child", type=Path, help=argparse.SUPPRESS)  # the baseline's child: the repository
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # ...and its output folder
    args = p.parse_args()
    if args.pyarrow_child:
        pyarrow_prepare(args.pyarrow_child, args.out)
        return
    work = args.work.resolve()
    args.skip_build = False
    try:
        _, mirror = mirror_stage(args, work / "mirror", work / "mirror.json")
        repo = work / "mirror" / CORPUS.dataset.path
        baseline = [sys.executable, str(Path(__file__).resolve()), "--pyarrow-child", str(repo)]
        pyarrow = measured("pyarrow", baseline, work, mirror["pairs"])
        print_row(pyarrow, mirror["pairs"])
        offline_hf_home(work / "hf-home")
        cmd = mtkit("prepare", f"hf:{repo}", "--config", "de-en", "--langpair", "en-de")
        cmd += ["--num-proc", str(args.num_proc)] if args.num_proc else []
        rows = [measured(name, cmd, work, mirror["pairs"]) for name in ("datasets", "datasets_cached")]
    except BenchFailed as err:
        sys.exit(f"error: {err}")
    for stage in rows:
        print_row(stage, mirror["pairs"])
    ratio = rows[0].seconds / pyarrow.seconds
    print(json.dumps({"datasets_over_pyarrow_wall": round(ratio, 2)}))


if __name__ == "__main__":
    main()
