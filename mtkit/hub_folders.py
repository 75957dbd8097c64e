"""Where a transformers model's files come from, and reading its JSON files within bounds.

Any import of a transformers model (a folder as ``save_pretrained`` writes it, or a Hugging Face Hub
repository) finds its files the same way, refuses links leading out of its folder (as COMET's reader does
too), and reads config.json, generation_config.json and tokenizer_config.json as untrusted files of bounded
size; what the model's config.json means is the importer's own, but for generate's beam and length penalty,
which every family records alike (``read_decoding``). The Hub is reached through huggingface_hub, at a
revision, and its files are kept in its cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mtkit import untrusted
from mtkit.config import MAX_LENPEN, DecodeConfig
from mtkit.errors import MtkitError

MAX_JSON_BYTES = 1 << 20  # config.json, generation_config.json, tokenizer_config.json: a few KiB each
MAX_IMPORTED_BEAM = 64  # the largest num_beams recorded as decode.beam: generate's are 4 to 12
GENERATE_LENGTH_PENALTY = 1.0  # transformers' length_penalty where a model's files give none
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first found is read
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


class ModelImportError(MtkitError, ValueError):
    """A model folder or Hub repository that mtkit cannot import; the message names the file and field."""


# -- finding the folder ---------------------------------------------------------------------


def locate(
    source: str, revision: str | None, tokenizer_files: tuple[str, ...]
) -> tuple[Path, tuple[Path, ...], dict[str, str]]:
    """The folder holding ``source``'s files, the folders its files' links may lead into, and what the import
    records of it: a local folder (by name only, never its path; links stay inside it), a snapshot in
    huggingface_hub's cache given by its path, or a Hub repository id downloaded at ``revision`` (for these two the
    id and commit are recorded, and links may lead into the repository's blobs/, where the cache keeps the files a
    snapshot links to). A download fetches the config files, ``tokenizer_files`` and one weights file."""
    path = Path(source)
    if path.is_dir():
        if revision is not None:
            raise ModelImportError(f"{source}: --revision applies to Hub repositories, and this is a local folder")
        cached = cache_snapshot(path)
        if cached is None:
            return path, (path,), {"source": path.resolve().name}
        repo_id, blobs = cached
        return path, (path, blobs), {"source": f"hf:{repo_id}", "revision": path.resolve().name}
    if not _REPO_ID.fullmatch(source):
        raise ModelImportError(f"{source}: no such folder, nor a Hub repository id (OWNER/NAME)")
    folder = _download(source, revision, tokenizer_files)
    return folder, (folder, folder.parent.parent / "blobs"), {"source": f"hf:{source}", "revision": folder.name}


def cache_snapshot(folder: Path) -> tuple[str, Path] | None:
    """The Hub id and blobs/ folder of ``folder`` when it is a snapshot in huggingface_hub's cache
    (``models--OWNER--NAME/snapshots/REVISION``, whose files are links into ``models--OWNER--NAME/blobs/``);
    None for any other folder."""
    real = folder.resolve()
    repo = real.parent.parent
    name = re.fullmatch(r"models--([\w.-]+?)--([\w.-]+)", repo.name)
    if real.parent.name != "snapshots" or name is None or not (repo / "blobs").is_dir():
        return None
    repo_id = f"{name[1]}/{name[2]}"
    return (repo_id, repo / "blobs") if _REPO_ID.fullmatch(repo_id) else None


def check_inside(
    path: Path, roots: tuple[Path, ...], hint: str = "", error: type[MtkitError] = ModelImportError
) -> None:
    """Refuse ``path`` (as ``error``) when it is a link (or lies in a linked folder) leading out of ``roots``: a
    reader reads the model's files, never what a link in a downloaded folder points to elsewhere. ``hint`` ends
    the error."""
    real = path.resolve()
    if not any(real.is_relative_to(root.resolve()) for root in roots):
        raise error(f"{path}: a link to {real}, outside {roots[0]}; only the model's own files are read{hint}")


def check_links(folder: Path, roots: tuple[Path, ...], names: tuple[str, ...], local: bool) -> None:
    """Each of ``names`` present in ``folder`` (a link too, even a broken one) stays inside ``roots``; the error
    for a ``local`` folder says how to import a copy holding the files its links name."""
    hint = (
        f": copy the folder with the files its links name (cp -rL {folder} COPY) and import the copy" if local else ""
    )
    for name in names:
        if (folder / name).exists() or (folder / name).is_symlink():
            check_inside(folder / name, roots, hint)


def _download(repo_id: str, revision: str | None, tokenizer_files: tuple[str, ...]) -> Path:
    """The repository's snapshot in huggingface_hub's cache: configs, tokenizer files and one weights file."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelImportError(
            "importing from the Hub needs huggingface_hub: pip install -e '.[hf]' in mtkit's clone"
        ) from None
    wanted = [*CONFIG_FILES, *tokenizer_files]
    try:
        folder = Path(
            huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=[*wanted, WEIGHT_FILES[0]])
        )
        if not (folder / WEIGHT_FILES[0]).is_file():  # older repositories hold pytorch_model.bin only
            folder = Path(
                huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=[WEIGHT_FILES[1]])
            )
    except LocalEntryNotFoundError:
        raise ModelImportError(
            f"hf:{repo_id}: not in the local Hugging Face cache, and the Hub cannot be reached (HF_HUB_OFFLINE?)"
        ) from None
    except HfHubHTTPError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelImportError(f"hf:{repo_id}: {first}") from None
    except (ValueError, OSError) as err:  # a malformed repository id or revision, a full disk
        raise ModelImportError(f"hf:{repo_id}: {err}") from None
    return folder


