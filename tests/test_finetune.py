"""Fine-tuning: a run started from a trained model (train.init_from), its schedules and frozen parts, and the
refusal to resume on changed data."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
import yaml
from helpers import invoke, one_line_error, small_config, tiny_model, with_header

from mtkit.config import ConfigError, TokenizerConfig, TrainConfig, config_yaml, from_dict
from mtkit.data.parallel import collate
from mtkit.data.tokenizer import PAD_ID, train_spm
from mtkit.files import file_sha256
from mtkit.interop.marian import NOT_A_TOKEN
from mtkit.model import checkpoint, loading, run_folder
from mtkit.training import init_from
from mtkit.training.averaging import write_average
from mtkit.training.freezing import freeze, parts
from mtkit.training.schedule import lr_at, schedule_preview
from mtkit.training.stop_signals import TrainingStopped
from mtkit.training.trainer import Trainer


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus_files, spm_model) -> Path:
    """A tiny run of 4 updates (checkpoints at 2 and 4, best/ at 4), its architecture far from the defaults."""
    run = tmp_path_factory.mktemp("base") / "run"
    Trainer(small_config(corpus_files, spm_model, max_steps=4), run).run()
    return run


def finetune_config(corpus_files, spm_model, init_from, model=None, tokenizer=None, **train):
    """small_config's data and training settings, with no model or tokenizer section: those come from ``init_from``."""
    raw = small_config(corpus_files, spm_model).to_dict()
    raw["model"], raw["tokenizer"] = model or {}, tokenizer or {}
    raw["train"].update({"init_from": str(init_from), "schedule": "linear", "warmup": 2, "max_steps": 4, **train})
    return from_dict(raw)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.read_checkpoint(path, with_state=False).weights


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


# -- starting from a model ------------------------------------------------------------------------------------


def test_a_run_starts_from_the_weights_architecture_and_tokenizer_of_a_run(tmp_path, corpus_files, spm_model, base_run):
    cfg = finetune_config(corpus_files, spm_model, base_run, model={"dropout": 0.3})
    trainer = Trainer(cfg, tmp_path / "ft")
    base = checkpoint.read_checkpoint(base_run / "best", with_state=False)
    assert trainer.cfg.model == replace(base.cfg.model, dropout=0.3)  # a training setting the run may change
    assert trainer.cfg.tokenizer.model == str((base_run / "spm.model").resolve())
    assert file_sha256(tmp_path / "ft" / "spm.model") == spm_model.sha256
    assert_same(trainer.model.state_dict(), base.weights)
    assert trainer.progress.step == 0 and not trainer.optimizer.state
    trainer.run()

    record = {
        "path": str((base_run / "best" / "model.safetensors").resolve()),
        "sha256": file_sha256(base.path / "model.safetensors"),
    }
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path / "ft")).meta["init"] == record
    assert yaml.safe_load((tmp_path / "ft" / "config.yaml").read_text())["train"]["init_from"] == str(base_run)
    start = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["init"] == record


def test_a_checkpoint_folder_or_an_averaged_file_can_be_started_from(tmp_path, corpus_files, spm_model, base_run):
    first = run_folder.run_checkpoints(base_run)[0]
    averaged = tmp_path / "avg" / "model.safetensors"
    write_average(run_folder.run_checkpoints(base_run), averaged)
    for source in (first, averaged):
        trainer = Trainer(finetune_config(corpus_files, spm_model, source), tmp_path / source.name)
        assert_same(trainer.model.state_dict(), weights(source))
        trainer.cleanup()


def test_separate_tokenizers_of_a_tied_model_come_with_it(tmp_path, corpus_files, spm_model):
    """Tied embeddings over two SentencePiece models of one size: tokenizer.joint is false, whatever the tying."""
    models = {
        side: train_spm(
            corpus_files[f"train.{lang}"].read_text().splitlines(), tmp_path / lang, TokenizerConfig(vocab_size=150)
        )
        for side, lang in (("src", "en"), ("tgt", "de"))
    }
    raw = small_config(corpus_files, spm_model, max_steps=2).to_dict()
    raw["tokenizer"] = {"joint": False, "src_model": str(models["src"]), "tgt_model": str(models["tgt"])}
    Trainer(from_dict(raw), tmp_path / "base").run()
    trainer = Trainer(finetune_config(corpus_files, spm_model, tmp_path / "base"), tmp_path / "ft")
    assert not trainer.cfg.tokenizer.joint and trainer.cfg.model.tie_embeddings
    for side in ("src", "tgt"):
        assert file_sha256(tmp_path / "ft" / f"spm.{side}.model") == file_sha256(models[side])
    assert_same(trainer.model.state_dict(), weights(tmp_path / "base" / "best"))
    trainer.cleanup()
    joint = finetune_config(corpus_files, spm_model, tmp_path / "base", tokenizer={"model": str(spm_model.path)})
    with pytest.raises(ConfigError, match="^tokenizer.model is set, but .* has a source and a target tokenizer"):
        Trainer(joint, tmp_path / "joint")


