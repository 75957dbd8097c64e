"""Peak memory and wall clock of ``mtkit prepare`` on a WMT14-sized corpus: pyarrow reader against ``datasets``.

The same 4.5M-pair parquet files (bench_wmt_scale.py's synthetic WMT14 En-De mirror, built once and kept
in the work folder) are prepared twice, each in a child process whose peak resident memory is the
kernel's high-water mark (``os.wait4``'s ru_maxrss):

- ``pyarrow``: ``mtkit prepare wmt14_en_de --mirror MIRROR``, the catalogue's parquet reader;
- ``datasets``: ``mtkit prepare hf:FOLDER --config de-en``, where FOLDER holds the same files laid out
  as a Hub dataset repository (hard links, and a dataset card declaring the config and its splits),
  with an empty ``HF_HOME``: the conversion to Arrow is measured too;
- ``datasets_cached``: the same again into a new output folder, the Arrow cache kept.

One ``key=value`` line per path. Run from the repository root::

    python benchmarks/bench_prepare_datasets.py
    python benchmarks/bench_prepare_datasets.py --pairs 50000 --work /tmp/mtkit-prepare-small   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from bench_wmt_scale import CORPUS, REPO, BenchFailed, Stage, check_prepared, mirror_stage, mtkit, run_stage

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
The synthetic WMT14-sized corpus of benchmarks/bench_wmt_scale.py, laid out as a Hub dataset repository.
"""


def hub_folder(mirror: Path, folder: Path) -> Path:
    """The mirror's files under the Hub repository's own paths (de-en/train-00000-of-00003.parquet...)."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "de-en").mkdir(parents=True)
    for split in CORPUS.splits.values():
        for file in split.files:
            os.link(mirror / file.filename, folder / "de-en" / file.url.rsplit("/", 1)[-1])
    (folder / "README.md").write_text(CARD, encoding="utf-8")
    return folder


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
    args = p.parse_args()
    work = args.work.resolve()
    args.skip_build = False
    try:
        _, mirror = mirror_stage(args, work / "mirror", work / "mirror.json")
        folder = hub_folder(work / "mirror", work / "hub")
        pyarrow = measured("pyarrow", mtkit("prepare", CORPUS.name, "--mirror", work / "mirror"), work, mirror["pairs"])
        print_row(pyarrow, mirror["pairs"])
        hf_home = work / "hf-home"
        shutil.rmtree(hf_home, ignore_errors=True)
        os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        cmd = mtkit("prepare", f"hf:{folder}", "--config", "de-en", "--langpair", "en-de")
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
