"""Plain helpers the test modules share: tiny models and hand-built run directories, configs, the command line.

Fixtures live in conftest.py; a test module imports from here, never from another test module.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import yaml
from typer.testing import CliRunner

from mtkit.cli import app
from mtkit.config import ModelConfig, RunConfig, TrainConfig, from_dict
from mtkit.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from mtkit.model.quantization import quantize_int8
from mtkit.model.transformer import Transformer, build_model
from mtkit.training import run_directory

runner = CliRunner()

# -- tiny models ----------------------------------------------------------------------------------------------


def tiny_model_config(**overrides) -> ModelConfig:
    values = {
        "encoder_layers": 2,
        "decoder_layers": 2,
        "d_model": 32,
        "heads": 4,
        "ffn": 64,
        "dropout": 0.0,
        "max_positions": 128,
    }
    values.update(overrides)
    return ModelConfig(**values)


def tiny_model(vocab: int = 40, seed: int = 0, int8: bool = False, **overrides) -> Transformer:
    """A tiny random model; ``int8``: its linear layers quantized as ``--precision int8`` quantizes them."""
    torch.manual_seed(seed)
    model = build_model(tiny_model_config(**overrides), vocab, vocab, PAD_ID).eval()
    return quantize_int8(model) if int8 else model


def train_on_task(model: Transformer, pairs, steps: int, peak_lr: float, warmup: int) -> Transformer:
    """Plain training of a tiny model on a toy task: ``pairs()`` gives each step's (sources, targets)."""
    from mtkit.data.parallel import collate
    from mtkit.model.loss import linear_cross_entropy
    from mtkit.training.schedule import lr_at

    schedule = TrainConfig(lr=peak_lr, warmup=warmup)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.9, 0.98), eps=1e-9)
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        batch = collate(*pairs())
        features = model.features(batch.src, batch.src_pad_mask, batch.tgt_in)
        keep = batch.tgt_out != PAD_ID
        loss, _ = linear_cross_entropy(features[keep], model.output.weight, batch.tgt_out[keep], 0.0)
        (loss / keep.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


def random_sources(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


# -- configs --------------------------------------------------------------------------------------------------

TINY_MODEL = {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "heads": 2, "ffn": 64}
# 20 updates of a tiny model on the CPU in fp32 (neither auto), so that what the tests see is the same on every
# machine, a GPU's too
TINY_TRAIN = {
    "max_steps": 20,
    "batch_tokens": 1024,
    "warmup": 5,
    "lr": 3e-3,
    "valid_every": 10,
    "save_every": 10,
    "log_every": 5,
    "valid_beam": 2,
    "precision": "fp32",
    "device": "cpu",
}


def write_config(path, corpus_files, **sections):
    """A config training a tiny model on ``corpus_files``, on the CPU in fp32 (``TINY_TRAIN``); ``sections`` update
    it."""
    raw = {
        "data": {
            "train_src": str(corpus_files["train.en"]),
            "train_tgt": str(corpus_files["train.de"]),
            "valid_src": str(corpus_files["val.en"]),
            "valid_tgt": str(corpus_files["val.de"]),
            "src_lang": "en",
            "tgt_lang": "de",
        },
        "tokenizer": {"vocab_size": 300},
        "model": dict(TINY_MODEL),
        "train": dict(TINY_TRAIN),
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw))
    return path


def train_direction(root: Path, corpus_files: dict[str, Path], src: str, tgt: str, training: dict) -> Path:
    """A tiny model of ``src``->``tgt`` (en, de) on the caption corpus, trained with ``training`` into
    ``root/SRC-TGT``."""
    files = {f"{split}.{side}": corpus_files[f"{split}.{lang}"] for split in ("train", "val")
             for side, lang in (("en", src), ("de", tgt))}  # fmt: skip
    config = write_config(root / f"{src}-{tgt}.yaml", files, data={"src_lang": src, "tgt_lang": tgt}, train=training)
    result = invoke("train", config, "--out", root / f"{src}-{tgt}")
    assert result.exit_code == 0, result.output
    return root / f"{src}-{tgt}"


def multilingual_raw(files: dict[str, Path], targets=("de", "fr"), **sections) -> dict:
    """A config (as a dict) training a tiny model for en->TARGET on ``files`` ("train.en", "val.fr", ...), one
    corpus per target, on the CPU in fp32; ``sections`` update it."""
    corpora = [
        {
            "src_lang": "en",
            "tgt_lang": lang,
            "train_src": str(files["train.en"]),
            "train_tgt": str(files[f"train.{lang}"]),
            "valid_src": str(files["val.en"]),
            "valid_tgt": str(files[f"val.{lang}"]),
        }
        for lang in targets
    ]
    raw = {
        "data": {"corpora": corpora},
        "tokenizer": {"vocab_size": 400},
        "model": dict(TINY_MODEL),
        "train": dict(TINY_TRAIN),
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def small_config(corpus_files, spm_model, **train):
    """A tiny model on ``corpus_files``, on the CPU in fp32 (neither auto) so that what the tests see is the same on
    every machine."""
    return from_dict(
        {
            "data": {
                "train_src": str(corpus_files["train.en"]),
                "train_tgt": str(corpus_files["train.de"]),
                "valid_src": str(corpus_files["val.en"]),
                "valid_tgt": str(corpus_files["val.de"]),
            },
            "tokenizer": {"model": str(spm_model.path)},
            "model": {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "heads": 2, "ffn": 64, "dropout": 0.1},
            "train": {
                "batch_tokens": 512,
                "warmup": 4,
                "lr": 1e-3,
                "valid_every": 0,
                "save_every": 2,
                "valid_bleu": False,
                "best_metric": "loss",
                "log_every": 1,
                "precision": "fp32",
                "device": "cpu",
                **train,
            },
            "decode": {"beam": 2},
        }
    )


# -- hand-built run directories and checkpoints ---------------------------------------------------------------


def meta_for(model_overrides: dict | None = None, step: int = 1, sha: str = "0" * 64) -> dict:
    cfg = RunConfig(model=tiny_model_config(**(model_overrides or {})))
    record = {"file": "spm.model", "sha256": sha}
    return {"config": cfg.to_dict(), "tokenizer": {"src": record, "tgt": dict(record)}, "step": step}


def run_dir_with(root, spm_model, model_section: dict, steps: tuple[int, ...], with_state: bool) -> Path:
    """A hand-built run directory: the real tokenizer and one checkpoint of a tiny model per step."""
    run = root / "run"
    run.mkdir()
    shutil.copyfile(spm_model.path, run / "spm.model")
    meta = meta_for(model_section, sha=spm_model.sha256)
    for step in steps:
        weights = tiny_model(spm_model.vocab_size, seed=step, **model_section).state_dict()
        state = {"progress": {"step": step}} if with_state else None
        run_directory.save_in_run(run, step, weights, meta, state, keep_last=0)
    return run


HAND_BUILT_MODEL = {
    "encoder_layers": 2,
    "decoder_layers": 2,
    "d_model": 64,
    "heads": 4,
    "ffn": 128,
    "dropout": 0.0,
    "max_positions": 128,
}


def randomise_norms_(model: Transformer, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)


def save_run(run: Path, cfg: RunConfig, model: Transformer, toks: dict[str, Tokenizer]) -> Path:
    """A run directory holding ``model`` as its one checkpoint, beside its tokenizer file(s)."""
    run.mkdir(parents=True)
    for tok in toks.values():
        shutil.copy(tok.path, run / tok.path.name)
    records = {side: {"file": tok.path.name, "sha256": tok.sha256} for side, tok in toks.items()}
    meta = {"config": cfg.to_dict(), "tokenizer": records}
    run_directory.save_in_run(run, 1, model.state_dict(), meta, None, keep_last=0)
    return run


def joint_run(root: Path, spm_model: Tokenizer, seed: int, ending: bool = False, **model) -> Path:
    """Post-norm, tied embeddings, one joint vocabulary, ``HAND_BUILT_MODEL`` with ``model``'s overrides; ``ending``
    makes hypotheses end with eos at varied lengths rather than all at the cap."""
    cfg = RunConfig(model=ModelConfig(**{**HAND_BUILT_MODEL, **model}))
    torch.manual_seed(seed)
    built = build_model(cfg.model, spm_model.vocab_size, spm_model.vocab_size, PAD_ID)
    randomise_norms_(built, seed=seed + 1)
    if ending:
        with torch.no_grad():
            built.output.weight[EOS_ID] *= 3.0
    return save_run(root / "run", cfg, built, {"src": spm_model, "tgt": spm_model})


def joint_post_norm_run(root: Path, spm_model: Tokenizer) -> Path:
    """Post-norm, sinusoidal positions, tied embeddings, one joint vocabulary: mtkit's defaults."""
    return joint_run(root, spm_model, seed=1)


def with_header(source, target, edit) -> None:
    """Copy the safetensors checkpoint ``source`` to ``target`` with ``edit(meta)`` applied to its mtkit header."""
    with safetensors.safe_open(source, framework="pt") as f:
        header = dict(f.metadata())
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    meta = json.loads(header["mtkit"])
    edit(meta)
    header["mtkit"] = json.dumps(meta)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(safetensors.torch.save(tensors, metadata=header))


# -- the command line -----------------------------------------------------------------------------------------


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def one_line_error(result, *fragments: str) -> str:
    """Exit status 1 and one error line, returned; only progress log lines (a corpus being streamed) may come first."""
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d INFO ", line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output
    return lines[0]


# -- chains of `mtkit run` stages (back-translation, distillation) ----------------------------------------------

KILL_RUNNER = Path(__file__).with_name("kill_runner.py")  # mtkit with a fault plan; see its docstring
# 8 updates of a tiny model on the CPU, each stage of a chain saving and validating often enough to be killed and
# resumed
CHAIN_TRAIN = {"max_steps": 8, "batch_tokens": 1024, "warmup": 2, "lr": 3e-3, "valid_every": 4, "save_every": 2,
               "log_every": 2, "valid_beam": 1, "precision": "fp32", "device": "cpu", "threads": 1}  # fmt: skip


def refused_as_trained_on_other_data(result, checkpoints: Path, stage: str) -> None:
    """``mtkit run`` ended in one error line: the checkpoints of ``stage`` were trained on other data, and
    ``--restart STAGE`` is the way to train it again."""
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {checkpoints}") and "trained on another data." in line
    assert line.endswith(f"; to train it again from the start, run `mtkit run` with --restart {stage}")


def run_recipe_with_plan(recipe: Path, out: Path, plan: dict | None = None) -> subprocess.CompletedProcess:
    """``mtkit run RECIPE --out OUT`` in a subprocess that carries out the kill ``plan`` (kill_runner.py)."""
    command = [sys.executable, str(KILL_RUNNER), json.dumps(plan or {}), "run", str(recipe), "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def finished_run(recipe: Path, out: Path) -> Path:
    """``out`` after ``mtkit run RECIPE --out OUT`` has run to the end, uninterrupted."""
    done = run_recipe_with_plan(recipe, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# mtkit's command line, sending itself SIGTERM as soon as the first part of a resumable translation is written
_SIGTERM_AFTER_THE_FIRST_PART = """
import os, signal, sys
from mtkit import cli
from mtkit.translation import resumable

write = resumable.atomic_write

def write_then_stop(path, *args, **kwargs):
    write(path, *args, **kwargs)
    if path.name.endswith(".txt"):
        os.kill(os.getpid(), signal.SIGTERM)

resumable.atomic_write = write_then_stop
sys.argv = ["mtkit", *sys.argv[1:]]
cli.main()
"""


def run_recipe_sigterm_after_first_part(recipe: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """``mtkit run RECIPE --out OUT [OPTIONS]`` in a subprocess that gets SIGTERM once a chain's translation wrote a
    part."""
    command = [sys.executable, "-c", _SIGTERM_AFTER_THE_FIRST_PART, "run", str(recipe), "--out", str(out), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)
