"""Finding a model on disk and loading it to translate: ``RUN`` means ``RUN/best`` (the run's layout is
run_folder.py's), and the files a model is read from are known, so no command writes its output onto them.

A model may come with a LoRA adapter (mtkit.model.lora): one given beside it (``adapter``), or its own, when the
model is a LoRA run (or one of its checkpoints), whose weights file holds the adapter alone; the base it adapts is
then the model that run started from, read from the path the run recorded. Either way the adapter's record of its
base's weights digest must be the base's (mtkit.model.adapter_file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch

from mtkit.config import LoraConfig, ModelConfig, RunConfig
from mtkit.data.tokenizer import PAD_ID, Tokenizer
from mtkit.files import set_aside
from mtkit.hub_folders import check_inside
from mtkit.model.adapter_file import Adapter, read_adapter
from mtkit.model.checkpoint import (
    STATE_FILE,
    TOKENIZER_NAMES,
    WEIGHTS_FILE,
    Checkpoint,
    CheckpointError,
    check_weights,
    find_tokenizer,
    read_checkpoint,
    read_meta,
    tokenizer_folders,
    weights_digest,
    weights_file,
)
from mtkit.model.lora import merge_adapters, put_adapters
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


def adapter_path(path: Path) -> Path:
    """The adapter file ``path`` names: the file itself, or for a folder (a LoRA run, meaning its best/, or one of its
    checkpoints) its weights file. The file must lie in the folder it is named in: a link leading out is refused."""
    path = Path(path)
    if path.is_dir():
        found = weights_file(resolve(path))
        check_inside(found, (path,), error=CheckpointError)
        return found
    if not path.is_file():
        raise CheckpointError(f"{path}: adapter not found")
    check_inside(path, (path.parent,), error=CheckpointError)
    return path


def is_adapted(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` is a LoRA run's: its weights file holds an adapter, not a model."""
    return ckpt.cfg.train.lora.rank > 0


def recorded_base(ckpt: Checkpoint) -> Checkpoint:
    """The base model a LoRA run's checkpoint adapts: the weights its run started from (train.init_from), read from
    the path the run recorded."""
    init = ckpt.meta.get("init")
    if init is None:
        raise CheckpointError(f"{ckpt.path}: a LoRA checkpoint that records no base model (train.init_from)")
    base = Path(init["path"])
    if not base.is_file():
        raise CheckpointError(
            f"{ckpt.path}: adapts the base model {base}, which is not there any more; give the base model with this "
            f"adapter (mtkit translate BASE --adapter {ckpt.path})"
        )
    return read_checkpoint(base, with_state=False)


def _base_and_adapter(
    ckpt: Checkpoint, adapter: Path | None, toks: dict[str, Tokenizer], model_path: Path
) -> tuple[Checkpoint, Path | None]:
    """The model to build and the adapter file to put on it: ``ckpt`` and the ``adapter`` given, or for a LoRA run's
    checkpoint the base it records (of the run's tokenizers ``toks``) and its own weights file."""
    if not is_adapted(ckpt):
        return ckpt, adapter_path(adapter) if adapter is not None else None
    if adapter is not None:
        raise CheckpointError(
            f"{model_path}: a LoRA run's adapter, not a model another adapter can adapt; give its base model with "
            f"--adapter {model_path}"
        )
    base = recorded_base(ckpt)
    if is_adapted(base):
        raise CheckpointError(f"{ckpt.path}: its base model {base.path} is itself an adapter")
    for side, tok in toks.items():
        if base.meta["tokenizer"][side]["sha256"] != tok.sha256:
            raise CheckpointError(f"{tok.path}: not the tokenizer of the base model {base.path}")
    return base, weights_file(ckpt.path)


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
    return [file for file in (weights, *tokenizers, *_recorded_base_file(weights)) if file.is_file()]


def _recorded_base_file(weights: Path) -> list[Path]:
    """The base model's weights file a LoRA run's checkpoint ``weights`` reads (none for another model), from its
    header alone."""
    try:
        meta, cfg = read_meta(weights)
    except CheckpointError:  # not mtkit's: the command names it when it loads the model
        return []
    init = meta.get("init")
    if cfg.train.lora.rank and isinstance(init, dict) and isinstance(init.get("path"), str):
        return [Path(init["path"])]
    return []


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
    adapter: Adapter | None = None  # the LoRA adapter the model carries (or merged), if any
    base_sha256: str | None = None  # with an adapter: the digest of its base's weights, as they were read


def load_for_inference(
    model_path: Path, device: torch.device, precision: str = "fp32", adapter: Path | None = None, merge: bool = False
) -> InferenceBundle:
    """Model in eval mode in ``precision`` (fp32, bf16, fp16 or int8), plus the tokenizers it was trained with,
    checked by hash.

    Decoding in bf16/fp16 casts the weights once, rather than at every step as autocast would; int8 quantizes
    the linear layers once (mtkit.model.quantization). ``adapter`` (an adapter file, or a LoRA run or checkpoint
    folder) adapts the model; a LoRA run's checkpoint as the model brings its own, over the base it records. An
    adapter stays beside the weights, as training computed it, unless ``merge`` (or int8, which quantizes the
    merged weights) folds it into them.
    """
    ckpt = read_checkpoint(resolve(model_path), with_state=False)
    where = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    toks = {
        side: Tokenizer(find_tokenizer(record, where, ckpt.path.name))
        for side, record in ckpt.meta["tokenizer"].items()
    }
    base, adapter = _base_and_adapter(ckpt, adapter, toks, model_path)
    model = model_holding(base.cfg.model, toks["src"].vocab_size, toks["tgt"].vocab_size, base.weights, base.path)
    found, base_sha256 = None, None
    if adapter is not None:
        base_sha256 = weights_digest(base.weights)
        found = read_adapter(adapter, model, base_sha256, base.path)
        put_adapters(model, found.settings, found.tensors)
        if merge or precision == "int8":
            merge_adapters(model)
    model.to(device=device, dtype=DTYPES[precision]).eval()
    if precision == "int8":
        quantize_int8(model)
    return InferenceBundle(model, toks["src"], toks["tgt"], ckpt.cfg, ckpt.meta["step"], found, base_sha256)


def model_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` as a model of its own weights: a LoRA run's with its adapter merged into its base
    (in float32) and its config that of a model without adapters; any other as it is read."""
    ckpt = read_checkpoint(path, with_state=False)
    if not is_adapted(ckpt):
        return ckpt
    merged = load_for_inference(path, torch.device("cpu"), merge=True).model.state_dict()
    cfg = replace(ckpt.cfg, train=replace(ckpt.cfg.train, lora=LoraConfig()))
    return replace(ckpt, weights=merged, cfg=cfg, meta={**ckpt.meta, "config": cfg.to_dict()})
