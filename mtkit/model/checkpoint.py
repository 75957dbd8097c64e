"""The checkpoint format: a model's weights and metadata written whole, and read back safely.

A checkpoint (format 2) is a directory. ``model.safetensors`` holds the weights, with the metadata as
JSON in its header: the resolved config, the SHA-256 of each tokenizer model (so a swapped tokenizer is
caught), the update step and extras: the validation result, the SHA-256 of the data files trained on
(so a run does not resume on changed data) and, for a run started from another model
(train.init_from), that model's weights file and its SHA-256. ``state.pt`` holds what resuming
needs (optimizer, scaler, RNG, progress); it is tensors and plain values only and loads with
``torch.load(weights_only=True)``. Nothing in a checkpoint is pickled code. A single .safetensors file
with the tokenizer model(s) beside it (``write_model_file``) is a checkpoint too, of weights only.

A checkpoint directory appears whole or not at all: it is built under a temporary name beside its
final one and renamed into place. Where checkpoints sit in a run directory is run_folder.py's; how a
model path is found and loaded, loading.py's.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch

from mtkit import untrusted
from mtkit.config import ConfigError, RunConfig, from_dict
from mtkit.data.tokenizer import is_sentencepiece_model
from mtkit.errors import MtkitError
from mtkit.files import atomic_write, atomic_write_directory, file_sha256
from mtkit.version import __version__

FORMAT_VERSION = 2
WEIGHTS_FILE, STATE_FILE = "model.safetensors", "state.pt"
TOKENIZER_NAMES = ("spm.model", "spm.src.model", "spm.tgt.model")  # every name a tokenizer file has in mtkit
DATA_FILES = ("train_src", "train_tgt", "valid_src", "valid_tgt")  # the data.* files a header's data_sha256 may name
CORPUS_FILE = re.compile(r"corpora\[\d{1,3}\]\.(train_src|train_tgt|valid_src|valid_tgt)")  # ...and of data.corpora

_META_KEY, _ALIASES_KEY = "mtkit", "mtkit.aliases"  # safetensors header entries


class CheckpointError(MtkitError, ValueError):
    """A checkpoint that is missing, unreadable or inconsistent with its run directory."""


@dataclass
class Checkpoint:
    path: Path  # the checkpoint directory, or the single file it came from
    meta: dict[str, Any]  # format, mtkit_version, config, tokenizer, step, and extras; checked on loading
    cfg: RunConfig  # meta["config"], validated
    weights: dict[str, torch.Tensor]
    state: dict[str, Any] | None  # None when the checkpoint holds weights only, or when not asked for


# -- saving ---------------------------------------------------------------------------------


def tied_aliases(weights: dict[str, torch.Tensor]) -> dict[str, str]:
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


def _encode(weights: dict[str, torch.Tensor], meta: dict[str, Any], extra: dict[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``weights``, with ``meta`` (stamped with the format) in the header, and ``extra``
    header entries beside it (a LoRA checkpoint's adapter record)."""
    aliases = tied_aliases(weights)
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in weights.items() if k not in aliases}
    meta = {**meta, "format": FORMAT_VERSION, "mtkit_version": __version__}
    header = {**(extra or {}), _META_KEY: json.dumps(meta), _ALIASES_KEY: json.dumps(aliases)}
    return safetensors.torch.save(tensors, metadata=header)


def save(
    directory: Path,
    weights: dict[str, torch.Tensor],
    meta: dict[str, Any],
    state: dict[str, Any] | None = None,
    files: dict[str, bytes] | None = None,
    header: dict[str, str] | None = None,
) -> None:
    """Write a checkpoint directory as a whole: a crash leaves the old one or the new one, never a mix.

    ``state`` must hold only tensors and plain values, as it is read back with ``weights_only=True``.
    ``files`` are written beside the weights, by name (an imported model's tokenizers); ``header``, entries of the
    weights file's header beside mtkit's own (a LoRA checkpoint's adapter record: mtkit.model.adapter_file).
    """
    data = _encode(weights, meta, header)

    def fill(tmp: Path) -> None:
        for name, content in (files or {}).items():
            (tmp / name).write_bytes(content)
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
        found = find_tokenizer(record, where, source.name)
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


# -- tokenizers -----------------------------------------------------------------------------


def tokenizer_files(cfg: RunConfig) -> dict[str, str]:
    """File names of the tokenizer model(s) inside a run directory, by side."""
    if cfg.tokenizer.joint:
        return {"src": TOKENIZER_NAMES[0], "tgt": TOKENIZER_NAMES[0]}
    return {"src": TOKENIZER_NAMES[1], "tgt": TOKENIZER_NAMES[2]}