def test_an_export_folder_is_refused_in_one_line(tmp_path, corpus_files):
    export = tmp_path / "ct2"  # as `mtkit export` lays one out
    export.mkdir()
    (export / "mtkit.json").write_text("{}")
    (export / "model.bin").write_bytes(b"")
    config = tmp_path / "c.yaml"
    data = {"train_src": str(corpus_files["train.en"]), "train_tgt": str(corpus_files["train.de"])}
    config.write_text(yaml.safe_dump({"data": data, "train": {"device": "cpu"}}))
    result = invoke("train", config, "--out", tmp_path / "run", "--set", f"train.init_from={export}")
    one_line_error(result, f"{export}: an export", "CTranslate2", "train.init_from")


def test_an_architecture_the_config_sets_otherwise_is_refused_naming_the_key(
    tmp_path, corpus_files, spm_model, base_run
):
    cfg = finetune_config(corpus_files, spm_model, base_run, model={"d_model": 64, "heads": 2})
    with pytest.raises(
        ConfigError, match=r"^model.d_model is 64 in this config but 32 in .*base.*run \(train.init_from\)"
    ):
        Trainer(cfg, tmp_path / "ft")


def test_a_vocabulary_that_cannot_match_is_refused(tmp_path, corpus_files, spm_model, base_run):
    lines = corpus_files["train.en"].read_text().splitlines()[:200]
    other = train_spm(lines, tmp_path / "other", TokenizerConfig(vocab_size=100))
    refused = [
        ({"model": str(other)}, f"tokenizer.model {other} is another vocabulary than"),
        ({"joint": False}, "tokenizer.joint is False in this config but True in"),
        ({"vocab_size": 250}, f"tokenizer.vocab_size is 250 in this config but {spm_model.vocab_size} in"),
    ]
    for n, (tokenizer, message) in enumerate(refused):
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            Trainer(finetune_config(corpus_files, spm_model, base_run, tokenizer=tokenizer), tmp_path / str(n))
    Trainer(
        finetune_config(corpus_files, spm_model, base_run, tokenizer={"model": str(spm_model.path)}), tmp_path / "same"
    ).cleanup()


def with_a_large_output_bias(base_run: Path, folder: Path, vocab: int) -> Path:
    """base_run's best model given a large output bias whose pad entry is NOT_A_TOKEN, as an imported Marian model's
    is, in ``folder`` beside its tokenizer."""
    folder.mkdir()
    with safetensors.safe_open(base_run / "best" / "model.safetensors", framework="pt") as f:
        header = dict(f.metadata())
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    meta = json.loads(header["mtkit"])
    meta["config"]["model"]["output_bias"] = True
    header["mtkit"] = json.dumps(meta)
    tensors["output.bias"] = 3.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    tensors["output.bias"][PAD_ID] = NOT_A_TOKEN
    (folder / "model.safetensors").write_bytes(safetensors.torch.save(tensors, metadata=header))
    shutil.copy(base_run / "spm.model", folder / "spm.model")
    return folder / "model.safetensors"


def decoded_nll(model: Path, corpus_files) -> float:
    """The validation NLL per token of ``model`` as it decodes: the logits of Transformer.decode."""
    bundle = loading.load_for_inference(model, torch.device("cpu"))
    src = bundle.src_tok.encode(corpus_files["val.en"].read_text().splitlines())
    batch = collate(src, bundle.tgt_tok.encode(corpus_files["val.de"].read_text().splitlines()))
    with torch.no_grad():
        memory = bundle.model.encode(batch.src, batch.src_pad_mask)
        logits = bundle.model.decode(batch.tgt_in, memory, batch.src_pad_mask)
    keep = batch.tgt_out != PAD_ID
    return float(F.cross_entropy(logits[keep], batch.tgt_out[keep]))


def test_a_finetune_trains_the_output_bias_and_lowers_the_decoded_models_loss(
    tmp_path, corpus_files, spm_model, base_run
):
    """The loss a run optimizes and reports is that of the model as it decodes, the output bias included."""
    start = with_a_large_output_bias(base_run, tmp_path / "start", spm_model.vocab_size)
    cfg = finetune_config(corpus_files, spm_model, start, schedule="constant", warmup=1, max_steps=10, lr=3e-3)
    trainer = Trainer(cfg, tmp_path / "ft")
    trainer.run()
    before, after = decoded_nll(start, corpus_files), decoded_nll(run_folder.latest(tmp_path / "ft"), corpus_files)
    assert after < before - 2.0  # about 10 -> 7; only to 8.4-8.8 when the loss leaves the bias out
    assert not torch.equal(trainer.model.output.bias, weights(start)["output.bias"])
    records = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["event"] == "valid"]
    assert valid[-1]["step"] == 10 and valid[-1]["valid_nll"] == pytest.approx(after, rel=1e-5)


