"""Checkpoints: atomic saves, safe loading, averaging, and the one loader ``translate`` uses.

A checkpoint (format 2) is a directory. ``model.safetensors`` holds the weights, with the metadata as
JSON in its header: the resolved config, the SHA-256 of each tokenizer model (so a swapped tokenizer is
caught), the update step and extras such as the validation result. ``state.pt`` holds what resuming
needs (optimizer, scaler, RNG, progress); it is tensors and plain values only and loads with
``torch.load(weights_only=True)``. Nothing in a checkpoint is pickled code.

Run directory layout::

    RUN_DIR/config.yaml                              resolved config
    RUN_DIR/spm.model (+ .vocab)                     joint tokenizer, or spm.src.model and spm.tgt.model
    RUN_DIR/checkpoints/update-00001000/             one directory per save, the newest train.keep_last kept
        model.safetensors                            weights + metadata
        state.pt                                     training state, for resuming
    RUN_DIR/best/model.safetensors                   weights of the best validation result, for translating
    RUN_DIR/metrics.jsonl                            one JSON object per log or validation event
    RUN_DIR/.lock                                    held while a training process writes here

A checkpoint directory appears whole or not at all: it is built under a
temporary name beside its final one and renamed into place. One writer per run directory: training
holds a lock on ``RUN_DIR/.lock`` (released by the kernel even if the process is killed); run_directory.py
owns the directory as training sees it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch

from mtkit import untrusted
from mtkit.config import ConfigError, ModelConfig, RecipeConfig, RunConfig, from_dict
from mtkit.data.tokenizer import PAD_ID, Tokenizer, is_sentencepiece_model
from mtkit.errors import MtkitError
from mtkit.files import (
    atomic_write,
    atomic_write_directory,
    atomic_write_text,
    file_sha256,
    set_aside,
)
from mtkit.model.transformer import Transformer, build_model
from mtkit.version import __version__

FORMAT_VERSION = 2
WEIGHTS_FILE, STATE_FILE = "model.safetensors", "state.pt"
VALIDATION_FILE = "validation.json"  # added to a checkpoint once the validation of its update is done
CHECKPOINTS_DIR, BEST_DIR = "checkpoints", "best"

_META_KEY, _ALIASES_KEY = "mtkit", "mtkit.aliases"  # safetensors header entries
_UPDATE_DIR = re.compile(r"update-(\d+)")


class CheckpointError(MtkitError, ValueError):
    """A checkpoint that is missing, unreadable or inconsistent with its run directory."""


@dataclass
class Checkpoint:
    path: Path  # the checkpoint directory, or the single file it came from
    meta: dict[str, Any]  # format, mtkit_version, config, tokenizer, step, and extras; checked on loading
    cfg: RunConfig  # meta["config"], validated
    weights: dict[str, torch.Tensor]
    state: dict[str, Any] | None  # None when the checkpoint holds weights only, or when not asked for


# -- outputs --------------------------------------------------------------------------------


def check_output_file(path: Path, inputs: Iterable[Path] = ()) -> None:
    """Fail before any work if ``path`` must not be written: OutputError naming it and why.

    Refused: a folder, a path in a missing folder, a file without write permission, a file inside a
    checkpoint directory (``check_outside_checkpoints``), and one of ``inputs`` (or a link to one), whose
    content the command still needs and the user would lose. An input that is a model (a run directory,
    checkpoint or .safetensors file) counts with the files it is read from: its weights and tokenizers.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a folder; give a file to write")
    if not path.parent.is_dir():
        raise OutputError(f"{path}: cannot write it, folder {path.parent} does not exist")
    check_outside_checkpoints(path)
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OutputError(f"{path}: is read-only; remove it or choose another output")
        for source in map(Path, inputs):
            if source.exists() and os.path.samefile(path, source):
                also = "" if str(source) == str(path) else f" ({source})"
                raise OutputError(f"{path}: is also an input{also}; write the output to another file")
            if any(os.path.samefile(path, file) for file in _files_read(source)):
                raise OutputError(f"{path}: the model {source} is read from it; write the output to another file")


