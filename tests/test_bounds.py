"""Sizes from a flag, a checkpoint header or an export's mtkit.json are bounded: beyond mtkit.config's bounds
each is one error line, never a search that allocates until the kernel kills it.

mtkit runs as a child whose address space is capped (``ADDRESS_SPACE``): with a bound missing, the test fails
on an allocation error (or a crash) instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import joint_post_norm_run, with_header

from mtkit.interop.ct2_export import export_ctranslate2
from mtkit.model import checkpoint, loading

ADDRESS_SPACE = 8 << 30  # bytes: mtkit translating one line with CTranslate2 maps well under half of it
HUGE = 10**9


def translate(*args) -> subprocess.CompletedProcess:
    """``python -m mtkit translate ARGS`` on one line, on the CPU, in a child that cannot map more than
    ``ADDRESS_SPACE`` (where CUDA could not start: it reserves more address space than that)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    command = [sys.executable, "-m", "mtkit", "translate", *map(str, args), "--device", "cpu"]
    return subprocess.run(command, input="A dog.\n", capture_output=True, text=True, timeout=120, preexec_fn=cap)


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory, spm_model) -> Path:
    return joint_post_norm_run(tmp_path_factory.mktemp("bounds"), spm_model)


@pytest.fixture(scope="module")
def export(run) -> Path:
    pytest.importorskip("ctranslate2")
    return export_ctranslate2(run, run.parent / "ct2")


@pytest.mark.parametrize(
    "args, named",
    [
        (["--beam", HUGE], "decode.beam must be at most 1,000"),
        (["--sample", "--nbest", HUGE], "nbest must be between 1 and 1,000"),  # each sample is a row of its own
    ],
    ids=["beam", "samples"],
)
def test_a_flag_beyond_its_bound_is_one_error_line(run, args, named):
    """--beam 1000000000 was a traceback, or the kernel's OOM killer."""
    one_error_line(translate(run, *args), named)


def test_a_checkpoint_header_asking_for_a_huge_beam_is_one_error_line(run, tmp_path):
    model = tmp_path / "model.safetensors"
    weights = loading.resolve(run) / checkpoint.WEIGHTS_FILE
    with_header(weights, model, lambda meta: meta["config"]["decode"].update(beam=HUGE))
    shutil.copyfile(run / "spm.model", tmp_path / "spm.model")
    one_error_line(translate(model), str(model), "decode.beam must be at most 1,000")


@pytest.mark.parametrize("setting", [{"beam": HUGE}, {"lenpen": 1e300}], ids=["beam", "lenpen"])
def test_an_export_manifest_asking_for_a_huge_search_is_one_error_line(export, tmp_path, setting):
    """decode.beam 1000000000 in mtkit.json got `translate --engine ctranslate2` OOM-killed at 24 GB; lenpen 1e300
    overflowed ((5 + length) / 6) ** lenpen in a traceback."""
    copy = shutil.copytree(export, tmp_path / "ct2")
    manifest = json.loads((copy / "mtkit.json").read_text())
    manifest["decode"].update(setting)
    (copy / "mtkit.json").write_text(json.dumps(manifest))
    (name,) = setting
    result = translate(copy, "--engine", "ctranslate2")
    one_error_line(result, f"{copy / 'mtkit.json'}: malformed export manifest: decode.{name} must be at most")
