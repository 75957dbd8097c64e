"""Checkpoint files: atomic writes, safe loading, and the one loader ``translate`` uses.

A checkpoint is a dict of tensors and plain values (no pickled code): it loads with
``torch.load(weights_only=True)``. It carries the resolved config and the SHA-256 of each
tokenizer model, so a run directory is all ``translate`` needs and a swapped tokenizer is caught.

Run directory layout::

    RUN_DIR/config.yaml                 resolved config
    RUN_DIR/spm.model (+ .vocab)        joint tokenizer, or spm.src.model and spm.tgt.model
    RUN_DIR/last.pt                     full training state, for resuming
    RUN_DIR/best.pt                     weights of the best validation result, for translating
    RUN_DIR/metrics.jsonl               one JSON object per log or validation event
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtkit import __version__
from mtkit.config import RunConfig, from_dict
from mtkit.model import Transformer, build_model
from mtkit.tokenizer import PAD_ID, Tokenizer

FORMAT_VERSION = 1
LAST, BEST = "last.pt", "best.pt"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or inconsistent with its run directory."""


def atomic_write(path: Path, write) -> None:
    """Call ``write(file_object)`` on a temporary file beside ``path``, fsync it, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, path)
        _fsync_directory(path.parent)  # make the rename itself durable
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def save(path: Path, payload: dict[str, Any]) -> None:
    payload = {"format": FORMAT_VERSION, "mtkit_version": __version__, **payload}
    atomic_write(path, lambda f: torch.save(payload, f))


def load(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path}: not a readable mtkit checkpoint ({type(err).__name__})") from None
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"{path}: not an mtkit checkpoint")
    if payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {payload.get('format')} is not supported by mtkit {__version__} "
            f"(format {FORMAT_VERSION})"
        )
    return payload


def tokenizer_files(cfg: RunConfig) -> dict[str, str]:
    """File names of the tokenizer model(s) inside a run directory, by side."""
    if cfg.tokenizer.joint:
        return {"src": "spm.model", "tgt": "spm.model"}
    return {"src": "spm.src.model", "tgt": "spm.tgt.model"}


@dataclass
class InferenceBundle:
    model: Transformer
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    cfg: RunConfig
    step: int


def resolve(model_path: Path) -> Path:
    """A run directory means its best checkpoint (or last, before any validation)."""
    model_path = Path(model_path)
    if model_path.is_dir():
        for name in (BEST, LAST):
            if (model_path / name).is_file():
                return model_path / name
        raise CheckpointError(f"{model_path}: no {BEST} or {LAST} in this run directory")
    return model_path


def load_for_inference(model_path: Path, device: torch.device) -> InferenceBundle:
    """Model in eval mode plus the tokenizers it was trained with, checked by hash."""
    path = resolve(model_path)
    payload = load(path)
    cfg = from_dict(payload["config"])
    toks = {}
    for side, record in payload["tokenizer"].items():
        tok_path = path.parent / record["file"]
        tok = Tokenizer(tok_path)
        if tok.sha256 != record["sha256"]:
            raise CheckpointError(
                f"{tok_path}: tokenizer does not match the one {path.name} was trained with "
                f"(sha256 {tok.sha256[:12]}, expected {record['sha256'][:12]})"
            )
        toks[side] = tok
    model = build_model(cfg.model, toks["src"].vocab_size, toks["tgt"].vocab_size, PAD_ID)
    model.load_state_dict(payload["model"])
    model.to(device).eval()
    return InferenceBundle(model, toks["src"], toks["tgt"], cfg, int(payload["step"]))
