"""Training under faults (non-finite losses, out of memory) and the optional features around the loop.

Faults are injected by patching ``TrainingObjective.forward``, the module the trainer calls once per
micro-batch. Only calls with gradients enabled are counted (numbered from 1), so the validation
forwards at the end of a run never shift the count.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import joint_post_norm_run, small_config
from typer.testing import CliRunner

from mtkit import files
from mtkit.cli import app
from mtkit.config import from_dict
from mtkit.errors import TrainingFailed
from mtkit.model import checkpoint, run_folder
from mtkit.model.loss import TrainingObjective
from mtkit.training import run_directory
from mtkit.training.schedule import lr_at
from mtkit.training.skip_policy import MAX_CONSECUTIVE_OOMS
from mtkit.training.step import accumulate_gradients
from mtkit.training.trainer import Trainer


class Faults:
    """Patches ``TrainingObjective.forward``; ``when(call)`` says which training calls fail and how.

    ``kind`` is "nan" (the summed loss becomes NaN, so its gradients do too) or "oom" (the call
    raises ``torch.OutOfMemoryError`` before any computation). ``on_call(call, objective)`` runs
    before each training call, e.g. to snapshot the weights the call is about to use.
    """

    def __init__(self, monkeypatch, when, kind="nan", on_call=None) -> None:
        self.when, self.kind, self.on_call = when, kind, on_call
        self.calls = 0
        self.failed: list[int] = []
        original = TrainingObjective.forward
        faults = self

        def forward(objective, *batch):
            if not torch.is_grad_enabled():  # validation
                return original(objective, *batch)
            faults.calls += 1
            if faults.on_call is not None:
                faults.on_call(faults.calls, objective)
            fail = faults.when(faults.calls)
            if fail:
                faults.failed.append(faults.calls)
                if faults.kind == "oom":
                    raise torch.OutOfMemoryError(f"injected out of memory at call {faults.calls}")
            loss, nll = original(objective, *batch)
            return (loss * math.nan, nll) if fail else (loss, nll)

        monkeypatch.setattr(TrainingObjective, "forward", forward)


def at(*calls):
    return lambda call: call in calls


def events(run_dir, kind=None) -> list[dict]:
    """metrics.jsonl's records of ``kind``, or of every update, validation and rollback: not the start and done
    records, which each start of training adds."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == kind or (kind is None and r["event"] not in ("start", "done"))]


def without_dropout(cfg):
    raw = cfg.to_dict()
    return from_dict({**raw, "model": {**raw["model"], "dropout": 0.0}})


