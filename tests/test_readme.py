"""README's Python API example, run as written, in a folder holding what the Quick start before it makes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import captions
from helpers import write_config

import mtkit

README = Path(__file__).resolve().parent.parent / "README.md"


def python_api_example() -> str:
    """The one Python block of README's "Python API" section."""
    section = README.read_text(encoding="utf-8").split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "README's Python API section should hold one Python block"
    return blocks[0]


def test_the_readme_python_example_runs_as_written(tmp_path):
    """The Quick start's results, small: data/m30k as `mtkit prepare` writes it (SPLIT.LANG), from generated
    captions, and runs/quick a tiny model trained on it. The example then runs unchanged in a process of its own,
    one that sees no GPU: its fine-tuning takes device auto, which is the CPU on CI."""
    data = tmp_path / "data" / "m30k"
    data.mkdir(parents=True)
    corpus = captions.parallel(440, seed=3)
    for split, lines in (("train", slice(0, 400)), ("valid", slice(400, 420)), ("test", slice(420, 440))):
        for lang in ("en", "de"):
            (data / f"{split}.{lang}").write_text("\n".join(corpus[lang][lines]) + "\n", encoding="utf-8")
    files = {f"{split}.{lang}": data / f"{name}.{lang}" for split, name in (("train", "train"), ("val", "valid"))
             for lang in ("en", "de")}  # fmt: skip
    quick = write_config(tmp_path / "quick.yaml", files, train={"max_steps": 40, "valid_every": 0}, decode={"beam": 2})
    mtkit.train(quick, tmp_path / "runs" / "quick")
    done = subprocess.run(
        [sys.executable, "-c", python_api_example()],
        cwd=tmp_path,
        # a tiny model: more threads would only wait on each other
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.splitlines()
    assert [line.split()[0] for line in printed] == ["BLEU", "chrF2", "validation"], done.stdout
    assert (tmp_path / "runs" / "quick-more" / "best").is_dir()
