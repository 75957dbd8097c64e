"""Files from elsewhere are data, never code: checkpoints, configs, config paths and text to translate.

Each hostile input tries to create a marker file; the tests check that it is refused (or read as
plain data) and that the marker never appears.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_cli import invoke, one_line_error, trained_run, write_config  # noqa: F401  (trained_run is a fixture)

from mtkit import checkpoint


class RunsCode:
    """Unpickling this calls ``os.system``: what a booby-trapped checkpoint would do."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "a hostile input ran code"


REFUSED = "refused: it holds pickled Python objects other than tensors"


def test_a_checkpoint_that_runs_code_when_unpickled_is_refused(tmp_path, multi30k_slice, trained_run, marker):  # noqa: F811
    trap = tmp_path / "model.pt"
    torch.save({"format": 1, "model": RunsCode(marker)}, trap)
    one_line_error(invoke("translate", trap, input="A dog.\n"), REFUSED)
    one_line_error(invoke("average", trap, trap, "-o", tmp_path / "avg.safetensors"), REFUSED)

    run = tmp_path / "run"  # a run directory whose newest training state was swapped for the trap
    shutil.copytree(trained_run, run)
    shutil.copyfile(trap, checkpoint.latest(run) / checkpoint.STATE_FILE)
    config = write_config(tmp_path / "c.yaml", multi30k_slice, train={"max_steps": 40})
    one_line_error(invoke("train", config, "--out", run), f"state.pt: {REFUSED}")

    legacy = tmp_path / "legacy"  # a format 1 run directory, whose last.pt resumes training
    legacy.mkdir()
    shutil.copyfile(trap, legacy / checkpoint.LEGACY_LAST)
    one_line_error(invoke("train", config, "--out", legacy), f"last.pt: {REFUSED}")


@pytest.mark.parametrize(
    "tag",
    ["!!python/object/apply:os.system [{command!r}]", "!!python/object/new:subprocess.Popen [[touch, {marker}]]"],
    ids=["apply", "new"],
)
def test_configs_are_read_with_the_safe_yaml_loader(tmp_path, marker, tag):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  max_steps: " + tag.format(command=f"touch {marker}", marker=marker) + "\n")
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), "c.yaml: line 2 not valid YAML")


@pytest.mark.parametrize("hostile", ["$(touch {marker})", "`touch {marker}`", "x; touch {marker}", "~/corpus.en"])
def test_paths_in_configs_are_taken_literally(tmp_path, multi30k_slice, marker, hostile):
    path = hostile.format(marker=marker)
    for key in ("train_src", "valid_src"):
        config = write_config(tmp_path / "c.yaml", multi30k_slice, data={key: path})
        one_line_error(invoke("train", config, "--out", tmp_path / "run"), f"error: {path}: file not found")
    config = write_config(tmp_path / "c.yaml", multi30k_slice, tokenizer={"model": path})
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), f"error: {path}: tokenizer model not found")


HOSTILE_LINES = [
    "../../../../tmp/escaped",
    "/etc/passwd",
    "$(touch {marker}) `touch {marker}`",
    "%s%s%n {0} {} \\x00 \\n",
    "\x1b]0;window title\x07\x1b[2J terminal escapes",
    "form\x0cfeed, vertical\x0btab, next\x85line, line\u2028and paragraph\u2029separators",
    "a carriage\rreturn inside the line",
    "",
]


def test_translating_hostile_text_writes_the_output_file_and_nothing_else(tmp_path, trained_run, marker):  # noqa: F811
    work = tmp_path / "work"
    work.mkdir()
    lines = [line.replace("{marker}", str(marker)) for line in HOSTILE_LINES]
    source = work / "in.txt"
    source.write_bytes("".join(line + "\n" for line in lines).encode())
    before = sorted(tmp_path.rglob("*"))
    result = invoke("translate", trained_run, "-i", source, "-o", work / "out.txt", "--beam", 2, "--alignments")
    assert result.exit_code == 0, result.output
    assert sorted(tmp_path.rglob("*")) == sorted([*before, work / "out.txt"])
    assert (work / "out.txt").read_bytes().count(b"\n") == len(lines)
    assert not (tmp_path / "escaped").exists()

    # Translating a file onto itself would replace the text it translates: refused, the source kept.
    text = source.read_bytes()
    one_line_error(invoke("translate", trained_run, "-i", source, "-o", source), "in.txt: is also an input")
    assert source.read_bytes() == text