def weights(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def checkpoint_bytes(run_dir) -> dict[str, bytes]:
    return {
        f"{d.name}/{f.name}": f.read_bytes() for d in run_folder.run_checkpoints(run_dir) for f in sorted(d.iterdir())
    }


# -- non-finite loss ------------------------------------------------------------------------


def test_nonfinite_loss_rolls_back_to_the_checkpoint_with_a_lower_learning_rate(
    tmp_path, corpus_files, spm_model, monkeypatch
):
    cfg = small_config(corpus_files, spm_model, max_steps=6, save_every=2, rollback_lr_factor=0.25)
    faults = Faults(monkeypatch, at(4))  # update 4; the newest checkpoint then is update 2
    trainer = Trainer(cfg, tmp_path)
    trainer.run()

    p = trainer.progress
    assert (p.step, p.rollbacks, p.lr_scale, p.nonfinite_skips) == (6, 1, 0.25, 0)
    assert faults.calls == 8  # updates 1-3, the bad 4th, then 3-6 again from the checkpoint
    records = events(tmp_path)
    assert [(r["event"], r["step"]) for r in records[:5]] == [
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("rollback", 2),
        ("train", 3),
    ]
    assert records[3]["lr_scale"] == 0.25
    train = events(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 3, 4, 5, 6]
    first, again = train[2], train[3]
    assert first["lr"] == pytest.approx(lr_at(3, cfg.train))
    assert again["lr"] == pytest.approx(0.25 * first["lr"])
    assert train[-1]["lr"] == pytest.approx(0.25 * lr_at(6, cfg.train))
    # Update 3 again starts from the restored weights, RNG and data position: the same loss as before.
    assert again["loss"] == pytest.approx(first["loss"], rel=1e-6)
    assert (first["rollbacks"], again["rollbacks"], train[-1]["rollbacks"]) == (0, 1, 1)

    saved = checkpoint.read_checkpoint(run_folder.latest(tmp_path))
    assert saved.meta["step"] == 6
    assert saved.state["progress"]["lr_scale"] == 0.25 and saved.state["progress"]["rollbacks"] == 1
    resumed = Trainer(small_config(corpus_files, spm_model, max_steps=8), tmp_path)
    assert (resumed.progress.lr_scale, resumed.progress.rollbacks) == (0.25, 1)


def test_no_rollbacks_left_fails_and_keeps_the_checkpoint(tmp_path, corpus_files, spm_model, monkeypatch):
    cfg = small_config(corpus_files, spm_model, max_steps=6, save_every=2, max_rollbacks=0)
    on_disk = {}

    def snapshot(call, objective):
        if call == 4:
            on_disk.update(checkpoint_bytes(tmp_path))

    Faults(monkeypatch, at(4), on_call=snapshot)
    trainer = Trainer(cfg, tmp_path)
    with pytest.raises(TrainingFailed, match=r"update 4\b.*train\.max_rollbacks") as failure:
        trainer.run()
    assert "update-00000002" in str(failure.value)  # names the last good checkpoint
    assert [d.name for d in run_folder.run_checkpoints(tmp_path)] == ["update-00000002"]
    assert checkpoint_bytes(tmp_path) == on_disk
    saved = checkpoint.read_checkpoint(run_folder.latest(tmp_path))
    assert saved.meta["step"] == 2 and saved.state["progress"]["step"] == 2
    assert not events(tmp_path, "rollback")


def test_nan_on_every_update_uses_up_the_rollbacks_then_fails(tmp_path, corpus_files, spm_model, monkeypatch):
    cfg = small_config(corpus_files, spm_model, max_steps=6, save_every=2, max_rollbacks=2)
    Faults(monkeypatch, lambda call: call >= 3)
    trainer = Trainer(cfg, tmp_path)
    with pytest.raises(TrainingFailed, match=r"update 3\b.*rolled back 2 times \(train\.max_rollbacks\)"):
        trainer.run()
    assert (trainer.progress.step, trainer.progress.rollbacks, trainer.progress.lr_scale) == (2, 2, 0.25)
    assert [r["lr_scale"] for r in events(tmp_path, "rollback")] == [0.5, 0.25]
    assert [d.name for d in run_folder.run_checkpoints(tmp_path)] == ["update-00000002"]
    saved = checkpoint.read_checkpoint(run_folder.latest(tmp_path))
    assert saved.meta["step"] == 2 and saved.state["progress"]["rollbacks"] == 0


def test_nan_before_any_checkpoint_fails_without_writing_one(tmp_path, corpus_files, spm_model, monkeypatch):
    Faults(monkeypatch, at(1))
    with pytest.raises(TrainingFailed, match="update 1.*no checkpoint to roll back to yet"):
        Trainer(small_config(corpus_files, spm_model, max_steps=4), tmp_path).run()
    assert run_folder.latest(tmp_path) is None


def test_nonfinite_skip_drops_the_update_and_counts_it(tmp_path, corpus_files, spm_model, monkeypatch):
    cfg = small_config(corpus_files, spm_model, max_steps=4, nonfinite="skip")
    seen = {}
    faults = Faults(monkeypatch, at(3), on_call=lambda call, objective: seen.update({call: weights(objective.model)}))
    trainer = Trainer(cfg, tmp_path)
    trainer.run()

    assert (trainer.progress.step, trainer.progress.nonfinite_skips, trainer.progress.rollbacks) == (4, 1, 0)
    assert faults.calls == 5
    assert_same_weights(seen[3], seen[4])  # the bad update changed nothing
    assert all(torch.isfinite(t).all() for t in trainer.model.state_dict().values())
    assert all(state["step"] == 4 for state in trainer.optimizer.state.values())  # Adam did not count it
    train = events(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in train)
    assert [r["nonfinite_skips"] for r in train] == [0, 0, 1, 1]
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path)).state["progress"]["nonfinite_skips"] == 1


