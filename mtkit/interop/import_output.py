"""The folder an import of a transformers model writes: an mtkit checkpoint (the model, its config, its tokenizer
models) with a record of what was imported, written whole or not at all, and never over a folder that holds
anything."""

from __future__ import annotations

import hashlib
from pathlib import Path

from mtkit.config import RunConfig
from mtkit.model import checkpoint
from mtkit.model.checkpoint import TOKENIZER_NAMES, CheckpointError
from mtkit.model.transformer import Transformer


def check_output(out_dir: Path) -> None:
    """``out_dir`` is absent or an empty folder, checked before anything is read or downloaded."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir}: exists and is not empty; choose another output folder")


def save_import(
    out_dir: Path, model: Transformer, cfg: RunConfig, models: dict[str, bytes], imported: dict[str, str]
) -> None:
    """The checkpoint folder: the model, its config, one tokenizer model (joint) or two (``models``' src and tgt),
    and what was imported."""
    names = (
        {"src": TOKENIZER_NAMES[0], "tgt": TOKENIZER_NAMES[0]}
        if cfg.tokenizer.joint
        else {"src": TOKENIZER_NAMES[1], "tgt": TOKENIZER_NAMES[2]}
    )
    files = {names[side]: models[side] for side in ("src", "tgt")}
    records = {
        side: {"file": names[side], "sha256": hashlib.sha256(models[side]).hexdigest()} for side in ("src", "tgt")
    }
    meta = {"config": cfg.to_dict(), "tokenizer": records, "step": 0, "imported": imported}
    checkpoint.save(out_dir, model.state_dict(), meta, files=files)
