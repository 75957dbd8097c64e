"""LoRA training (train.lora): a run that trains adapters on a frozen train.init_from model, saves them alone with
the digest of that base, resumes exactly, and is a model translate, average and train.init_from take."""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors
import torch
from helpers import invoke, one_line_error, small_config, with_header

import mtkit
from mtkit.config import ConfigError, LoraConfig, from_dict, read_config
from mtkit.model import checkpoint, loading, lora, run_folder
from mtkit.model.adapter_file import ADAPTER_KEY
from mtkit.training.averaging import average_checkpoints
from mtkit.training.stop_signals import TrainingStopped
from mtkit.training.trainer import Trainer

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["attention", "ffn"]}


def lora_config(corpus_files, spm_model, init_from: Path, lora_settings: dict | None = LORA, **train):
    """small_config's data and training settings, with no model or tokenizer section (those of ``init_from``),
    training adapters of ``lora_settings`` (None: none) at a learning rate that moves them in a few updates."""
    raw = small_config(corpus_files, spm_model).to_dict()
    raw["model"], raw["tokenizer"] = {}, {}
    raw["train"].update({"init_from": str(init_from), "schedule": "constant", "warmup": 2, "max_steps": 4, "lr": 1e-2})
    raw["train"].update(train)
    raw["train"]["lora"] = lora_settings or {}
    return from_dict(raw)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus_files, spm_model) -> Path:
    """A tiny run of 4 updates (checkpoints at 2 and 4, best/ at 4)."""
    run = tmp_path_factory.mktemp("base") / "run"
    Trainer(small_config(corpus_files, spm_model, max_steps=4), run).run()
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus_files, spm_model, base_run) -> Trainer:
    """4 updates of adapters on every projection of ``base_run`` (checkpoints at 2 and 4, best/ at 4)."""
    trainer = Trainer(lora_config(corpus_files, spm_model, base_run), tmp_path_factory.mktemp("lora") / "run")
    trainer.run()
    return trainer


def stored(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A weights file's header metadata and tensors."""
    with safetensors.safe_open(path, framework="pt") as f:
        return dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}


def test_a_lora_run_trains_its_adapters_alone_and_saves_them_small_with_the_digest_of_its_base(lora_run, base_run):
    model = lora_run.model
    base = checkpoint.read_checkpoint(base_run / "best", with_state=False).weights
    adapters = lora.adapter_weights(model)
    held = {name: tensor for name, tensor in model.state_dict().items() if name not in adapters}
    assert held.keys() == base.keys() and all(torch.equal(held[name], base[name]) for name in base)
    assert len(adapters) == 2 * (4 + 2 + 8 + 2)  # one encoder and one decoder layer, every projection
    assert all(t.abs().max() > 0 for name, t in adapters.items() if name.endswith(".b"))  # B left zero
    trained = [p for group in lora_run.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in trained] == [id(p) for p in lora.adapter_parameters(model)]
    assert all(p.requires_grad == (id(p) in {id(t) for t in trained}) for p in model.parameters())

    base_file = base_run / "best" / checkpoint.WEIGHTS_FILE
    for folder in [*run_folder.run_checkpoints(lora_run.run_dir.path), lora_run.run_dir.path / "best"]:
        metadata, tensors = stored(folder / checkpoint.WEIGHTS_FILE)
        assert tensors.keys() == adapters.keys()
        assert (folder / checkpoint.WEIGHTS_FILE).stat().st_size < base_file.stat().st_size / 4
        assert json.loads(metadata[ADAPTER_KEY])["base_sha256"] == checkpoint.weights_digest(base)
    final = stored(lora_run.run_dir.path / "best" / checkpoint.WEIGHTS_FILE)[1]
    assert all(torch.equal(final[name], adapters[name]) for name in adapters)
    meta = checkpoint.read_checkpoint(lora_run.run_dir.path / "best", with_state=False).meta
    assert meta["init"]["path"] == str(base_file.resolve())


def test_the_run_translates_as_its_base_with_its_adapter_and_refuses_a_base_that_is_gone(
    lora_run, base_run, corpus_files, tmp_path
):
    run = lora_run.run_dir.path
    lines = corpus_files["val.en"].read_text().splitlines()[:8]
    by_itself = mtkit.load(run, device="cpu", precision="fp32", beam=2)
    assert by_itself.translate(lines) == mtkit.load(
        base_run, device="cpu", precision="fp32", beam=2, adapter=run
    ).translate(lines)
    unmerged = loading.load_for_inference(run, torch.device("cpu"))
    assert lora.adapted_layers(unmerged.model) and unmerged.adapter.settings.rank == 4
    one_line_error(invoke("translate", run, "--adapter", run, "-i", corpus_files["val.en"]), "a LoRA run's adapter")

    moved = tmp_path / "moved" / "best"
    shutil.copytree(run / "best", moved)
    for name in ("spm.model", "spm.vocab"):
        shutil.copy(run / name, moved.parent / name)
    with_header(run / "best" / checkpoint.WEIGHTS_FILE, moved / checkpoint.WEIGHTS_FILE,
                lambda meta: meta["init"].update(path=str(tmp_path / "gone" / "model.safetensors")))  # fmt: skip
    line = one_line_error(invoke("translate", moved.parent, "-i", corpus_files["val.en"]), "not there any more")
    assert f"mtkit translate BASE --adapter {moved}" in line