def test_nonfinite_stop_fails_at_once(tmp_path, corpus_files, spm_model, monkeypatch):
    cfg = small_config(corpus_files, spm_model, max_steps=6, save_every=2, nonfinite="stop")
    faults = Faults(monkeypatch, at(3))
    trainer = Trainer(cfg, tmp_path)
    with pytest.raises(TrainingFailed, match=r"update 3\b.*train\.nonfinite is stop"):
        trainer.run()
    assert faults.calls == 3 and trainer.progress.step == 2 and trainer.progress.rollbacks == 0
    assert not events(tmp_path, "rollback")


# -- out of memory --------------------------------------------------------------------------


def test_out_of_memory_skips_one_update_and_training_goes_on(tmp_path, corpus_files, spm_model, monkeypatch):
    cfg = small_config(corpus_files, spm_model, max_steps=4)
    seen = {}
    faults = Faults(
        monkeypatch, at(3), "oom", on_call=lambda call, objective: seen.update({call: weights(objective.model)})
    )
    trainer = Trainer(cfg, tmp_path)
    trainer.run()

    assert (trainer.progress.step, trainer.progress.oom_skips) == (4, 1)
    assert faults.calls == 5 and faults.failed == [3]
    assert_same_weights(seen[3], seen[4])
    assert all(state["step"] == 4 for state in trainer.optimizer.state.values())
    assert [r["oom_skips"] for r in events(tmp_path, "train")] == [0, 0, 1, 1]


def test_gradients_of_a_batch_lost_to_out_of_memory_do_not_leak(tmp_path, corpus_files, spm_model, monkeypatch):
    cfg = without_dropout(small_config(corpus_files, spm_model, max_steps=4, accum=2))
    hit, fresh = Trainer(cfg, tmp_path / "hit"), Trainer(cfg, tmp_path / "fresh")
    assert_same_weights(weights(hit.model), weights(fresh.model))
    corpus = hit.corpus
    idx = corpus.batch_indices(cfg.train.batch_tokens, seed=0)[:4]
    groups = [[idx[0], idx[1]], [idx[2], idx[3]]]

    def update(trainer, group):
        return trainer.train_step([corpus.collate(i) for i in group], sum(map(corpus.target_tokens, group)))

    Faults(monkeypatch, at(2), "oom")  # the second micro-batch, after the first one's backward
    before = weights(hit.model)
    stats = update(hit, groups[0])
    assert stats["skipped"] == "oom" and stats["oom_ranks"] == 1
    assert all(p.grad is None for p in hit.model.parameters())
    assert_same_weights(before, weights(hit.model))
    assert update(hit, groups[1])["skipped"] is None
    assert update(fresh, groups[1])["skipped"] is None
    assert_same_weights(weights(hit.model), weights(fresh.model))


def test_out_of_memory_in_every_update_stops_with_advice(tmp_path, corpus_files, spm_model, monkeypatch):
    faults = Faults(monkeypatch, lambda call: True, "oom")
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=20), tmp_path)
    with pytest.raises(TrainingFailed, match=r"train\.batch_tokens \(now 512\).*train\.accum"):
        trainer.run()
    assert faults.calls == MAX_CONSECUTIVE_OOMS
    assert (trainer.progress.step, trainer.progress.oom_skips) == (0, MAX_CONSECUTIVE_OOMS)


def test_out_of_memory_count_restarts_after_a_good_update(tmp_path, corpus_files, spm_model, monkeypatch):
    run_of_ooms = MAX_CONSECUTIVE_OOMS - 1
    Faults(monkeypatch, lambda call: call % MAX_CONSECUTIVE_OOMS != 0, "oom")  # 4 out of memory, 1 good, ...
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=3), tmp_path)
    trainer.run()
    assert (trainer.progress.step, trainer.progress.oom_skips) == (3, 3 * run_of_ooms)


# -- gradient accumulation ------------------------------------------------------------------