def check_outside_checkpoints(path: Path) -> None:
    """OutputError if writing ``path`` (a file, or a folder made whole) would write into a checkpoint directory:
    one holding training state, a run's ``best/`` (or one a crash set aside) or an ``update-N`` folder with
    weights. A file written there would leave a checkpoint whose files no longer belong together, or be lost
    when the next save replaces it."""
    path = Path(path)
    for folder in {path.parent, path.resolve().parent}:  # the latter: where a link's file is written
        if _is_checkpoint_dir(folder):
            raise OutputError(f"{path}: is inside the checkpoint {folder}; write it elsewhere")


def _is_checkpoint_dir(folder: Path) -> bool:
    """A folder mtkit saves whole, told by what it holds and how mtkit names it, not any folder with weights."""
    if (folder / STATE_FILE).is_file():
        return True
    named = folder.name in (BEST_DIR, set_aside(Path(BEST_DIR)).name) or _UPDATE_DIR.fullmatch(folder.name)
    return bool(named) and (folder / WEIGHTS_FILE).is_file()


def _files_read(source: Path) -> list[Path]:
    """The weights and tokenizers a model path is read from (the tokenizers where ``load_for_inference`` looks:
    beside the weights and up to two folders above); none for a path that is no model, such as a text file."""
    if not (source.is_dir() or source.suffix == ".safetensors"):
        return []
    try:
        resolved = resolve(source)
    except CheckpointError:  # a run without a checkpoint: the command names it when it loads the model
        return []
    weights = weights_file(resolved)
    folders = (weights.parent, weights.parent.parent, weights.parent.parent.parent)
    tokenizers = [folder / name for folder in folders for name in TOKENIZER_NAMES]
    return [file for file in (weights, *tokenizers) if file.is_file()]


class OutputError(MtkitError, ValueError):
    """An output path that cannot or must not be written; the command has done nothing yet."""


# -- saving ---------------------------------------------------------------------------------


def _aliases(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Keys whose tensor is the very same view as an earlier key's (tied embeddings), mapped to that key.

    safetensors refuses tensors that share memory, so each is stored once and the others are restored on load.
    """
    seen: dict[tuple, str] = {}
    aliases = {}
    for key, t in weights.items():
        view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in seen:
            aliases[key] = seen[view]
        else:
            seen[view] = key
    return aliases


def _encode(weights: dict[str, torch.Tensor], meta: dict[str, Any]) -> bytes:
    """The safetensors bytes of ``weights``, with ``meta`` (stamped with the format) in the header."""
    aliases = _aliases(weights)
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in weights.items() if k not in aliases}
    meta = {**meta, "format": FORMAT_VERSION, "mtkit_version": __version__}
    header = {_META_KEY: json.dumps(meta), _ALIASES_KEY: json.dumps(aliases)}
    return safetensors.torch.save(tensors, metadata=header)


def save(
    directory: Path, weights: dict[str, torch.Tensor], meta: dict[str, Any], state: dict[str, Any] | None = None
) -> None:
    """Write a checkpoint directory as a whole: a crash leaves the old one or the new one, never a mix.

    ``state`` must hold only tensors and plain values, as it is read back with ``weights_only=True``.
    """
    data = _encode(weights, meta)

    def fill(tmp: Path) -> None:
        (tmp / WEIGHTS_FILE).write_bytes(data)
        if state is not None:
            with open(tmp / STATE_FILE, "wb") as f:
                stream = _WriteErrors(f)
                try:
                    torch.save(state, stream)
                except RuntimeError:
                    if stream.error is None:
                        raise
                    raise stream.error from None

    atomic_write_directory(Path(directory), fill)


def _delete(directory: Path) -> None:
    """Remove a checkpoint in one step as far as readers can tell: renamed out of sight, then deleted.

    A crash in the middle of deleting the files could otherwise leave a folder holding the weights
    without the training state, which would pass for a checkpoint to resume from.
    """
    doomed = directory.with_name(f".{directory.name}.pruned")
    os.rename(directory, doomed)
    shutil.rmtree(doomed)


class _WriteErrors:
    """A file whose failed write is kept: torch.save reports it only as a RuntimeError ("unexpected pos"),
    so a full disk would otherwise not read as the OSError it is."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def save_in_run(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    meta: dict[str, Any],
    state: dict[str, Any] | None,
    keep_last: int,
) -> Path:
    """Save ``RUN/checkpoints/update-STEP/``, then delete all but the newest ``keep_last`` (0 keeps all)."""
    directory = Path(run_dir) / CHECKPOINTS_DIR / f"update-{step:08d}"
    save(directory, weights, {**meta, "step": step}, state)
    if keep_last > 0:
        for old in run_checkpoints(run_dir)[:-keep_last]:
            if old != directory:  # never the one just written, even if stale later ones exist
                _delete(old)
    return directory


