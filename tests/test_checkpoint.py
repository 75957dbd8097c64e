"""Checkpoint format 2: round trips, crash safety, pruning, averaging, `mtkit average`."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import safetensors
import safetensors.torch
import torch
from helpers import invoke, meta_for, run_dir_with, tiny_model

from mtkit import files
from mtkit.model import checkpoint, loading, run_folder
from mtkit.model.checkpoint import CheckpointError
from mtkit.training import averaging, run_directory
from mtkit.training.run_directory import recover


def weights_of(seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    return tiny_model(seed=seed, **overrides).state_dict()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_restores_every_key_and_stores_tied_weights_once(tmp_path, tie):
    weights = weights_of(tie_embeddings=tie)
    checkpoint.save(tmp_path / "ck", weights, meta_for({"tie_embeddings": tie}))

    loaded = checkpoint.read_checkpoint(tmp_path / "ck")
    fresh = tiny_model(seed=1, tie_embeddings=tie)
    fresh.load_state_dict(loaded.weights, strict=True)
    assert_same_weights(fresh.state_dict(), weights)
    with safetensors.safe_open(tmp_path / "ck" / checkpoint.WEIGHTS_FILE, framework="pt") as f:
        stored = len(f.keys())
    assert stored == len(weights) - (2 if tie else 0)  # decoder embedding and output projection share the source's


def test_state_loads_with_plain_torch_load_and_meta_survives(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.tensor([[2, 5, 3]]), torch.tensor([[False] * 3]), torch.tensor([[2, 6]])).sum().backward()
    optimizer.step()
    state = {
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "progress": {"step": 7, "best": None, "seconds": 1.5},
    }
    meta = {**meta_for(step=7), "validation": {"valid_bleu": 12.5, "bleu_signature": "nrefs:1|tok:13a"}}
    checkpoint.save(tmp_path / "ck", model.state_dict(), meta, state)

    plain = torch.load(tmp_path / "ck" / checkpoint.STATE_FILE, weights_only=True)
    assert plain["progress"] == state["progress"] and torch.equal(plain["rng"]["torch"], state["rng"]["torch"])
    loaded = checkpoint.read_checkpoint(tmp_path / "ck" / checkpoint.WEIGHTS_FILE)
    assert loaded.path == tmp_path / "ck"
    as_json = json.loads(json.dumps(meta))  # the header's form: a list setting (train.freeze) is a tuple in a config
    assert loaded.meta == {
        **as_json,
        "format": checkpoint.FORMAT_VERSION,
        "mtkit_version": loaded.meta["mtkit_version"],
    }
    torch.optim.Adam(model.parameters()).load_state_dict(loaded.state["optimizer"])
    assert checkpoint.read_checkpoint(tmp_path / "ck", with_state=False).state is None


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_nothing_behind(tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = run_directory.save_in_run(run, 10, weights_of(0), meta_for(), {"progress": {"step": 10}}, keep_last=0)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)  # fails after model.safetensors is written
    with pytest.raises(OSError, match="disk full"):
        run_directory.save_in_run(run, 10, weights_of(1), meta_for(), {"progress": {"step": 10}}, keep_last=0)
    with pytest.raises(OSError, match="disk full"):
        run_directory.save_in_run(run, 20, weights_of(1), meta_for(), {"progress": {"step": 20}}, keep_last=0)

    assert [p.name for p in (run / run_folder.CHECKPOINTS_DIR).iterdir()] == [first.name]
    assert run_folder.latest(run) == first
    assert_same_weights(checkpoint.read_checkpoint(first).weights, weights_of(0))


def test_failed_swap_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    target = tmp_path / "best"
    checkpoint.save(target, weights_of(0), meta_for(step=1))
    real_rename = os.rename

    def rename(src, dst):
        if str(src).endswith(".tmp"):  # the old one is already set aside; the new one fails to move in
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        checkpoint.save(target, weights_of(1), meta_for(step=2))
    assert checkpoint.read_checkpoint(target).meta["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_directories_left_by_a_killed_save_are_ignored_then_cleaned(tmp_path):
    run = tmp_path / "run"
    done = run_directory.save_in_run(run, 10, weights_of(0), meta_for(step=10), None, keep_last=0)
    stray = done.with_name(".update-00000020.abc.tmp")  # what SIGKILL mid-save leaves: complete weights, odd name
    shutil.copytree(done, stray)
    (run / run_folder.CHECKPOINTS_DIR / "update-00000030").mkdir()  # partial: no weights file yet

    assert run_folder.run_checkpoints(run) == [done]
    assert run_folder.latest(run) == done
    run_directory.save_in_run(run, 20, weights_of(1), meta_for(step=20), None, keep_last=0)
    assert not stray.exists()


def test_a_kill_between_the_two_renames_of_a_swap_loses_no_checkpoint(tmp_path):
    """Replacing best/ renames it aside, then the new one in: a SIGKILL between the two leaves only the old."""
    run = tmp_path / "run"
    run_directory.save_best(run, weights_of(0), meta_for(step=10))
    run_directory.save_in_run(run, 10, weights_of(0), meta_for(step=10), None, keep_last=0)
    (run / "best").rename(run / ".best.old")
    shutil.copytree(run / ".best.old", run / ".best.xyz.tmp")  # the new one, never moved in

    assert loading.resolve(run) == run / ".best.old"  # translate still finds it, read-only
    (run / ".config.yaml.abc.tmp").write_text("half a con")  # an atomic write that a kill interrupted
    (run / ".keep-me").write_text("not mtkit's")
    recover(run)  # what training does first
    assert sorted(p.name for p in run.iterdir()) == [".keep-me", "best", "checkpoints"]
    assert_same_weights(checkpoint.read_checkpoint(loading.resolve(run)).weights, weights_of(0))

    (run / "best").rename(run / ".best.old")  # the same crash again; this time the next save finds it
    run_directory.save_best(run, weights_of(1), meta_for(step=20))
    assert sorted(p.name for p in run.iterdir()) == [".keep-me", "best", "checkpoints"]
    assert checkpoint.read_checkpoint(run / "best").meta["step"] == 20


@pytest.mark.parametrize("keep_last, kept", [(2, [4, 5]), (1, [5]), (0, [1, 2, 3, 4, 5])])
def test_keep_last_keeps_exactly_the_newest(tmp_path, keep_last, kept):
    weights = weights_of()
    for step in range(1, 6):
        run_directory.save_in_run(tmp_path, step, weights, meta_for(), {"progress": {"step": step}}, keep_last)
    found = run_folder.run_checkpoints(tmp_path)
    assert [checkpoint.read_checkpoint(p).meta["step"] for p in found] == kept


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    # e.g. before a restart
    stale = run_directory.save_in_run(tmp_path, 30, weights_of(), meta_for(), None, keep_last=0)
    fresh = run_directory.save_in_run(tmp_path, 10, weights_of(), meta_for(), None, keep_last=1)
    assert run_folder.run_checkpoints(tmp_path) == [fresh, stale]


def test_steps_are_ordered_by_number_not_name(tmp_path):
    for step in (99_999_999, 100_000_000, 5):
        run_directory.save_in_run(tmp_path, step, weights_of(), meta_for(), None, keep_last=0)
    assert [checkpoint.read_checkpoint(p).meta["step"] for p in run_folder.run_checkpoints(tmp_path)] == [
        5,
        99_999_999,
        100_000_000,
    ]


def test_another_format_names_both_versions_and_a_pt_file_is_not_read(tmp_path):
    header = {"mtkit": json.dumps({"format": 3})}
    (tmp_path / "new.safetensors").write_bytes(safetensors.torch.save({"w": torch.ones(1)}, metadata=header))
    torch.save({"format": 1, "model": {}}, tmp_path / "old.pt")

    with pytest.raises(CheckpointError, match=r"new.safetensors: checkpoint format 3 is not supported by mtkit \S+ "
                       r"\(it reads format 2\)"):  # fmt: skip
        checkpoint.read_checkpoint(tmp_path / "new.safetensors")
    with pytest.raises(CheckpointError, match=r"old.pt: a zip archive \(a PyTorch file\?\), not a checkpoint"):
        checkpoint.read_checkpoint(tmp_path / "old.pt")


def test_missing_and_truncated_checkpoints_are_clear_errors(tmp_path):
    checkpoint.save(tmp_path / "ck", weights_of(), meta_for())
    weights_file = tmp_path / "ck" / checkpoint.WEIGHTS_FILE
    weights_file.write_bytes(weights_file.read_bytes()[:-100])

    with pytest.raises(CheckpointError, match="not a readable mtkit checkpoint"):
        checkpoint.read_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        checkpoint.read_checkpoint(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match="no checkpoint in this run directory"):
        loading.resolve(tmp_path)


def test_average_is_the_mean_and_keeps_tied_weights_shared(tmp_path):
    a, b = weights_of(0), weights_of(1)
    checkpoint.save(tmp_path / "a", a, {**meta_for(step=20), "validation": {"valid_bleu": 1.0}})
    checkpoint.save(tmp_path / "b", b, meta_for(step=10))

    weights, meta = averaging.average_checkpoints([tmp_path / "a", tmp_path / "b"])
    for key in a:
        torch.testing.assert_close(weights[key], (a[key] + b[key]) / 2)
    assert weights["output.weight"] is weights["encoder.embed.tokens.weight"]
    assert meta["step"] == 20 and "validation" not in meta  # the newest's, less a score that is not the average's
    assert meta["averaged"] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_average_refuses_a_different_model(tmp_path):
    checkpoint.save(tmp_path / "a", weights_of(), meta_for())
    checkpoint.save(tmp_path / "b", weights_of(ffn=128), meta_for({"ffn": 128}))
    checkpoint.save(tmp_path / "c", weights_of(), meta_for(sha="1" * 64))

    with pytest.raises(CheckpointError, match=r"b: model settings differ"):
        averaging.average_checkpoints([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(CheckpointError, match=r"c: tokenizer differs"):
        averaging.average_checkpoints([tmp_path / "a", tmp_path / "c"])


# -- mtkit average ---------------------------------------------------------------------------


@pytest.fixture
def fake_run(tmp_path, spm_model):
    """A run directory with two checkpoints of a tiny model over the real tokenizer, no training needed."""
    section = {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "heads": 2, "ffn": 64}
    return run_dir_with(tmp_path, spm_model, section, (10, 20), with_state=True)


def test_average_command_writes_a_model_translate_can_use(fake_run, tmp_path):
    out = tmp_path / "out" / "avg.safetensors"
    out.parent.mkdir()
    result = invoke("average", fake_run, "--last", 2, "-o", out)
    assert result.exit_code == 0, result.output
    assert "update-00000010" in result.stderr and str(out) in result.stderr
    assert (out.parent / "spm.model").read_bytes() == (fake_run / "spm.model").read_bytes()

    for model in (out, fake_run):  # the average; the run's latest checkpoint, with the tokenizer two levels up
        translated = invoke("translate", model, "--beam", 2, "--device", "cpu", input="A dog runs.\n\nTwo men sit.\n")
        assert translated.exit_code == 0, translated.output
        assert len(translated.stdout.split("\n")) == 4

    again = invoke(
        "average", fake_run / "checkpoints" / "update-00000010", fake_run / "checkpoints" / "update-00000020", "-o", out
    )
    assert again.exit_code == 0, again.output  # checkpoint paths; an identical tokenizer already there is fine


@pytest.mark.parametrize(
    "args, message",
    [
        (["--last", 2, "{run}/checkpoints/update-00000010", "{run}/checkpoints/update-00000020"], "--last applies"),
        (["{run}/checkpoints/update-00000010"], "two or more checkpoints"),
        (["{tmp}"], "no checkpoints to average"),
        (["{run}", "-o", "{tmp}/avg.pt"], "must be a .safetensors file"),
        (["{run}", "-o", "{tmp}/clash/avg.safetensors"], "already exists and differs"),
    ],
)
def test_average_command_errors_are_one_line(fake_run, tmp_path, args, message):
    (tmp_path / "clash").mkdir()
    (tmp_path / "clash" / "spm.model").write_text("another tokenizer")
    args = [str(a).format(run=fake_run, tmp=tmp_path) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "avg.safetensors")]
    result = invoke("average", *args)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_failed_file_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    files.atomic_write_text(target, "old\n")

    def failing_write(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        files.atomic_write(target, failing_write)
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_a_checkpoint_killed_while_being_pruned_is_never_taken_for_a_whole_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for step in (1, 2):
        run_directory.save_in_run(run, step, weights_of(0), meta_for(step=step), {"progress": {}}, keep_last=2)
    real_unlink = os.unlink

    def killed_after_the_first_file(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        raise KeyboardInterrupt("killed")  # stands in for SIGKILL: nothing after this runs

    monkeypatch.setattr(os, "unlink", killed_after_the_first_file)
    with pytest.raises(KeyboardInterrupt):
        run_directory.save_in_run(run, 3, weights_of(0), meta_for(step=3), {"progress": {}}, keep_last=2)
    monkeypatch.undo()
    assert [p.name for p in run_folder.run_checkpoints(run)] == ["update-00000002", "update-00000003"]
    assert all(checkpoint.read_checkpoint(p).state is not None for p in run_folder.run_checkpoints(run))
    recover(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["update-00000002", "update-00000003"]