def test_accumulated_gradients_equal_those_of_one_batch_holding_both(tmp_path, corpus_files, spm_model):
    cfg = without_dropout(small_config(corpus_files, spm_model, max_steps=1, batch_tokens=256))
    trainer = Trainer(cfg, tmp_path)
    corpus = trainer.corpus
    i1, i2 = corpus.batch_indices(256, seed=0)[:2]
    b1, b2, both = corpus.collate(i1), corpus.collate(i2), corpus.collate(np.concatenate([i1, i2]))
    tokens = corpus.target_tokens(i1) + corpus.target_tokens(i2)
    assert tokens == b1.target_tokens + b2.target_tokens == both.target_tokens
    assert b1.tgt_out.shape[1] != b2.tgt_out.shape[1] or b1.src.shape[1] != b2.src.shape[1]  # padding differs

    def gradients(batches):
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, nll, oom = accumulate_gradients(
            trainer.forward, trainer.scaler, trainer.optimizer, batches, tokens, trainer.dist, trainer.device
        )
        assert not oom
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss), float(nll), grads

    loss_a, nll_a, accumulated = gradients([b1, b2])
    loss_b, nll_b, combined = gradients([both])
    assert loss_a == pytest.approx(loss_b, rel=1e-5) and nll_a == pytest.approx(nll_b, rel=1e-5)
    for name in combined:
        torch.testing.assert_close(accumulated[name], combined[name], rtol=1e-4, atol=1e-6, msg=name)

    # ...and they are the gradients of the group's mean loss per target token.
    trainer.model.zero_grad(set_to_none=True)
    (trainer.objective(both.src, both.src_pad_mask, both.tgt_in, both.tgt_out)[0] / tokens).backward()
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(combined[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_an_update_accumulating_two_batches_equals_one_on_both(tmp_path, corpus_files, spm_model):
    cfg = without_dropout(small_config(corpus_files, spm_model, max_steps=2, accum=2))
    split, joined = Trainer(cfg, tmp_path / "a"), Trainer(cfg, tmp_path / "b")
    group = next(split.update_groups())  # the first update's group
    batches, group_tokens = group.batches, group.tokens
    first = split.walk.epoch_batches(1)[:2]
    assert split.progress.batch_in_epoch == 2
    assert len(batches) == 2
    assert all(torch.equal(b.tgt_out, split.corpus.collate(i).tgt_out) for b, i in zip(batches, first))
    assert group_tokens == sum(map(split.corpus.target_tokens, first))

    stepped = {}
    for name, trainer in (("split", split), ("joined", joined)):
        step = trainer.optimizer.step

        def spy(*args, trainer=trainer, name=name, step=step, **kwargs):
            stepped[name] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}  # clipped
            return step(*args, **kwargs)

        trainer.optimizer.step = spy  # on this optimizer only
    a = split.train_step(batches, group_tokens)
    b = joined.train_step([joined.corpus.collate(np.concatenate(first[:2]))], group_tokens)
    assert a["skipped"] is None and b["skipped"] is None
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for name, grad in stepped["joined"].items():
        torch.testing.assert_close(stepped["split"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    for name, t in joined.model.state_dict().items():
        # Key biases get no gradient in theory (softmax ignores a shift shared by all keys): what they get is
        # rounding noise, which Adam's first step (about lr * sign(grad)) turns into a full-size update.
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(split.model.state_dict()[name], t, rtol=1e-5, atol=1e-7, msg=name)


# -- TensorBoard, keep_last --------------------------------------------------


def test_tensorboard_receives_the_training_loss(tmp_path, corpus_files, spm_model):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(small_config(corpus_files, spm_model, max_steps=3, tensorboard=True), tmp_path).run()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"]
    scalars = acc.Scalars("train/loss")
    logged = events(tmp_path, "train")
    assert [s.step for s in scalars] == [r["step"] for r in logged] == [1, 2, 3]
    assert [s.value for s in scalars] == pytest.approx([r["loss"] for r in logged], rel=1e-6)


def test_keep_last_keeps_the_newest_checkpoints_and_the_newest_resumes(tmp_path, corpus_files, spm_model):
    Trainer(small_config(corpus_files, spm_model, max_steps=5, save_every=1, keep_last=2), tmp_path).run()
    assert [d.name for d in run_folder.run_checkpoints(tmp_path)] == ["update-00000004", "update-00000005"]
    assert [p.name for p in (tmp_path / run_folder.CHECKPOINTS_DIR).iterdir() if p.name.startswith(".")] == []
    resumed = Trainer(small_config(corpus_files, spm_model, max_steps=6, save_every=1, keep_last=2), tmp_path)
    assert resumed.progress.step == 5
    resumed.run()
    assert [d.name for d in run_folder.run_checkpoints(tmp_path)] == ["update-00000005", "update-00000006"]


# -- command line ---------------------------------------------------------------------------


def write_config(path, cfg):
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def test_fp16_overflow_steps_are_skipped_and_counted(tmp_path, corpus_files, spm_model, monkeypatch):
    """fp16 itself needs a GPU; the skip-and-count path is the scaler's, so a CPU scaler exercises it."""
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=4, log_every=4), tmp_path)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = {}
    Faults(monkeypatch, at(2), on_call=lambda call, objective: call == 2 and before.update(weights(objective)))
    trainer.run()
    assert trainer.progress.step == 4 and trainer.progress.overflow_skips == 1
    assert trainer.progress.nonfinite_skips == 0 and trainer.progress.rollbacks == 0  # not treated as divergence
    assert trainer.scaler.get_scale() == 2.0**15  # halved once by the overflow
    assert events(tmp_path, "train")[-1]["overflow_skips"] == 1
    after_skip = checkpoint.read_checkpoint(run_folder.latest(tmp_path)).state["optimizer"]["state"][0]["step"]
    assert int(after_skip) == 4  # Adam stepped 4 times in 5 micro-batches


def test_cli_nonfinite_failure_is_one_error_line_and_exit_1(tmp_path, corpus_files, spm_model, monkeypatch):
    config = write_config(tmp_path / "c.yaml", small_config(corpus_files, spm_model, max_steps=6))
    Faults(monkeypatch, at(3))
    args = ["train", str(config), "--out", str(tmp_path / "run"), "--set", "train.nonfinite=stop"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    assert "update 3" in errors[0] and "train.nonfinite is stop" in errors[0]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_dry_run_shows_the_training_flags(tmp_path, corpus_files, spm_model):
    config = write_config(tmp_path / "c.yaml", small_config(corpus_files, spm_model, max_steps=6))
    flags = ["--save-every", "7", "--keep-last", "3", "--precision", "bf16", "--compile", "--tensorboard"]
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(tmp_path / "run"), "--dry-run", *flags])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)["train"]  # the printed config is YAML (the rest are comments)
    assert {k: shown[k] for k in ("save_every", "keep_last", "precision", "compile", "tensorboard")} == {
        "save_every": 7,
        "keep_last": 3,
        "precision": "bf16",
        "compile": True,
        "tensorboard": True,
    }
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target", ["checkpoints", "best"])
def test_a_failing_disk_write_keeps_the_last_checkpoint_and_stops_with_the_reason(
    tmp_path, corpus_files, spm_model, monkeypatch, target
):
    """The second save into RUN/checkpoints (or of RUN/best) hits a full disk: the first stays whole and loadable."""
    cfg = small_config(corpus_files, spm_model, max_steps=6, valid_every=2)
    config = write_config(tmp_path / "c.yaml", cfg)
    run = tmp_path / "run"
    real_write_bytes = Path.write_bytes
    saves = []

    def write_bytes(path: Path, data: bytes) -> int:
        folder = run / "checkpoints" if target == "checkpoints" else run
        if path.parent.parent == folder and path.parent.name.startswith(".update" if target != "best" else ".best"):
            saves.append(path)
            if len(saves) == 2:
                real_write_bytes(path, data[: len(data) // 3])  # a part lands, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(run)])
    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    what = "the checkpoint of update 4" if target == "checkpoints" else "the best checkpoint"
    assert error.startswith(f"error: cannot write {what} in {run}") and "No space left on device" in error, error
    saved = [2] if target == "checkpoints" else [2, 4]  # update 4 is saved before its validation writes best/
    assert f"{run / 'checkpoints' / f'update-{saved[-1]:08d}'} is intact" in error and "Traceback" not in result.output
    assert [p.name for p in run_folder.run_checkpoints(run)] == [f"update-{step:08d}" for step in saved]
    assert checkpoint.read_checkpoint(run_folder.latest(run)).state["progress"]["step"] == saved[-1]
    assert checkpoint.read_checkpoint(run / "best", with_state=False).meta["step"] == 2
    leftovers = [p for folder in (run, run / "checkpoints") for p in folder.iterdir() if p.is_dir()]
    assert not [p for p in leftovers if p.name.startswith(".")]

    monkeypatch.setattr(Path, "write_bytes", real_write_bytes)  # space freed: the same command resumes
    assert CliRunner().invoke(app, ["train", str(config), "--out", str(run)]).exit_code == 0
    straight = tmp_path / "straight"
    assert CliRunner().invoke(app, ["train", str(config), "--out", str(straight)]).exit_code == 0
    resumed = checkpoint.read_checkpoint(run_folder.latest(run))
    reference = checkpoint.read_checkpoint(run_folder.latest(straight))
    assert resumed.meta["step"] == 6 and all(
        torch.equal(resumed.weights[k], reference.weights[k]) for k in reference.weights
    )


# -- validation data, saving order, what a resume keeps ---------------------------------------------


def cli_train(config, run, *args):
    return CliRunner().invoke(app, ["train", str(config), "--out", str(run), *map(str, args)])


def test_a_validation_pair_longer_than_the_positions_is_left_out_of_the_loss(tmp_path, corpus_files, spm_model):
    """Such a pair once crashed every first validation with a ValueError, so the run could never pass it."""
    long_valid = tmp_path / "val.de"
    lines = corpus_files["val.de"].read_text().splitlines()
    lines[3] = " ".join(lines[:40])  # far over 64 positions
    long_valid.write_text("\n".join(lines) + "\n")
    cfg = small_config(corpus_files, spm_model, max_steps=4, valid_every=2, valid_bleu=True, best_metric="bleu")
    raw = cfg.to_dict()
    raw["data"].update(valid_tgt=str(long_valid), max_tokens=60)
    raw["model"]["max_positions"] = 64
    result = cli_train(write_config(tmp_path / "c.yaml", from_dict(raw)), tmp_path / "run")
    assert result.exit_code == 0, result.output
    left_out = re.search(
        r"validation loss leaves out (\d+) of 40 pairs .*: 0 with an empty side, (\d+) longer than 63", result.stderr
    )
    assert left_out and left_out[1] == left_out[2] and int(left_out[1]) >= 1, result.stderr
    assert [e["step"] for e in events(tmp_path / "run", "valid")] == [2, 4]


def test_a_validation_set_with_an_empty_side_is_refused_before_any_update(tmp_path, corpus_files, spm_model):
    """All-blank references once ended the first validation in a ZeroDivisionError."""
    blank = tmp_path / "blank.de"
    blank.write_text("\n" * 40)
    raw = small_config(corpus_files, spm_model, max_steps=4, valid_every=2).to_dict()
    raw["data"]["valid_tgt"] = str(blank)
    result = cli_train(write_config(tmp_path / "c.yaml", from_dict(raw)), tmp_path / "run")
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith("error: "), result.output
    assert "blank.de: no validation pair to compute a loss on (40 with an empty side" in result.stderr
    assert run_folder.latest(tmp_path / "run") is None


def test_the_checkpoint_of_an_update_is_saved_before_its_validation(tmp_path, corpus_files, spm_model, monkeypatch):
    """A validation that fails costs no training: the resumed run validates that update first, then goes on
    exactly as an uninterrupted run does."""
    cfg = small_config(corpus_files, spm_model, max_steps=6, valid_every=2, save_every=2, log_every=1)
    config = write_config(tmp_path / "c.yaml", without_dropout(cfg))
    original = Trainer.validate

    def fails_at_update_4(trainer):
        if trainer.progress.step == 4:
            raise KeyboardInterrupt("killed while validating")
        return original(trainer)

    monkeypatch.setattr(Trainer, "validate", fails_at_update_4)
    with pytest.raises(KeyboardInterrupt):
        Trainer(from_dict(yaml.safe_load(config.read_text())), tmp_path / "run").run()
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path / "run")).meta["step"] == 4  # saved before validating
    monkeypatch.setattr(Trainer, "validate", original)
    assert cli_train(config, tmp_path / "run").exit_code == 0
    assert cli_train(config, tmp_path / "straight").exit_code == 0
    assert [e["step"] for e in events(tmp_path / "run", "valid")] == [2, 4, 6]
    resumed, straight = events(tmp_path / "run"), events(tmp_path / "straight")
    assert len(resumed) == len(straight)  # zip below would hide a run that logged only a prefix
    timed = ("tgt_tokens_per_s", "seconds_per_update", "valid_seconds")  # what the clock decides
    assert resumed == [{**e, **{k: r[k] for k in timed if k in e}} for e, r in zip(straight, resumed)]
    assert checkpoint_bytes(tmp_path / "run").keys() == checkpoint_bytes(tmp_path / "straight").keys()
    for name in ("best", run_folder.latest(tmp_path / "run").relative_to(tmp_path / "run")):
        a = checkpoint.read_checkpoint(tmp_path / "run" / name, with_state=False).weights
        assert_same_weights(a, checkpoint.read_checkpoint(tmp_path / "straight" / name, with_state=False).weights)
    again = cli_train(config, tmp_path / "run")  # a finished run has nothing left to validate
    assert again.exit_code == 0 and [e["step"] for e in events(tmp_path / "run", "valid")] == [2, 4, 6]