def test_an_output_onto_the_base_a_lora_run_reads_is_refused(tmp_path, corpus_files, spm_model, base_run):
    """The base is a file of a plain folder, which nothing else guards: the run's commands know they read it."""
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(checkpoint.weights_file(base_run / "best"), plain / checkpoint.WEIGHTS_FILE)
    shutil.copy(base_run / "spm.model", plain / "spm.model")
    run = tmp_path / "lora"
    Trainer(lora_config(corpus_files, spm_model, plain, max_steps=2), run).run()
    base = plain / checkpoint.WEIGHTS_FILE
    before = base.read_bytes()
    one_line_error(invoke("translate", run, "-i", corpus_files["val.en"], "-o", base), f"{base}: ")
    assert base.read_bytes() == before


def test_a_resumed_lora_run_equals_an_uninterrupted_one(tmp_path, corpus_files, spm_model, base_run, monkeypatch):
    """Stopped by SIGTERM in update 3 of 6, then resumed: the base read again, the adapters and the metrics those of
    the run that was never stopped."""
    cfg = lora_config(corpus_files, spm_model, base_run, max_steps=6)
    straight = Trainer(cfg, tmp_path / "a")
    straight.run()
    stopped = Trainer(cfg, tmp_path / "b")
    step = stopped.train_step

    def stop_in_update_3(*args):
        if stopped.progress.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args)

    monkeypatch.setattr(stopped, "train_step", stop_in_update_3)
    with pytest.raises(TrainingStopped):
        stopped.run()
    resumed = Trainer(cfg, tmp_path / "b")
    assert resumed.progress.step == 3
    resumed.run()
    want, got = lora.adapter_weights(straight.model), lora.adapter_weights(resumed.model)
    assert want.keys() == got.keys() and all(torch.equal(want[name], got[name]) for name in want)
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


def losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r.get("event") == "train"]


def test_resuming_with_other_adapters_or_on_a_changed_base_is_refused(tmp_path, corpus_files, spm_model, base_run):
    source = tmp_path / "base"
    shutil.copytree(base_run / "best", source)
    for name in ("spm.model", "spm.vocab"):
        shutil.copy(base_run / name, tmp_path / name)
    cfg = lora_config(corpus_files, spm_model, source, max_steps=2)
    Trainer(cfg, tmp_path / "run").run()
    longer = replace(cfg, train=replace(cfg.train, max_steps=4))
    with pytest.raises(checkpoint.CheckpointError, match="trained with train.lora rank 4, alpha 8 on"):
        Trainer(replace(longer, train=replace(longer.train, lora=LoraConfig(rank=2))), tmp_path / "run")
    weights = checkpoint.read_checkpoint(source, with_state=False)
    changed = dict(weights.weights)
    changed["encoder.layers.0.ffn.up.bias"] = changed["encoder.layers.0.ffn.up.bias"] + 1.0
    checkpoint.save(source, changed, weights.meta)
    with pytest.raises(checkpoint.CheckpointError, match="adapts another base model than"):
        Trainer(longer, tmp_path / "run")


def test_lora_settings_are_checked_before_training(tmp_path, corpus_files, spm_model, base_run):
    with pytest.raises(ConfigError, match="train.lora needs train.init_from"):
        from_dict({"train": {"lora": {"rank": 4}}})
    with pytest.raises(ConfigError, match="leave train.freeze out"):
        from_dict({"train": {"init_from": "x", "freeze": ["encoder"], "lora": {"rank": 4}}})
    with pytest.raises(ConfigError, match="train.lora.dropout must be in"):
        LoraConfig(rank=4, dropout=1.0)
    cfg = read_config(None, ["train.init_from=runs/base", "train.lora.rank=8", "train.lora.targets=[self_q, ffn]"])
    assert cfg.train.lora == LoraConfig(rank=8, targets=("self_q", "ffn"))
    with pytest.raises(ConfigError, match="rank 33 is more than encoder.layers.0.self_attn.q_proj can take"):
        Trainer(lora_config(corpus_files, spm_model, base_run, {"rank": 33}), tmp_path / "wide")


def test_averaging_lora_checkpoints_averages_the_models_they_make(lora_run):
    paths = run_folder.run_checkpoints(lora_run.run_dir.path)
    weights, meta = average_checkpoints(paths)
    merged = [loading.load_for_inference(path, torch.device("cpu"), merge=True).model.state_dict() for path in paths]
    for name, value in weights.items():
        torch.testing.assert_close(value, (merged[0][name] + merged[1][name]) / 2)
    assert from_dict(meta["config"]).train.lora.rank == 0  # a model of its own weights


def test_a_run_started_from_a_lora_run_starts_from_the_model_it_makes(lora_run, tmp_path, corpus_files, spm_model):
    run = lora_run.run_dir.path
    full = Trainer(lora_config(corpus_files, spm_model, run, None), tmp_path / "full")
    expected = loading.load_for_inference(run, torch.device("cpu"), merge=True).model.state_dict()
    got = full.model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[name], expected[name]) for name in got)
    with pytest.raises(ConfigError, match="is a LoRA run's"):
        Trainer(lora_config(corpus_files, spm_model, run), tmp_path / "again")
