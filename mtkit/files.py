"""Files that appear whole or not at all: written beside their final name, fsynced, then renamed.

A crash (or SIGKILL) at any moment leaves the old file or the new one, never a torn one; a folder
is swapped in the same way, the old one set aside first and put back if the new one never arrived.
An output is checked before any work (``check_output_file``), so a command never writes over what it reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from mtkit.errors import MtkitError


def atomic_write(path: Path, write, partial: Path | None = None) -> None:
    """Call ``write(file_object)`` on a temporary file beside ``path``, fsync it, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never a torn one. With ``partial``,
    a ``write`` interrupted by KeyboardInterrupt keeps what it wrote so far there instead of losing it.
    A symlink is followed, as shell redirection follows it: the file it points to is replaced.
    """
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming(path, tmp=Path(tmp)), os.fdopen(fd, "wb") as f:
            try:
                write(f)
            except KeyboardInterrupt:
                if partial is not None:
                    f.flush()
                    os.fsync(f.fileno())
                    _publish(Path(tmp), Path(partial))
                raise
            f.flush()
            os.fsync(f.fileno())
        with naming(path, tmp=Path(tmp)):
            _publish(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def naming(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """An error of the file system raised inside names ``path`` where it names no file (a write or an fsync to a full
    disk: "[Errno 28] No space left on device"), or names ``tmp``, the temporary file or folder written in its place,
    whose name means nothing to the user (a file in that folder is named as it will be in ``path``)."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.strerror is None:  # OSError("text"), as shutil.rmtree raises: text kept
            raise OSError(err.errno, " ".join(map(str, err.args)) or type(err).__name__, str(path)) from err
        if err.filename is None:
            err.filename = str(path)
        elif (
            tmp is not None
            and isinstance(err.filename, str | bytes)
            and Path(os.fsdecode(err.filename)).is_relative_to(tmp)
        ):
            err.filename = str(path / Path(os.fsdecode(err.filename)).relative_to(tmp))
        raise


def os_error_line(err: OSError) -> str:
    """'PATH: reason' for an error of the file system (disk full, permission denied, ...); 'PATH -> PATH2: reason'
    for one of a rename."""
    reason = err.strerror or " ".join(map(str, err.args)) or type(err).__name__  # OSError("text"): no strerror
    names = list(dict.fromkeys(os.fsdecode(name) for name in (err.filename, err.filename2) if name is not None))
    return f"{' -> '.join(names)}: {reason}" if names else reason


def _publish(tmp: Path, path: Path) -> None:
    """Rename a finished temporary file to ``path``, durably."""
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file ordinary permissions
    os.replace(tmp, path)
    fsync_path(path.parent)  # make the rename itself durable


def fsync_path(path: Path) -> None:
    """Make a file's content, or a folder's entries, durable; an error names ``path``."""
    with naming(path):
        fd = os.open(path, os.O_RDONLY)
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


def copy_file(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` atomically: a crash never leaves a torn copy that passes for the file."""
    with open(source, "rb") as f:
        atomic_write(target, lambda out: shutil.copyfileobj(f, out))


def atomic_write_directory(directory: Path, fill) -> None:
    """Call ``fill(tmp)`` on a temporary folder beside ``directory``, fsync it all, then swap it in whole.

    Folders an earlier crash left beside ``directory`` are cleaned up first. A symlink is followed, as
    ``atomic_write`` follows one: the folder it points to is replaced, and the link kept.
    """
    directory = Path(os.path.realpath(directory)) if Path(directory).is_symlink() else Path(directory)
    with naming(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(directory)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        with naming(directory, tmp=tmp):
            fill(tmp)
            for path in tmp.iterdir():
                if path.is_file():  # some writers (transformers' save_pretrained) make files 0600, as mkstemp does
                    os.chmod(path, 0o666 & ~_umask())
                fsync_path(path)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
            fsync_path(tmp)
            _swap_in(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_leftovers(directory: Path) -> None:
    """Delete temporary and set-aside copies of ``directory`` that an earlier crash left behind.

    A crash between the two renames of ``_swap_in`` leaves no ``directory`` but its set-aside copy:
    that copy is whole, so it is put back first.
    """
    restore_set_aside(directory)
    for path in directory.parent.iterdir():
        if path.name.startswith(f".{directory.name}.") and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def set_aside(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.old")


def restore_set_aside(directory: Path) -> None:
    old = set_aside(directory)
    if not directory.exists() and old.is_dir():
        os.rename(old, directory)
        fsync_path(directory.parent)


def _swap_in(tmp: Path, directory: Path) -> None:
    """Rename the finished ``tmp`` to ``directory``; an existing one is set aside first and deleted last."""
    if not directory.exists():
        os.rename(tmp, directory)
        fsync_path(directory.parent)
        return
    old = set_aside(directory)
    os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    fsync_path(directory.parent)
    shutil.rmtree(old)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks: checkpoint weights can be large to hold twice."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# -- outputs --------------------------------------------------------------------------------


class OutputError(MtkitError, ValueError):
    """An output path that cannot or must not be written; the command has done nothing yet."""


def check_output_file(path: Path, inputs: Mapping[Path, Iterable[Path]], checkpoints: Sequence[Path] = ()) -> None:
    """Fail before any work if ``path`` must not be written: OutputError naming it and why.

    Refused: a folder, a path in a missing folder, a file inside one of ``checkpoints`` (the checkpoint
    directories writing it would write into), a file without write permission, and one of ``inputs`` (or a
    link to one), whose content the command still needs and the user would lose. ``inputs`` maps each input
    to the files it is read from besides itself: for a model, its weights and tokenizers.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a folder; give a file to write")
    if not path.parent.is_dir():
        raise OutputError(f"{path}: cannot write it, folder {path.parent} does not exist")
    check_outside_checkpoints(path, checkpoints)
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OutputError(f"{path}: is read-only; remove it or choose another output")
        for source, read_from in inputs.items():
            source = Path(source)
            if source.exists() and os.path.samefile(path, source):
                also = "" if str(source) == str(path) else f" ({source})"
                raise OutputError(f"{path}: is also an input{also}; write the output to another file")
            if any(os.path.samefile(path, file) for file in read_from):
                raise OutputError(f"{path}: the model {source} is read from it; write the output to another file")


def check_outside_checkpoints(path: Path, checkpoints: Sequence[Path]) -> None:
    """OutputError if writing ``path`` (a file, or a folder made whole) would write into one of ``checkpoints``.

    A checkpoint directory is saved whole: a file written there would leave a checkpoint whose files no
    longer belong together, or be lost when the next save replaces it.
    """
    if checkpoints:
        raise OutputError(f"{path}: is inside the checkpoint {checkpoints[0]}; write it elsewhere")