def test_the_last_checkpoint_is_written_once(tmp_path, corpus_files, spm_model, monkeypatch):
    """With train.max_steps a multiple of train.save_every (the shipped recipe) it was written twice."""
    saved = []
    real_save = run_directory.save_in_run
    monkeypatch.setattr(
        run_directory, "save_in_run", lambda run, step, *a: saved.append(step) or real_save(run, step, *a)
    )
    cfg = small_config(corpus_files, spm_model, max_steps=6, valid_every=3, save_every=3)
    assert cli_train(write_config(tmp_path / "c.yaml", cfg), tmp_path / "run").exit_code == 0
    assert saved == [3, 6]


def test_a_disk_that_fills_up_inside_torch_save_stops_training_with_the_reason(tmp_path, corpus_files, spm_model):
    """torch.save reports a failed write as RuntimeError 'unexpected pos', which once became a traceback.

    The file-size limit of the process (RLIMIT_FSIZE) makes the kernel fail writes beyond it, as a full
    disk does; it sits between the weights' size and the training state's, so the state fails.
    """
    raw = small_config(corpus_files, spm_model, max_steps=2, save_every=2).to_dict()
    raw["model"].update(d_model=128, ffn=512)  # weights well above the tokenizer's size, which is copied too
    cfg = from_dict(raw)
    config = write_config(tmp_path / "c.yaml", cfg)
    run = tmp_path / "run"
    weights_size = sum(p.numel() * 4 for p in build_model_of(cfg).parameters())  # tied weights stored once
    assert weights_size > 2 * spm_model.path.stat().st_size
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({int(weights_size * 1.5)}, resource.RLIM_INFINITY))\n"
        "from mtkit.cli import main\n"
        f"sys.argv = ['mtkit', 'train', {str(config)!r}, '--out', {str(run)!r}]\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: cannot write the checkpoint of update 2 in {run}") and "File too large" in error
    assert run_folder.latest(run) is None and not list((run / "checkpoints").iterdir())


