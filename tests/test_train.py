"""The training loop: schedule, tokenizer set-up, checkpoints and exact resumption."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from helpers import small_config

from mtkit.config import TrainConfig, from_dict
from mtkit.model import checkpoint, run_folder
from mtkit.training import trainer as trainer_module
from mtkit.training.resume import Progress, TrainingState
from mtkit.training.run_directory import trim_metrics
from mtkit.training.schedule import lr_at
from mtkit.training.stop_signals import StopSignals
from mtkit.training.tokenizers import prepare_tokenizers
from mtkit.training.trainer import Trainer, run_training


def test_lr_warms_up_linearly_then_decays_as_inverse_sqrt():
    tc = TrainConfig(lr=1e-3, warmup=100)
    assert lr_at(1, tc) == pytest.approx(1e-5)
    assert lr_at(50, tc) == pytest.approx(5e-4)
    assert lr_at(100, tc) == pytest.approx(1e-3)
    assert lr_at(400, tc) == pytest.approx(5e-4)
    assert lr_at(7, TrainConfig(lr=1e-3, warmup=0)) == 1e-3


def test_loss_goes_down_and_checkpoints_are_written(tmp_path, corpus_files, spm_model):
    cfg = small_config(corpus_files, spm_model, max_steps=30, lr=3e-3, valid_every=15, valid_bleu=True)
    result = Trainer(cfg, tmp_path).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert losses[-1] < losses[0] - 1.0
    assert [r["step"] for r in records if r["event"] == "valid"] == [15, 30]
    assert "valid_bleu" in result and "bleu_signature" in result
    for name in ("best/model.safetensors", "config.yaml", "spm.model"):
        assert (tmp_path / name).is_file()
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path)).meta["step"] == 30


def test_a_model_with_an_output_bias_trains_it(tmp_path, corpus_files, spm_model):
    raw = small_config(corpus_files, spm_model, max_steps=2).to_dict()
    raw["model"]["output_bias"] = True
    trainer = Trainer(from_dict(raw), tmp_path)
    assert not trainer.model.output.bias.any()  # it starts at zero
    trainer.run()
    assert trainer.model.output.bias.abs().min() > 0


def test_resumed_training_equals_uninterrupted_training(tmp_path, corpus_files, spm_model):
    straight = Trainer(small_config(corpus_files, spm_model, max_steps=6), tmp_path / "a")
    straight.run()

    Trainer(small_config(corpus_files, spm_model, max_steps=3), tmp_path / "b").run()
    resumed = Trainer(small_config(corpus_files, spm_model, max_steps=6), tmp_path / "b")
    assert resumed.progress.step == 3
    resumed.run()
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_with_a_different_model_is_refused(tmp_path, corpus_files, spm_model):
    Trainer(small_config(corpus_files, spm_model, max_steps=1), tmp_path).run()
    cfg = small_config(corpus_files, spm_model, max_steps=2)
    bigger = from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "d_model": 64}})
    with pytest.raises(checkpoint.CheckpointError, match="model settings differ"):
        Trainer(bigger, tmp_path)


def test_training_state_reads_back_what_it_saved_and_refuses_a_malformed_one(tmp_path):
    saved = TrainingState({"state": {}}, {}, [{"torch": None}], Progress(step=4, best=1.5, validated=4))
    assert TrainingState.read(tmp_path, saved.to_dict(), 4) == saved
    with pytest.raises(checkpoint.CheckpointError, match="progress.step 4 is not the header's step 5"):
        TrainingState.read(tmp_path, saved.to_dict(), 5)
    malformed = {**saved.to_dict(), "progress": {"step": 4, "stale": "two"}}
    with pytest.raises(checkpoint.CheckpointError, match="progress.stale must be an integer"):
        TrainingState.read(tmp_path, malformed, 4)
    with pytest.raises(checkpoint.CheckpointError, match="its training state has no 'scaler', 'rng', 'progress'"):
        TrainingState.read(tmp_path, {"optimizer": {}}, 4)


def test_a_validation_recorded_after_the_checkpoint_counts_as_done(tmp_path):
    (tmp_path / "validation.json").write_text(json.dumps({"best": 2.0, "stale": 1}))
    state = TrainingState({}, {}, [], Progress(step=4, validated=2)).to_dict()
    progress = TrainingState.read(tmp_path, state, 4).progress
    assert (progress.best, progress.stale, progress.validated) == (2.0, 1, 4)


def test_rank_0_prepares_the_tokenizers_once(tmp_path, corpus_files, spm_model, monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args)
        return prepare_tokenizers(*args)

    monkeypatch.setattr(trainer_module, "prepare_tokenizers", counted)
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=1), tmp_path)
    assert len(calls) == 1
    assert trainer.src_tok.sha256 == spm_model.sha256 == trainer.tgt_tok.sha256


def test_optimizer_sees_gradients_clipped_to_clip_norm(tmp_path, corpus_files, spm_model, monkeypatch):
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=1, clip_norm=1e-3), tmp_path)
    batches = trainer.corpus.batches(512, seed=0)[:1]
    seen = {}
    original = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        grads = [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
        seen["norm"] = float(torch.linalg.vector_norm(torch.cat(grads)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    stats = trainer.train_step(batches, batches[0].target_tokens)
    assert stats["grad_norm"] > 1e-3  # the norm before clipping
    assert math.isclose(seen["norm"], 1e-3, rel_tol=1e-3)


def test_restart_starts_over_instead_of_resuming(tmp_path, corpus_files, spm_model):
    cfg = small_config(corpus_files, spm_model, max_steps=2)
    run_training(cfg, tmp_path)
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path)).meta["step"] == 2
    assert Trainer(cfg, tmp_path).progress.step == 2  # would resume
    run_training(cfg, tmp_path, restart=True)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"][0] == 1  # the old log went with the old checkpoints
    assert [r["event"] for r in records].count("start") == 1


def test_wall_clock_budget_stops_training_and_says_the_run_is_incomplete(tmp_path, corpus_files, spm_model):
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=1000, max_time=1e-6), tmp_path)
    result = trainer.run()
    assert trainer.progress.step == 1
    reason = "stopped by train.max_time (1e-06 min) at update 1 of 1000"
    assert trainer.stop_condition() == ("max_time", reason)
    assert result["stop"] == {"stopped_by": "max_time", "reason": reason, "max_steps": 1000}
    done = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert done == {"event": "done", "step": 1, **result["stop"]}
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path)).state["progress"]["seconds"] > 0


def test_patience_stops_after_validations_without_a_new_best(tmp_path, corpus_files, spm_model, monkeypatch):
    trainer = Trainer(small_config(corpus_files, spm_model, max_steps=1000, valid_every=2, patience=2), tmp_path)
    monkeypatch.setattr(trainer, "validate", lambda: {"valid_loss": 2.0, "valid_nll": 2.0, "valid_ppl": 7.4})
    trainer.run()
    assert trainer.progress.step == 6  # best at update 2, no better at 4 and 6
    assert trainer.stop_condition()[0] == "patience" and "train.patience" in trainer.stop_condition()[1]
    assert checkpoint.read_checkpoint(tmp_path / "best").meta["step"] == 2


def test_a_second_training_on_the_same_run_directory_is_refused(tmp_path, corpus_files, spm_model):
    first = Trainer(small_config(corpus_files, spm_model, max_steps=2), tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=f"in use by another training process \\(pid {os.getpid()}\\)"):
        Trainer(small_config(corpus_files, spm_model, max_steps=2), tmp_path)
    first.run()
    assert Trainer(small_config(corpus_files, spm_model, max_steps=4), tmp_path).progress.step == 2


def test_repeated_sigterm_still_ends_in_a_save_but_a_second_ctrl_c_aborts():
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. from the scheduler and again from torchrun
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt), StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)


def test_resuming_drops_metrics_after_the_checkpoint_and_a_torn_last_line(tmp_path):
    """Updates after the checkpoint are trained (and logged) again, so they must not be logged twice."""
    metrics = tmp_path / "metrics.jsonl"
    records = [{"event": "train", "step": s, "loss": 1.0 / s} for s in range(1, 7)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "train", "st')
    trim_metrics(metrics, 4)
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == records[:4]
    trim_metrics(tmp_path / "absent.jsonl", 4)  # a run that never logged
    assert not (tmp_path / "absent.jsonl").exists()