# -- schedules and freezing -----------------------------------------------------------------------------------


def test_constant_and_linear_schedules_warm_up_then_hold_or_fall_to_zero():
    constant = TrainConfig(lr=1e-3, warmup=10, schedule="constant", max_steps=100)
    linear = replace(constant, schedule="linear")
    for tc in (constant, linear):
        assert lr_at(5, tc) == pytest.approx(5e-4) and lr_at(10, tc) == pytest.approx(1e-3)
    assert lr_at(100, constant) == 1e-3
    assert [lr_at(s, linear) for s in (55, 100, 120)] == [pytest.approx(5e-4), 0.0, 0.0]
    assert lr_at(1, replace(linear, warmup=0)) == pytest.approx(1e-3 * 99 / 100)
    preview = dict(schedule_preview(from_dict({"train": {"warmup": 10, "max_steps": 100, "schedule": "linear"}})))
    expected = {1: 1e-4, 5: 5e-4, 10: 1e-3, 20: 1e-3 * 80 / 90, 55: 5e-4, 100: 0.0}  # 55: halfway down
    assert preview == pytest.approx(expected)


def test_dry_run_shows_the_schedule_and_where_the_model_comes_from(tmp_path, corpus_files):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"train_src": str(corpus_files["train.en"])}}))
    overrides = ["train.init_from=runs/base", "train.schedule=linear", "train.warmup=2", "train.max_steps=4"]
    result = invoke("train", config, "--dry-run", *(a for o in overrides for a in ("--set", o)))
    assert result.exit_code == 0, result.output
    assert "# model and tokenizer: those of runs/base (train.init_from)" in result.stdout
    assert "# learning rate: update 1: 0.0005, update 2: 0.001, update 3: 0.0005, update 4: 0" in result.stdout


@pytest.mark.parametrize("tie", [True, False])
def test_the_parts_hold_every_parameter_once_and_tied_outputs_are_embeddings(tie):
    model = tiny_model(tie_embeddings=tie)
    found = parts(model)
    ids = [id(p) for group in found.values() for p in group]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert any(p is model.output.weight for p in found["embeddings" if tie else "decoder"])
    trainable = freeze(model, ["embeddings"])
    assert model.output.weight.requires_grad is not tie
    assert [id(p) for p in trainable] == [id(p) for p in model.parameters() if p.requires_grad]


def test_frozen_parts_keep_their_values_and_the_rest_trains(tmp_path, corpus_files, spm_model, base_run):
    cfg = finetune_config(corpus_files, spm_model, base_run, freeze=["embeddings", "encoder"], lr=1e-2)
    trainer = Trainer(cfg, tmp_path / "ft")
    trainer.run()
    before, after = weights(base_run / "best"), trainer.model.state_dict()
    for name, value in after.items():
        held = name.startswith(("encoder.", "decoder.embed.", "output.weight"))
        assert torch.equal(value, before[name]) == held, name
    assert sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"]) < sum(
        p.numel() for p in trainer.model.parameters()
    )
    with pytest.raises(checkpoint.CheckpointError, match="trained with train.freeze"):
        Trainer(replace(cfg, train=replace(cfg.train, freeze=("encoder",), max_steps=6)), tmp_path / "ft")


# -- resuming -------------------------------------------------------------------------------------------------


def test_a_resumed_finetune_equals_an_uninterrupted_one_without_reading_its_model_again(
    tmp_path, corpus_files, spm_model, base_run, monkeypatch
):
    """Stopped by SIGTERM after update 3 of 6 (a linear schedule depends on train.max_steps, which must not change)."""
    source = tmp_path / "source"
    shutil.copytree(base_run, source)
    cfg = finetune_config(corpus_files, spm_model, source, max_steps=6)
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
    shutil.rmtree(source)  # read when the run started, never again
    resumed = Trainer(cfg, tmp_path / "b")
    assert resumed.progress.step == 3
    resumed.run()
    assert_same(straight.model.state_dict(), resumed.model.state_dict())
    assert checkpoint.read_checkpoint(run_folder.latest(tmp_path / "b")).meta["init"]["path"].startswith(str(source))