def build_model_of(cfg):
    from mtkit.model.transformer import build_model

    return build_model(cfg.model, 300, 300, 0)


def test_a_refused_resume_leaves_the_config_that_describes_the_checkpoints(tmp_path, corpus_files, spm_model):
    config = write_config(tmp_path / "c.yaml", small_config(corpus_files, spm_model, max_steps=2))
    run = tmp_path / "run"
    assert cli_train(config, run).exit_code == 0
    before = (run / "config.yaml").read_text()
    result = cli_train(config, run, "--set", "model.d_model=64")
    assert result.exit_code == 1 and "model settings differ" in result.stderr
    assert (run / "config.yaml").read_text() == before


def test_starting_a_training_leaves_other_programs_temporary_files_alone(tmp_path, corpus_files, spm_model):
    """It once deleted every .*.tmp in the run directory, so a `translate -o RUN/x` running beside it lost its work."""
    config = write_config(tmp_path / "c.yaml", small_config(corpus_files, spm_model, max_steps=2))
    run = tmp_path / "run"
    assert cli_train(config, run).exit_code == 0
    others = [run / ".test.hyp.de.k2j4x9q1.tmp", run / ".avg.safetensors.abcdefgh.tmp"]
    mine = [run / ".config.yaml.zzzzzzzz.tmp", run / "checkpoints" / ".update-00000004.q1w2e3r4.tmp"]
    mine.append(run / "checkpoints" / "update-00000002" / ".validation.json.k3j4h5g6.tmp")
    for path in others + mine:
        path.write_text("half written")
    assert cli_train(config, run, "--set", "train.max_steps=4").exit_code == 0
    assert all(path.exists() for path in others) and not any(path.exists() for path in mine)