def save_best(run_dir: Path, weights: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    save(Path(run_dir) / BEST_DIR, weights, meta)


def record_validation(run_dir: Path, step: int, outcome: dict[str, Any]) -> None:
    """Add to the checkpoint of ``step``, saved before its validation, what that validation changed."""
    atomic_write_text(Path(run_dir) / CHECKPOINTS_DIR / f"update-{step:08d}" / VALIDATION_FILE, json.dumps(outcome))


def read_validation(checkpoint_dir: Path) -> Any:
    """The outcome ``record_validation`` added to a checkpoint (unchecked JSON), or None if there is none."""
    try:
        return json.loads((Path(checkpoint_dir) / VALIDATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none (or not a directory), or torn: the validation is done again
        return None


def write_model_file(path: Path, weights: dict[str, torch.Tensor], meta: dict[str, Any], source: Path) -> None:
    """Write weights to one .safetensors file with the tokenizer model(s) of ``source`` beside it.

    ``translate PATH`` then works wherever the file and its tokenizers are copied together.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: the output must be a .safetensors file")
    source = Path(source)
    where = source if source.is_dir() else source.parent
    for record in {r["file"]: r for r in meta["tokenizer"].values()}.values():
        found = _find_tokenizer(record, where, source.name)
        target = path.parent / record["file"]
        _copy_unless_identical(found, target)
        if found.with_suffix(".vocab").is_file():
            _copy_unless_identical(found.with_suffix(".vocab"), target.with_suffix(".vocab"))
    atomic_write(path, lambda f: f.write(_encode(weights, meta)))


def _copy_unless_identical(source: Path, target: Path) -> None:
    if target.exists():
        if file_sha256(target) != file_sha256(source):
            raise CheckpointError(f"{target}: already exists and differs from {source}; choose another output folder")
        return
    data = source.read_bytes()
    atomic_write(target, lambda f: f.write(data))


# -- finding --------------------------------------------------------------------------------


def run_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first; temporary and partial ones are skipped."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(match[1]), path)
        for path in root.iterdir()
        if (match := _UPDATE_DIR.fullmatch(path.name)) and (path / WEIGHTS_FILE).is_file()
    ]
    return [path for _, path in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    """Where training resumes from: the newest checkpoint, if any."""
    found = run_checkpoints(run_dir)
    return found[-1] if found else None


def weights_file(model: Path) -> Path:
    """The file holding a model's weights: a checkpoint directory's model.safetensors, or the file itself."""
    return model / WEIGHTS_FILE if model.is_dir() else model


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


# -- loading --------------------------------------------------------------------------------


def read_checkpoint(path: Path, with_state: bool = True) -> Checkpoint:
    """Read a checkpoint directory or a .safetensors file written by mtkit.

    Its metadata is checked to be what mtkit writes before anything uses it (see ``_check_meta``).
    """
    path = Path(path)
    if path.is_dir():
        return _load_directory(path, with_state)
    if path.suffix == ".safetensors":
        if path.name == WEIGHTS_FILE and path.is_file():
            return _load_directory(path.parent, with_state)
        meta, weights = _read_weights(path)
        return Checkpoint(path, meta, _check_meta(path, meta), weights, None)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    raise CheckpointError(
        f"{path}: {_what_it_is(path)}, not a checkpoint (mtkit reads checkpoint folders and .safetensors files)"
    )


def _load_directory(directory: Path, with_state: bool) -> Checkpoint:
    meta, weights = _read_weights(directory / WEIGHTS_FILE)
    cfg = _check_meta(directory / WEIGHTS_FILE, meta)
    state_path = directory / STATE_FILE
    state = _torch_load(state_path) if with_state and state_path.is_file() else None
    return Checkpoint(directory, meta, cfg, weights, state)


def _read_weights(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            if _META_KEY not in header:
                raise CheckpointError(f"{path}: not an mtkit checkpoint (no {_META_KEY!r} entry in its header)")
            meta = json.loads(header[_META_KEY])
            _check_format(path, meta.get("format") if isinstance(meta, dict) else None)
            weights = {key: f.get_tensor(key) for key in f.keys()}
            aliases = json.loads(header.get(_ALIASES_KEY, "{}"))
    except CheckpointError:
        raise
    except Exception as err:  # safetensors, json and odd metadata raise different types
        raise _unreadable(path, err) from None
    try:
        for alias, key in untrusted.mapping(aliases, "its tied-weight aliases").items():
            if alias in weights or key not in weights:
                raise untrusted.Malformed(f"alias {alias!r} of {key!r} does not name a stored tensor by a new name")
            weights[alias] = weights[key]
    except untrusted.Malformed as err:
        raise CheckpointError(f"{path}: malformed checkpoint header: {err}") from None
    return meta, weights


def _check_meta(path: Path, meta: Any) -> RunConfig:
    """The config of a checkpoint whose metadata has the form mtkit writes; CheckpointError otherwise.

    The tokenizer records may name only the files a run directory of that config holds (never a
    path), with their SHA-256; the step is a count; the config passes every check of config.py.
    """
    try:
        meta = untrusted.mapping(meta, "its metadata", required=("config", "tokenizer", "step"))
        untrusted.integer(meta["step"], "step")
        untrusted.mapping(meta["config"], "config")
        cfg = from_dict(meta["config"])
        names = tokenizer_files(cfg)
        records = untrusted.mapping(meta["tokenizer"], "tokenizer", required=("src", "tgt"), optional=())
        for side in ("src", "tgt"):
            record = untrusted.mapping(records[side], f"tokenizer.{side}", required=("file", "sha256"), optional=())
            untrusted.one_of(record["file"], f"tokenizer.{side}.file", {names[side]})
            untrusted.sha256(record["sha256"], f"tokenizer.{side}.sha256")
        if "validation" in meta:
            untrusted.mapping(meta["validation"], "validation")
        if "averaged" in meta:
            untrusted.strings(meta["averaged"], "averaged")
    except (untrusted.Malformed, ConfigError) as err:
        raise CheckpointError(f"{path}: malformed checkpoint header: {err}") from None
    return cfg


def _torch_load(path: Path) -> Any:
    """Tensors and plain values only: a file that would build other objects (and so could run code) is refused.

    The archive is looked at first: torch.save stores its entries uncompressed, so an entry that
    is compressed, or entries larger together than the file, would make a small file expand into
    gigabytes, and are refused before torch reads anything.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    _check_archive(path)
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols; the error says enough
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        if "Weights only load failed" in str(err):  # torch's weights-only unpickler met another object
            raise CheckpointError(
                f"{path}: refused: it holds pickled Python objects other than tensors, which could run code "
                "when loaded; mtkit loads only tensors and plain values from .pt files"
            ) from None
        raise _unreadable(path, err) from None


def _check_archive(path: Path) -> None:
    """The file is a zip archive as torch.save writes it: stored entries, no bigger together than the file."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        with open(path, "rb") as f:
            if f.read(4) == b"PK\x03\x04":  # the start of a zip archive whose end is missing or damaged
                raise _unreadable(path, err) from None
        raise CheckpointError(f"{path}: {_what_it_is(path)}, not a checkpoint") from None
    if any(entry.compress_type != zipfile.ZIP_STORED for entry in entries):
        raise CheckpointError(f"{path}: refused: it holds compressed entries, which torch.save never writes")
    if sum(entry.file_size for entry in entries) > path.stat().st_size:
        raise CheckpointError(f"{path}: refused: its entries claim more bytes than the file holds")


def _what_it_is(path: Path) -> str:
    """A few words on what a file that is not a checkpoint seems to be, for the error that refuses it."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        return "an empty file"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch file?)"
    if b"\0" not in head:
        try:
            head.decode("utf-8")
            return "a text file"
        except UnicodeDecodeError as err:
            if err.start >= len(head) - 3:  # a character cut by the 4 KiB read
                return "a text file"
    return "a SentencePiece model" if is_sentencepiece_model(path) else "a file of another kind"


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file that is truncated, corrupt or not a checkpoint at all."""


def _unreadable(path: Path, err: Exception) -> UnreadableCheckpoint:
    first_sentence = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
    reason = type(err).__name__ + (f": {first_sentence}" if first_sentence else "")
    return UnreadableCheckpoint(f"{path}: not a readable mtkit checkpoint ({reason})")


def _check_format(path: Path, found: Any) -> None:
    if found != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {untrusted.shown(found)} is not supported by mtkit {__version__} "
            f"(it reads format {FORMAT_VERSION})"
        )


# -- averaging ------------------------------------------------------------------------------


def average_checkpoints(paths: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Element-wise mean of the weights of checkpoints of one model and tokenizer.

    Sums are kept in float64, one checkpoint in memory at a time. The metadata is the newest checkpoint's,
    less its validation result (which does not describe the average), plus the list of ``averaged`` paths.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    first = read_checkpoint(paths[0], with_state=False)
    aliases = _aliases(first.weights)
    layout = {k: t.to("meta") for k, t in first.weights.items()}  # names, shapes and dtypes, without the data
    sums = {k: t.double() if t.is_floating_point() else t for k, t in first.weights.items() if k not in aliases}
    newest = first.meta
    for path in paths[1:]:
        ckpt = read_checkpoint(path, with_state=False)
        _check_compatible(ckpt, first, layout)
        for key, total in sums.items():
            if total.is_floating_point():
                total.add_(ckpt.weights[key])
            elif not torch.equal(total, ckpt.weights[key]):
                raise CheckpointError(f"{path}: {key} differs from {paths[0]}, and integer tensors cannot be averaged")
        if ckpt.meta["step"] > newest["step"]:
            newest = ckpt.meta
    weights = {k: (t / len(paths)).to(layout[k].dtype) if t.is_floating_point() else t for k, t in sums.items()}
    weights.update({alias: weights[key] for alias, key in aliases.items()})
    meta = {k: v for k, v in newest.items() if k != "validation"}
    return weights, {**meta, "averaged": [str(p) for p in paths]}


def checkpoints_to_average(inputs: list[Path], last: int | None = None) -> list[Path]:
    """What ``mtkit average`` averages: the newest ``last`` checkpoints of one run directory (by default as many
    as a recipe averages), or two or more checkpoints given one by one."""
    if len(inputs) == 1 and inputs[0].is_dir() and not (inputs[0] / WEIGHTS_FILE).is_file():
        paths = run_checkpoints(inputs[0])[-(last or RecipeConfig.average_last) :]
        if not paths:
            raise CheckpointError(f"{inputs[0]}: no checkpoints to average in {inputs[0] / CHECKPOINTS_DIR}")
        return paths
    if last is not None:
        raise CheckpointError("--last applies to a run directory; give it alone, without checkpoint paths")
    if len(inputs) < 2:
        raise CheckpointError("give one run directory, or two or more checkpoints to average")
    return list(inputs)


def write_average(paths: list[Path], output: Path) -> dict[str, Any]:
    """Average ``paths`` into the .safetensors file ``output``, tokenizers beside it; the average's metadata."""
    weights, meta = average_checkpoints(paths)
    write_model_file(output, weights, meta, paths[0])
    return meta


def _check_compatible(ckpt: Checkpoint, first: Checkpoint, layout: dict[str, torch.Tensor]) -> None:
    """``ckpt`` must be of the model (settings, tokenizer, weight layout) of ``first``."""
    if ckpt.cfg.model != first.cfg.model:
        raise CheckpointError(f"{ckpt.path}: model settings differ from those of {first.path}; cannot average them")
    if ckpt.meta["tokenizer"] != first.meta["tokenizer"]:
        raise CheckpointError(f"{ckpt.path}: tokenizer differs from that of {first.path}; cannot average them")
    check_weights(layout, ckpt.weights, ckpt.path, f"those of {first.path}")


def check_weights(
    expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], path: Path, other: str = "this model"
) -> None:
    """``weights`` have the names, shapes and dtypes of ``expected`` (tensors of any device, meta too).

    A dtype is checked as well as a shape: float32 values read as int32 would load without complaint.
    """
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    if missing or unexpected:
        names = ", ".join([*(f"no {k}" for k in missing[:3]), *(f"an extra {k}" for k in unexpected[:3])])
        raise CheckpointError(f"{path}: its weights are of another architecture than {other} ({names})")
    for key, tensor in expected.items():
        if weights[key].shape != tensor.shape:
            raise CheckpointError(
                f"{path}: its weights do not fit {other}: {key} is {tuple(weights[key].shape)} there, "
                f"{tuple(tensor.shape)} here (another vocabulary or model size)"
            )
        if weights[key].dtype != tensor.dtype:
            raise CheckpointError(
                f"{path}: its weights do not fit {other}: {key} is {weights[key].dtype} there, {tensor.dtype} here"
            )


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """``model.load_state_dict(weights)``, with a one-line CheckpointError naming the first misfit tensor."""
    check_weights(model.state_dict(), weights, path)
    model.load_state_dict(weights)


def model_holding(
    cfg: ModelConfig, src_vocab: int, tgt_vocab: int, weights: dict[str, torch.Tensor], path: Path
) -> Transformer:
    """The model of ``cfg`` with ``weights`` loaded, built only once a skeleton on the meta device shows they fit.

    So a checkpoint header claiming a huge model is refused before any memory is allocated for it.
    """
    with torch.device("meta"):
        skeleton = build_model(cfg, src_vocab, tgt_vocab, PAD_ID)
    check_weights(skeleton.state_dict(), weights, path)
    model = build_model(cfg, src_vocab, tgt_vocab, PAD_ID)
    model.load_state_dict(weights)
    return model


# -- inference ------------------------------------------------------------------------------


TOKENIZER_NAMES = ("spm.model", "spm.src.model", "spm.tgt.model")  # every name a tokenizer file has in mtkit


def tokenizer_files(cfg: RunConfig) -> dict[str, str]:
    """File names of the tokenizer model(s) inside a run directory, by side."""
    if cfg.tokenizer.joint:
        return {"src": TOKENIZER_NAMES[0], "tgt": TOKENIZER_NAMES[0]}
    return {"src": TOKENIZER_NAMES[1], "tgt": TOKENIZER_NAMES[2]}


def _find_tokenizer(record: dict[str, str], where: Path, name: str) -> Path:
    """The tokenizer file ``record`` names, in ``where`` or up to two folders above (RUN/best/ -> RUN).

    The nearest one found must be the very file checkpoint ``name`` was trained with.
    """
    for folder in (where, where.parent, where.parent.parent):
        path = folder / record["file"]
        if path.is_file():
            digest = file_sha256(path)
            if digest != record["sha256"]:
                raise CheckpointError(
                    f"{path}: tokenizer does not match the one {name} was trained with "
                    f"(sha256 {digest[:12]}, expected {record['sha256'][:12]})"
                )
            return path
    raise CheckpointError(f"{where / record['file']}: tokenizer model not found (nor in the two folders above)")


@dataclass
class InferenceBundle:
    model: Transformer
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    cfg: RunConfig
    step: int


def load_for_inference(model_path: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> InferenceBundle:
    """Model in eval mode, its weights cast to ``dtype``, plus the tokenizers it was trained with, checked by hash.

    Decoding in bf16/fp16 casts the weights once, rather than at every step as autocast would.
    """
    ckpt = read_checkpoint(resolve(model_path), with_state=False)
    where = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    toks = {
        side: Tokenizer(_find_tokenizer(record, where, ckpt.path.name))
        for side, record in ckpt.meta["tokenizer"].items()
    }
    model = model_holding(ckpt.cfg.model, toks["src"].vocab_size, toks["tgt"].vocab_size, ckpt.weights, ckpt.path)
    model.to(device=device, dtype=dtype).eval()
    return InferenceBundle(model, toks["src"], toks["tgt"], ckpt.cfg, ckpt.meta["step"])
