"""`-o` never lands on the model a command reads: onto its weights, into best/ or onto its tokenizer it is one
error line before any work, for every command that writes an output, and the run directory stays as it was."""

from __future__ import annotations

import shutil
from itertools import product
from pathlib import Path

import pytest
from helpers import invoke, one_line_error, tiny_model, tiny_model_config

from mtkit.config import RunConfig
from mtkit.training import run_directory


@pytest.fixture
def run(tmp_path, spm_model) -> Path:
    """A run directory as training leaves it, with tiny weights: two checkpoints, best/ and the tokenizer."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(spm_model.path, run / spm_model.path.name)
    record = {"file": spm_model.path.name, "sha256": spm_model.sha256}
    meta = {"config": RunConfig(model=tiny_model_config()).to_dict(), "tokenizer": {"src": record, "tgt": record}}
    for step in (1, 2):
        weights = tiny_model(spm_model.vocab_size, seed=step).state_dict()
        run_directory.save_in_run(run, step, weights, meta, {"step": step}, keep_last=0)
    run_directory.save_best(run, weights, {**meta, "step": 2})
    return run


def contents(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def command(name: str, run: Path, corpus_files: dict[str, Path]) -> list:
    """``name``'s arguments, all but ``-o``, as a user would give them to work on ``run``."""
    return {
        "translate": ["translate", run, "-i", corpus_files["val.en"], "--beam", 1],
        "shortlist": ["shortlist", run, "--src", corpus_files["train.en"], "--tgt", corpus_files["train.de"]],
        "average": ["average", run, "--last", 2],
        "attention": ["attention", run, "--src", "A dog runs."],
    }[name]


WEIGHTS, IN_BEST, TOKENIZER = "best/model.safetensors", "best/new.safetensors", "spm.model"


@pytest.mark.parametrize(
    "name, target",
    [
        *product(("translate", "shortlist", "attention"), (WEIGHTS, IN_BEST, TOKENIZER)),
        ("average", WEIGHTS),  # (average writes only .safetensors files, which no tokenizer is)
        ("average", IN_BEST),
    ],
)
def test_an_output_onto_the_models_files_is_refused_before_any_work(name, target, run, corpus_files):
    before = contents(run)
    one_line_error(invoke(*command(name, run, corpus_files), "-o", run / target), f"{run / target}: ")
    assert contents(run) == before


def test_an_output_linked_to_the_weights_is_refused(run, corpus_files, tmp_path):
    """The file a link points to is what `-o` writes (as shell redirection does), so the link counts as the weights."""
    link = tmp_path / "out.de"
    link.symlink_to(run / WEIGHTS)
    before = contents(run)
    one_line_error(invoke(*command("translate", run, corpus_files), "-o", link), "is inside the checkpoint")
    assert contents(run) == before


@pytest.mark.parametrize("fmt", ["ctranslate2", "hf"])
def test_an_export_into_best_is_refused_before_any_work(fmt, run):
    before = contents(run)
    for target in (WEIGHTS, "best/export"):
        one_line_error(invoke("export", run, "--format", fmt, "-o", run / target), f"{run / target}: ")
    assert contents(run) == before