# -- reading --------------------------------------------------------------------------------


def read_json(path: Path, limit: int, why: str = "such a file may have") -> Any:
    """The JSON value of ``path``, refused unread when over ``limit`` bytes (``why`` says where the bound comes
    from)."""
    if path.stat().st_size > limit:
        raise ModelImportError(f"{path}: {path.stat().st_size:,} bytes, more than the {limit:,} {why}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSON, UTF-8 or nesting
        raise ModelImportError(f"{path}: not readable JSON ({str(err)[:200]})") from None


def read_mapping(path: Path, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON file holding an object, as config.json and its siblings do."""
    value = read_json(path, limit)
    if not isinstance(value, dict):
        raise ModelImportError(f"{path}: must hold a JSON object, got {untrusted.shown(value)}")
    return value


def config_field(config: dict[str, Any], name: str, path: Path, kind: type, default: Any = None, low: int = 0) -> Any:
    """``config[name]`` checked to be of ``kind`` (an int in [low, 2**31)), or ``default`` when absent."""
    value = config.get(name, default)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and ok:
        ok = low <= value < 2**31
    if not ok:
        raise ModelImportError(
            f"{path}: {name} must be {kind.__name__}{f' >= {low}' if kind is int else ''}, got {untrusted.shown(value)}"
        )
    return value


def read_decoding(folder: Path) -> tuple[int, float]:
    """generate's num_beams and length_penalty, as decode.beam and decode.lenpen: generation_config.json's, else
    config.json's (where transformers before 4.26 saved them), else mtkit's beam and transformers' length
    penalty. ModelImportError naming the file for a value mtkit cannot hold."""
    files = (folder / "generation_config.json", folder / "config.json")
    configs = [(path, read_mapping(path)) for path in files if path.is_file()]

    def setting(name: str, default: Any) -> tuple[Path | None, Any]:
        return next(((path, c[name]) for path, c in configs if c.get(name) is not None), (None, default))

    path, beam = setting("num_beams", DecodeConfig.beam)
    if isinstance(beam, bool) or not isinstance(beam, int) or not 1 <= beam <= MAX_IMPORTED_BEAM:
        raise ModelImportError(
            f"{path}: num_beams {untrusted.shown(beam)} is not a whole number from 1 to {MAX_IMPORTED_BEAM}"
        )
    path, lenpen = setting("length_penalty", GENERATE_LENGTH_PENALTY)
    if isinstance(lenpen, bool) or not isinstance(lenpen, (int, float)) or not 0 <= lenpen <= MAX_LENPEN:
        raise ModelImportError(
            f"{path}: length_penalty {untrusted.shown(lenpen)} is not a number from 0 to {MAX_LENPEN} "
            "(mtkit's decode.lenpen)"
        )
    return beam, float(lenpen)