def test_the_first_log_line_after_a_resume_is_the_mean_an_uninterrupted_run_logs(tmp_path, corpus_files, spm_model):
    """It once averaged only the updates since the resume."""
    cfg = without_dropout(small_config(corpus_files, spm_model, max_steps=8, save_every=3, log_every=4))
    config = write_config(tmp_path / "c.yaml", cfg)
    assert cli_train(config, tmp_path / "straight").exit_code == 0
    assert cli_train(config, tmp_path / "run", "--set", "train.max_steps=3").exit_code == 0  # stops at update 3
    assert cli_train(config, tmp_path / "run").exit_code == 0  # resumes there; the line at update 4 covers 1-4

    def logged(run):
        return {(e["step"], e["loss"], e["nll"]) for e in events(run, "train")}

    assert logged(tmp_path / "run") == logged(tmp_path / "straight")


# -- file-system errors name their path -----------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EINVAL])
def test_a_failed_fsync_names_the_file_as_the_export_calls_it(tmp_path, spm_model, monkeypatch, code):
    """An fsync that fails (a full disk: ENOSPC; a file system that cannot: EINVAL) names no file of its own: the
    error line names the one being written, by the name it would have had in the output folder."""
    run, out = joint_post_norm_run(tmp_path, spm_model), tmp_path / "ct2"

    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)
    result = CliRunner().invoke(app, ["export", str(run), "-o", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert re.fullmatch(rf"error: {re.escape(str(out))}(/[\w.]+)?: {os.strerror(code)}\n", result.stderr), result.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_write_without_a_file_name_names_the_folder_being_written(tmp_path, monkeypatch):
    """A file object's write to a full disk raises an OSError that names no file."""

    def fill(tmp: Path) -> None:
        with open(tmp / "weights.bin", "wb") as f:
            f.write(b"begun")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as caught:
        files.atomic_write_directory(tmp_path / "out", fill)
    assert files.os_error_line(caught.value) == f"{tmp_path / 'out'}: No space left on device"


def test_a_set_aside_folder_that_cannot_be_removed_names_the_folder(tmp_path, monkeypatch):
    """shutil.rmtree raises some errors with neither an errno nor a file name ("Cannot call rmtree on a symbolic
    link"); replacing a folder whose old copy it cannot remove names the folder."""
    out = tmp_path / "out"
    files.atomic_write_directory(out, lambda tmp: (tmp / "a").write_text("old"))
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs) -> None:
        if Path(path).name == f".{out.name}.old":
            raise OSError("Cannot call rmtree on a symbolic link")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(OSError) as caught:
        files.atomic_write_directory(out, lambda tmp: (tmp / "a").write_text("new"))
    assert files.os_error_line(caught.value) == f"{out}: Cannot call rmtree on a symbolic link"