def test_patience_stops_a_finetune(tmp_path, corpus_files, spm_model, base_run, monkeypatch):
    cfg = finetune_config(corpus_files, spm_model, base_run, max_steps=100, valid_every=1, patience=2)
    trainer = Trainer(cfg, tmp_path / "ft")
    monkeypatch.setattr(trainer, "validate", lambda: {"valid_loss": 2.0, "valid_nll": 2.0, "valid_ppl": 7.4})
    trainer.run()
    assert trainer.progress.step == 3 and trainer.stop_condition()[0] == "patience"


def test_resuming_on_changed_data_is_refused_naming_the_file_and_what_to_do(tmp_path, corpus_files, spm_model):
    train = {side: tmp_path / f"train.{side}" for side in ("en", "de")}
    for side, path in train.items():
        shutil.copy(corpus_files[f"train.{side}"], path)
    files = dict(corpus_files, **{"train.en": train["en"], "train.de": train["de"]})
    Trainer(small_config(files, spm_model, max_steps=2), tmp_path / "run").run()
    lines = train["de"].read_text().splitlines()
    train["de"].write_text("\n".join([lines[1], *lines[1:]]) + "\n")
    message = (
        f"update-00000002: trained on another data.train_tgt than {train['de']}; to go on with the data as it is, "
        f"start a new run from this one's weights (--set train.init_from={tmp_path / 'run'} and another --out) "
        "or start over (--restart)"
    )
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(message)):
        Trainer(small_config(files, spm_model, max_steps=4), tmp_path / "run")


def test_a_checkpoint_without_data_digests_still_resumes(tmp_path, corpus_files, spm_model):
    Trainer(small_config(corpus_files, spm_model, max_steps=2), tmp_path).run()
    latest = run_folder.latest(tmp_path) / "model.safetensors"
    with_header(latest, latest, lambda meta: meta.pop("data_sha256"))
    assert Trainer(small_config(corpus_files, spm_model, max_steps=4), tmp_path).progress.step == 2


# -- where a run starts from, when it is run again ------------------------------------------------------------


def test_a_run_resumed_with_another_init_from_is_refused_in_one_line(tmp_path, corpus_files, spm_model, base_run):
    """The run's config.yaml keeps naming the model it started from."""
    Trainer(finetune_config(corpus_files, spm_model, base_run, max_steps=2), tmp_path / "ft").run()
    config = tmp_path / "ft.yaml"
    config.write_text(config_yaml(finetune_config(corpus_files, spm_model, base_run, max_steps=4)))
    other = run_folder.run_checkpoints(base_run)[0]
    result = invoke("train", config, "--out", tmp_path / "ft", "--set", f"train.init_from={other}")
    one_line_error(
        result,
        f"this run started from train.init_from '{base_run}', this config from train.init_from '{other}'; "
        "to start from that, use another --out or start over (--restart)",
    )
    assert yaml.safe_load((tmp_path / "ft" / "config.yaml").read_text())["train"]["init_from"] == str(base_run)
    Trainer(finetune_config(corpus_files, spm_model, f"{base_run}/./", max_steps=3), tmp_path / "ft").run()  # the same
    Trainer(small_config(corpus_files, spm_model, max_steps=1), tmp_path / "plain").run()
    with pytest.raises(checkpoint.CheckpointError, match="this run started from random weights .no train.init_from."):
        Trainer(finetune_config(corpus_files, spm_model, base_run), tmp_path / "plain")


def test_an_hf_init_from_is_imported_anew_until_the_first_checkpoint_and_restart_removes_it(
    tmp_path, corpus_files, spm_model, base_run, monkeypatch
):
    """Two Marian models stand in for each other: an import is the mtkit model the name stands for, copied."""
    models = {"first": base_run / "best", "second": run_folder.run_checkpoints(base_run)[0]}

    def import_hf(source: str, target: Path, **_languages) -> Path:
        shutil.copytree(models[source], target)
        shutil.copy(base_run / "spm.model", target / "spm.model")
        return target

    monkeypatch.setattr(init_from, "import_hf", import_hf)
    run = tmp_path / "ft"

    def started_from(name: str, **options) -> Trainer:
        trainer = Trainer(finetune_config(corpus_files, spm_model, f"hf:{name}", max_steps=2), run, **options)
        assert_same(trainer.model.state_dict(), weights(models[name]))
        assert_same(weights(run / "imported"), weights(models[name]))
        return trainer

    started_from("first").cleanup()  # stopped before its first checkpoint
    started_from("second").run()  # not the first one's import
    started_from("first", restart=True).run()
    Trainer(finetune_config(corpus_files, spm_model, base_run), run, restart=True).cleanup()
    assert not (run / "imported").exists()  # --restart leaves no import behind
