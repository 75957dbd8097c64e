"""Shared fixtures: tiny models, slices of the real Multi30k corpus, a small SentencePiece model."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
import torch

from mtkit import progress
from mtkit.config import ModelConfig, TokenizerConfig
from mtkit.model import Transformer, build_model
from mtkit.tokenizer import PAD_ID, Tokenizer, train_spm

# The shared corpora: ../shared/data beside the repository, or MTKIT_TEST_DATA (a GPU machine has no ../shared).
DATA = Path(os.environ.get("MTKIT_TEST_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
MULTI30K = DATA / "multi30k"


def read_gz(path: Path, n: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines[:n] if n is not None else lines


def tiny_model_config(**overrides) -> ModelConfig:
    values = dict(encoder_layers=2, decoder_layers=2, d_model=32, heads=4, ffn=64, dropout=0.0, max_positions=128)
    values.update(overrides)
    return ModelConfig(**values)


def train_on_task(model: Transformer, pairs, steps: int, peak_lr: float, warmup: int) -> Transformer:
    """Plain training of a tiny model on a toy task: ``pairs()`` gives each step's (sources, targets)."""
    from mtkit.data import collate
    from mtkit.loss import linear_cross_entropy
    from mtkit.tokenizer import PAD_ID
    from mtkit.trainer import lr_at

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.9, 0.98), eps=1e-9)
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, peak_lr, warmup)
        batch = collate(*pairs())
        features = model.features(batch.src, batch.src_pad_mask, batch.tgt_in)
        keep = batch.tgt_out != PAD_ID
        loss, _ = linear_cross_entropy(features[keep], model.output.weight, batch.tgt_out[keep], 0.0)
        (loss / keep.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


def tiny_model(vocab: int = 40, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return build_model(tiny_model_config(**overrides), vocab, vocab, PAD_ID).eval()


@pytest.fixture
def terminal(monkeypatch) -> None:
    """stderr taken for a terminal (Rich reads TTY_COMPATIBLE), every bar kept on it when its stage ends."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setattr(progress, "KEEP_AFTER_S", 0.0)


@pytest.fixture
def hf_offline(tmp_path, monkeypatch) -> None:
    """No request of ``datasets`` or the Hub client leaves the machine, and the Arrow cache is this test's."""
    import datasets
    import huggingface_hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")


@pytest.fixture(scope="session", autouse=True)
def encoding_cache(tmp_path_factory) -> Path:
    """Encoded training data and the corpora `mtkit run` prepares go to folders of this session, never to the
    user's ~/.cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("encoded")
    os.environ["MTKIT_CACHE_DIR"] = str(path)
    os.environ["MTKIT_DATA_DIR"] = str(tmp_path_factory.mktemp("prepared"))
    return path


@pytest.fixture(scope="session")
def multi30k_slice(tmp_path_factory) -> dict[str, Path]:
    """Train (400 pairs) and valid (40 pairs) en-de text files cut from the real corpus."""
    if not MULTI30K.is_dir():
        pytest.skip(f"{MULTI30K} not found (the shared data folder sits beside the repository)")
    out = tmp_path_factory.mktemp("multi30k")
    paths = {}
    for split, n in (("train", 400), ("val", 40)):
        for lang in ("en", "de"):
            path = out / f"{split}.{lang}"
            path.write_text("\n".join(read_gz(MULTI30K / f"{split}.{lang}.gz", n)) + "\n", encoding="utf-8")
            paths[f"{split}.{lang}"] = path
    return paths


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory, multi30k_slice) -> Tokenizer:
    """A joint 300-piece unigram model over the training slice."""
    lines = multi30k_slice["train.en"].read_text().splitlines() + multi30k_slice["train.de"].read_text().splitlines()
    path = train_spm(lines, tmp_path_factory.mktemp("spm") / "spm", TokenizerConfig(vocab_size=300))
    return Tokenizer(path)
