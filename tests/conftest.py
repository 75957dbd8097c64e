"""Shared fixtures: a caption corpus written by tests/captions.py, a small SentencePiece model, runs trained on them.

Plain helpers (tiny models, configs, the command line) are in helpers.py.

No test reads data from outside the repository: corpora are generated (captions.py), tasks are synthetic.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import captions
import pytest
import torch
import yaml
from helpers import invoke, multilingual_raw, write_config

import mtkit
from mtkit import progress
from mtkit.config import TokenizerConfig
from mtkit.data.tokenizer import Tokenizer, train_spm

# Set by .ci/run: there a test that is skipped, or marked to fail (xfail, whether it fails or passes), fails the
# session, so that no test can stop running unnoticed, for want of a file, a package or a device; unless the machine
# lacks what the test needs (``MACHINE_SKIPS``).
NO_SKIPS = os.environ.get("MTKIT_TESTS_NO_SKIPS") == "1"
# The skips a machine justifies, by file and reason, each with whether this machine lacks what the test needs: a
# CUDA device (CI has none), a CPU for which oneDNN computes bf16 products (AVX2 alone has none), Debian's Chromium
# (which .ci/run installs where it can) for the browser that reads the API's documentation page.
MACHINE_SKIPS = {
    ("tests/test_cuda.py", "needs a CUDA device"): lambda: not torch.cuda.is_available(),
    ("tests/test_model.py", "oneDNN computes no bf16 product on this CPU"): lambda: (
        not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ),
    ("tests/test_serve_docs.py", "needs Chromium (/usr/bin/chromium)"): lambda: not Path("/usr/bin/chromium").exists(),
}
# pyproject.toml runs the tests in one worker per core (pytest-xdist), at most this many: each worker trains its own
# session fixtures and holds its own models.
MAX_WORKERS = 4
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(CORES, MAX_WORKERS))


if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # A worker's share of the cores, for its torch and for the mtkit processes it starts: torch threads that
    # outnumber the cores busy-wait on each other and make every worker several times slower.
    _threads = max(1, CORES // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


_wrongly_skipped: list[str] = []  # "NODEID (skipped: REASON)", "NODEID (xfailed)", ...


def skip_reason(report) -> str:
    """The reason a skipped test's report gives ("needs a CUDA device"); a tuple, or a list once pytest-xdist's
    worker has sent it."""
    return report.longrepr[2].removeprefix("Skipped: ") if isinstance(report.longrepr, (tuple, list)) else ""


def machine_skip(report) -> bool:
    """Whether a skipped test's report is one of ``MACHINE_SKIPS`` on a machine that lacks what the test needs."""
    lacks = MACHINE_SKIPS.get((report.location[0], skip_reason(report)))
    return lacks is not None and lacks()


def pytest_sessionfinish(session, exitstatus) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if NO_SKIPS and reporter is not None:
        stats = reporter.stats
        _wrongly_skipped[:] = [
            f"{r.nodeid} (skipped: {skip_reason(r)})" for r in stats.get("skipped", []) if not machine_skip(r)
        ] + [f"{r.nodeid} ({kind})" for kind in ("xfailed", "xpassed") for r in stats.get(kind, [])]
        if _wrongly_skipped:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Runs after pytest_sessionfinish: lists what it failed the session for."""
    if _wrongly_skipped:
        terminalreporter.write_line(f"{len(_wrongly_skipped)} tests did not run that must (MTKIT_TESTS_NO_SKIPS):")
        for entry in _wrongly_skipped:
            terminalreporter.write_line(f"  {entry}")


@pytest.fixture
def terminal(monkeypatch) -> None:
    """stderr taken for a terminal (Rich reads TTY_COMPATIBLE), every bar kept on it when its stage ends."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setattr(progress, "KEEP_AFTER_S", 0.0)


@pytest.fixture
def no_cuda(monkeypatch) -> None:
    """Torch sees no CUDA device, as on a machine without one, whether or not this machine has one: for what
    ``auto`` picks there, and what asking for CUDA there does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


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
def trilingual_files(tmp_path_factory) -> dict[str, Path]:
    """Train (400) and valid (40) captions in en, de and fr, line-aligned, keyed "train.en", "val.fr", ..."""
    out = tmp_path_factory.mktemp("trilingual")
    corpus, paths = captions.parallel(440, seed=2, langs=("en", "de", "fr")), {}
    for split, lines in (("train", slice(0, 400)), ("val", slice(400, 440))):
        for lang in ("en", "de", "fr"):
            path = out / f"{split}.{lang}"
            path.write_text("\n".join(corpus[lang][lines]) + "\n", encoding="utf-8")
            paths[f"{split}.{lang}"] = path
    return paths


@pytest.fixture(scope="session")
def multilingual_run(tmp_path_factory, trilingual_files) -> Path:
    """`mtkit train` of one tiny model for en->de and en->fr (a tag before each source), 300 updates: enough for
    the tag to choose the language of the output."""
    root = tmp_path_factory.mktemp("multilingual")
    raw = multilingual_raw(trilingual_files, train={"max_steps": 300, "valid_every": 150, "save_every": 150})
    (root / "ml.yaml").write_text(yaml.safe_dump(raw))
    result = invoke("train", root / "ml.yaml", "--out", root / "run")
    assert result.exit_code == 0, result.output
    return root / "run"


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


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_files) -> Path:
    """`mtkit train` from a config with no tokenizer model: it trains one first. 300 updates, so that it translates
    each line into words of its own (after 20 it ends every translation at once)."""
    root = tmp_path_factory.mktemp("cli")
    config = write_config(
        root / "tiny.yaml", corpus_files, train={"max_steps": 300, "valid_every": 150, "save_every": 150}
    )
    result = invoke("train", config, "--out", root / "run")
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture(scope="module")
def run_with_decode_settings(tmp_path_factory, corpus_files) -> Path:
    """A run whose recipe says beam 2 and length penalty 0.6, trained through `mtkit.train` for 300 updates, so
    that it translates each line into words of its own."""
    root = tmp_path_factory.mktemp("api")
    config = write_config(root / "c.yaml", corpus_files, decode={"beam": 2, "lenpen": 0.6})
    result = mtkit.train(config, root / "run", overrides=["train.max_steps=300", "train.valid_every=0"])
    assert "valid_loss" in result
    return root / "run"
