"""An export folder, whichever runtime it is for (ct2_export.py, hf_export.py): the manifest that marks it as
mtkit's (``mtkit.json``: its format and the weights it came from), the rule that only an export is replaced,
and the vocabulary both runtimes store in id order.

Training reads the manifest's name too: a folder holding one is an export, which it cannot start from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtkit.data.tokenizer import Tokenizer
from mtkit.files import file_sha256
from mtkit.model.checkpoint import CheckpointError, weights_file
from mtkit.model.loading import InferenceBundle

MANIFEST = "mtkit.json"
MANIFEST_FORMAT = 1


def provenance(checkpoint: Path, bundle: InferenceBundle) -> dict[str, Any]:
    """What an export's manifest says of the checkpoint it came from (loaded as ``bundle``): the SHA-256 of its
    weights file and its update step, which identify it to anyone who holds it, and the LoRA adapter merged into it
    with its base's digest. Never its path: an export is made to be handed on, and a path tells its recipients the
    exporter's folders and often their user name."""
    record = {"weights_sha256": file_sha256(weights_file(checkpoint)), "step": bundle.step}
    if bundle.adapter is not None:
        record["adapter"] = {**bundle.adapter.record(), "base_sha256": bundle.base_sha256}
    return record


def check_replaceable(out_dir: Path) -> None:
    """CheckpointError unless ``out_dir`` is missing, empty or an earlier mtkit export (of either runtime)."""
    if out_dir.exists() and not (out_dir / MANIFEST).is_file():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise CheckpointError(f"{out_dir}: exists and is not an mtkit export; choose another output folder")


def vocabulary(tok: Tokenizer) -> list[str]:
    """The tokenizer's pieces in id order: an export's vocabulary, so that row i stays id i."""
    return tok.sp.id_to_piece(list(range(tok.vocab_size)))