def tokenizer_folders(where: Path) -> tuple[Path, Path, Path]:
    """Where a checkpoint's tokenizers are looked for: beside it and up to two folders above (RUN/best/ -> RUN)."""
    return where, where.parent, where.parent.parent


def find_tokenizer(record: dict[str, str], where: Path, name: str) -> Path:
    """The tokenizer file ``record`` names, the nearest in ``tokenizer_folders(where)``.

    The nearest one found must be the very file checkpoint ``name`` was trained with.
    """
    for folder in tokenizer_folders(where):
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


# -- weights ------------------------------------------------------------------------------


def weights_file(model: Path) -> Path:
    """The file holding a model's weights: a checkpoint directory's model.safetensors, or the file itself."""
    return model / WEIGHTS_FILE if model.is_dir() else model


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of a model's weights as tensors: each one's name, dtype and shape, then its bytes, in the order of
    their names. What a LoRA adapter records of the base it adapts: it tells the base by its values, whatever
    metadata (config, step, mtkit's version) the file holding them carries."""
    return _digest(weights, weights.__getitem__)


def stored_weights_digest(path: Path) -> str:
    """``weights_digest`` of the weights the checkpoint file ``path`` holds (its tied names too), read one tensor at
    a time: a model need not be in memory twice to be told by its digest."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            aliases = untrusted.mapping(json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}")), "its aliases")
            stored = {name: name for name in f.keys()}
            names = {**stored, **{alias: stored[key] for alias, key in aliases.items()}}
            return _digest(names, lambda name: f.get_tensor(names[name]))
    except Exception as err:  # safetensors, json and odd metadata raise different types
        raise _unreadable(path, err) from None


def _digest(names: Iterable[str], tensor: Callable[[str], torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(names):
        value = tensor(name).detach().to("cpu").contiguous()
        described = json.dumps([name, str(value.dtype).removeprefix("torch."), list(value.shape)])
        digest.update(described.encode("utf-8") + b"\n")
        digest.update(value.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


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


def check_finite(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Every floating-point weight is finite: one NaN or infinity makes every translation garbage, or breaks the
    search, so such a file is refused by name rather than loaded."""
    for key, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: weight {key} holds NaN or infinite values; such a model cannot translate")


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """``model.load_state_dict(weights)``, with a one-line CheckpointError naming the first misfit tensor."""
    check_weights(model.state_dict(), weights, path)
    model.load_state_dict(weights)


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
    state = load_torch_file(state_path) if with_state and state_path.is_file() else None
    return Checkpoint(directory, meta, cfg, weights, state)


def read_meta(path: Path) -> tuple[dict[str, Any], RunConfig]:
    """The metadata and config of a checkpoint (a folder or a .safetensors file), checked as ``read_checkpoint``
    checks them, without reading its weights."""
    path = weights_file(Path(path))
    meta, _ = _read_weights(path, tensors=False)
    return meta, _check_meta(path, meta)


def _read_weights(path: Path, tensors: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            if _META_KEY not in header:
                raise CheckpointError(f"{path}: not an mtkit checkpoint (no {_META_KEY!r} entry in its header)")
            meta = json.loads(header[_META_KEY])
            _check_format(path, meta.get("format") if isinstance(meta, dict) else None)
            weights = {key: f.get_tensor(key) for key in f.keys()} if tensors else {}
            aliases = json.loads(header.get(_ALIASES_KEY, "{}")) if tensors else {}
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
    check_finite(weights, path)
    return meta, weights


def _check_meta(path: Path, meta: Any) -> RunConfig:
    """The config of a checkpoint whose metadata has the form mtkit writes; CheckpointError otherwise.

    The tokenizer records may name only the files a run directory of that config holds (never a
    path), with their SHA-256; the step is a count; the config passes every check of mtkit.config.
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
        digests = untrusted.mapping(meta.get("data_sha256", {}), "data_sha256")
        for name, digest in digests.items():
            if name not in DATA_FILES and CORPUS_FILE.fullmatch(name) is None:
                raise untrusted.Malformed(f"data_sha256 names {untrusted.shown(name)}, not a data file")
            untrusted.sha256(digest, f"data_sha256.{name}")
        if "init" in meta:
            init = untrusted.mapping(meta["init"], "init", required=("path", "sha256"), optional=())
            untrusted.string(init["path"], "init.path")
            untrusted.sha256(init["sha256"], "init.sha256")
        if "imported" in meta:
            imported = untrusted.mapping(meta["imported"], "imported", required=("source", "sha256"))
            for key, value in imported.items():
                untrusted.string(value, f"imported.{key}")
    except (untrusted.Malformed, ConfigError) as err:
        raise CheckpointError(f"{path}: malformed checkpoint header: {err}") from None
    return cfg


def load_torch_file(path: Path) -> Any:
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
