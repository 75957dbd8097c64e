"""Finding a model on disk and loading it to translate: ``RUN`` means ``RUN/best`` (the run's layout is
run_folder.py's), and the files a model is read from are known, so no command writes its output onto them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from mtkit.config import ModelConfig, RunConfig
from mtkit.data.tokenizer import PAD_ID, Tokenizer
from mtkit.files import set_aside
from mtkit.model.checkpoint import (
    STATE_FILE,
    TOKENIZER_NAMES,
    WEIGHTS_FILE,
    CheckpointError,
    check_weights,
    find_tokenizer,
    read_checkpoint,
    tokenizer_folders,
    weights_file,
)
from mtkit.model.quantization import quantize_int8
from mtkit.model.run_folder import BEST_DIR, CHECKPOINTS_DIR, UPDATE_DIR, latest
from mtkit.model.transformer import Transformer, build_model
from mtkit.runtime import DTYPES

# -- finding --------------------------------------------------------------------------------


def resolve(model_path: Path) -> Path:
    """A run directory means its best checkpoint (or the latest, before any validation); other paths as given."""
    model_path = Path(model_path)
    if not model_path.is_dir() or (model_path / WEIGHTS_FILE).is_file():
        return model_path
    for best in (model_path / BEST_DIR, set_aside(model_path / BEST_DIR)):  # the latter if a crash left it aside
        if (best / WEIGHTS_FILE).is_file():
            return best
    found = latest(model_path)
    if found is None:
        raise CheckpointError(
            f"{model_path}: no checkpoint in this run directory (no {BEST_DIR}/ and no {CHECKPOINTS_DIR}/update-*/)"
        )
    return found


# -- what an output must not touch ----------------------------------------------------------


def model_files(source: Path) -> list[Path]:
    """The weights and tokenizers a model path is read from (the tokenizers where ``load_for_inference`` looks);
    none for a path that is no model, such as a text file."""
    if not (source.is_dir() or source.suffix == ".safetensors"):
        return []
    try:
        resolved = resolve(source)
    except CheckpointError:  # a run without a checkpoint: the command names it when it loads the model
        return []
    weights = weights_file(resolved)
    tokenizers = [folder / name for folder in tokenizer_folders(weights.parent) for name in TOKENIZER_NAMES]
    return [file for file in (weights, *tokenizers) if file.is_file()]


def with_model_files(inputs: Iterable[Path]) -> dict[Path, list[Path]]:
    """Each input of a command with the files it is read from when it is a model (``model_files``), for
    ``files.check_output_file``."""
    return {Path(source): model_files(Path(source)) for source in inputs}


def checkpoints_holding(path: Path) -> list[Path]:
    """The checkpoint directories that writing ``path`` (a file, or a folder made whole) would write into: one
    holding training state, a run's ``best/`` (or one a crash set aside) or an ``update-N`` folder with weights."""
    path = Path(path)
    return [folder for folder in {path.parent, path.resolve().parent} if _is_checkpoint_dir(folder)]


def _is_checkpoint_dir(folder: Path) -> bool:
    """A folder mtkit saves whole, told by what it holds and how mtkit names it, not any folder with weights."""
    if (folder / STATE_FILE).is_file():
        return True
    named = folder.name in (BEST_DIR, set_aside(Path(BEST_DIR)).name) or UPDATE_DIR.fullmatch(folder.name)
    return bool(named) and (folder / WEIGHTS_FILE).is_file()


# -- loading --------------------------------------------------------------------------------


@contextlib.contextmanager
def skeleton_device() -> Iterator[None]:
    """The meta device, where a model's shapes cost no memory, with its normal draws skipped: a meta tensor holds
    no values, and torch's meta kernel for ``normal_`` imports dynamo and sympy on first use (1.5 s and 75 MB
    resident of every process that loads a model)."""
    with torch.device("meta"), mock.patch.object(torch.nn.init, "normal_", lambda tensor, *_, **__: tensor):
        yield


def model_holding(
    cfg: ModelConfig, src_vocab: int, tgt_vocab: int, weights: dict[str, torch.Tensor], path: Path
) -> Transformer:
    """The model of ``cfg`` with ``weights`` loaded, built only once a skeleton on the meta device shows they fit.

    So a checkpoint header claiming a huge model is refused before any memory is allocated for it.
    """
    with skeleton_device():
        skeleton = build_model(cfg, src_vocab, tgt_vocab, PAD_ID)
    check_weights(skeleton.state_dict(), weights, path)
    model = build_model(cfg, src_vocab, tgt_vocab, PAD_ID)
    model.load_state_dict(weights)
    return model


@dataclass
class InferenceBundle:
    model: Transformer
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    cfg: RunConfig
    step: int


def load_for_inference(model_path: Path, device: torch.device, precision: str = "fp32") -> InferenceBundle:
    """Model in eval mode in ``precision`` (fp32, bf16, fp16 or int8), plus the tokenizers it was trained with,
    checked by hash.

    Decoding in bf16/fp16 casts the weights once, rather than at every step as autocast would; int8 quantizes
    the linear layers once (mtkit.model.quantization).
    """
    ckpt = read_checkpoint(resolve(model_path), with_state=False)
    where = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    toks = {
        side: Tokenizer(find_tokenizer(record, where, ckpt.path.name))
        for side, record in ckpt.meta["tokenizer"].items()
    }
    model = model_holding(ckpt.cfg.model, toks["src"].vocab_size, toks["tgt"].vocab_size, ckpt.weights, ckpt.path)
    model.to(device=device, dtype=DTYPES[precision]).eval()
    if precision == "int8":
        quantize_int8(model)
    return InferenceBundle(model, toks["src"], toks["tgt"], ckpt.cfg, ckpt.meta["step"])
