"""Shared fixtures: tiny models, a caption corpus written by tests/captions.py, a small SentencePiece model.

No test reads data from outside the repository: corpora are generated (captions.py), tasks are synthetic.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import captions
import pytest
import torch

from mtkit import progress
from mtkit.config import ModelConfig, TokenizerConfig
from mtkit.data.tokenizer import PAD_ID, Tokenizer, train_spm
from mtkit.model.transformer import Transformer, build_model

# Set by .ci/run: there a skipped test is a failure unless it needs a GPU (CI has none), so that no test can stop
# running unnoticed, for want of a file, a package or a device.
NO_SKIPS = os.environ.get("MTKIT_TESTS_NO_SKIPS") == "1"
MAY_SKIP = {"tests/test_cuda.py"}


_wrongly_skipped: list[str] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if NO_SKIPS and reporter is not None:
        _wrongly_skipped[:] = [r.nodeid for r in reporter.stats.get("skipped", []) if r.location[0] not in MAY_SKIP]
        if _wrongly_skipped:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Runs after pytest_sessionfinish: lists what it failed the session for."""
    if _wrongly_skipped:
        terminalreporter.write_line(f"{len(_wrongly_skipped)} tests skipped that must run (MTKIT_TESTS_NO_SKIPS):")
        for nodeid in _wrongly_skipped:
            terminalreporter.write_line(f"  {nodeid}")


def tiny_model_config(**overrides) -> ModelConfig:
    values = dict(encoder_layers=2, decoder_layers=2, d_model=32, heads=4, ffn=64, dropout=0.0, max_positions=128)
    values.update(overrides)
    return ModelConfig(**values)


def train_on_task(model: Transformer, pairs, steps: int, peak_lr: float, warmup: int) -> Transformer:
    """Plain training of a tiny model on a toy task: ``pairs()`` gives each step's (sources, targets)."""
    from mtkit.data.parallel import collate
    from mtkit.data.tokenizer import PAD_ID
    from mtkit.model.loss import linear_cross_entropy
    from mtkit.training.trainer import lr_at

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
def corpus_files(tmp_path_factory) -> dict[str, Path]:
    """Train (400 pairs) and valid (40 pairs) en-de captions as text files, keyed "train.en", "val.de", ..."""
    out = tmp_path_factory.mktemp("captions")
    corpus, paths = captions.parallel(440, seed=1), {}
    for split, lines in (("train", slice(0, 400)), ("val", slice(400, 440))):
        for lang in ("en", "de"):
            path = out / f"{split}.{lang}"
            path.write_text("\n".join(corpus[lang][lines]) + "\n", encoding="utf-8")
            paths[f"{split}.{lang}"] = path
    return paths


@pytest.fixture(scope="session")
def mirror_files(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("multi30k_mirror")
    return path, captions.write_mirror(path)


@pytest.fixture(scope="module")
def multi30k_mirror(mirror_files) -> Iterator[Path]:
    """A folder laid out as Multi30k's published files (captions.write_mirror), whose digests the corpus catalogue
    expects, in place of the published ones, while the tests of one module run: `mtkit prepare multi30k_*` and
    `mtkit run` take it as the real corpus's mirror."""
    from mtkit.data import corpora

    folder, digests = mirror_files
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpora, "_MULTI30K_SHA256", {**corpora._MULTI30K_SHA256, **digests})
        for name, corpus in corpora._catalogue().items():
            if name.startswith("multi30k_"):
                patch.setitem(corpora.CORPORA, name, corpus)
        yield folder


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory, corpus_files) -> Tokenizer:
    """A joint 300-piece unigram model over the training captions."""
    lines = corpus_files["train.en"].read_text().splitlines() + corpus_files["train.de"].read_text().splitlines()
    path = train_spm(lines, tmp_path_factory.mktemp("spm") / "spm", TokenizerConfig(vocab_size=300))
    return Tokenizer(path)
