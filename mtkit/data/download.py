"""Fetching corpus files: the one place mtkit downloads anything for users.

Corpus files are large and servers drop connections, so a download is written to ``DEST.part``,
resumed from there with an HTTP ``Range`` request after a transient failure (or a killed process),
checked, and only then renamed to ``DEST``. Every socket operation has a timeout, so a dead server
cannot hang a data preparation script. Standard library only, so the scripts need nothing beyond mtkit.

The check. The file's size is learned from the server's answers: a 200's Content-Length, the total
of a 206's ``Content-Range: bytes START-END/TOTAL`` or of a 416's ``Content-Range: bytes */TOTAL``.
The part becomes ``DEST`` only at exactly that size: a shorter part is resumed, a longer one is
discarded. A 206 is appended only if its range starts at the part's end and ends at the file's last
byte, with a body of exactly that range; a 416 to a resume promotes the part only if its total is
the part's size; anything else discards the part, and the retry fetches the file from its start.
Two sizes that disagree within one fetch (the file changed on the server, or the server misstates
its size) fail the fetch and discard the part. With a SHA-256 the checksum is checked last.

The limits, without a SHA-256. A body with neither Content-Length nor chunked encoding ends when
the server closes the connection, so an early close looks like the end: mtkit then asks for the
bytes after it, and the answer either completes the part (206) or confirms its size (416 with its
total); where the answer reveals no size (a 200 again without length, or a 416 without total) the
body is kept as it came, with a warning. A Content-Length that falls short of the file yields a
body complete by HTTP's rules, caught only when a later Content-Range total contradicts it. With a
SHA-256, nothing that fails it is ever kept.

An existing ``DEST`` is kept if it passes the checksum or, without one, if ``DEST.size`` (which a
fetch without one writes after renaming the part) records its current size; otherwise it is
fetched again, and replaced only by a complete copy. A local file or ``file://`` URL is copied to
the part and renamed; a failed copy leaves neither.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mtkit.data.parallel import DataError
from mtkit.files import file_sha256
from mtkit.progress import StageProgress
from mtkit.version import __version__

log = logging.getLogger("mtkit")

BACKOFF_S = 1.0  # retry i waits BACKOFF_S * 2**i seconds; tests set it to 0
_CHUNK = 1 << 16
_COPY_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LENGTH = re.compile(r"[0-9]+")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)")
_UNSATISFIED_RANGE = re.compile(r"bytes \*/([0-9]+)")


class DownloadError(DataError):
    """A file could not be fetched or failed its checksum; the one-line message names the URL or file."""


class _Transient(Exception):
    """A failure worth retrying (dropped connection, timeout, 5xx): the next attempt resumes the part file."""


@dataclass
class _Learned:
    """What one fetch has learned about the file, carried from each request to the next."""

    total: int | None = None  # the file's size in bytes, as the server declared it
    unsized: bool = False  # the part holds a whole body that ended when the server closed the connection

    def forget(self, part: Path) -> None:
        """Discard the part and what was learned with it, so that the next request starts the file over."""
        part.unlink(missing_ok=True)
        self.total, self.unsized = None, False

    def learn(self, total: int | None, url: str, part: Path) -> None:
        """Take a declared size; one that contradicts an earlier one means the part may mix two files."""
        if total is None:
            return
        if self.total is not None and total != self.total:
            earlier = self.total
            self.forget(part)
            raise DownloadError(
                f"{url}: the server declared {earlier} bytes, then {total}: "
                "the file changed or the server misstates its size; the next fetch starts it over"
            )
        self.total = total


def source_url(url: str, mirror: str | None) -> str:
    """Where to fetch ``url`` from: itself, or with a mirror (a local directory, a file:// URL, or an http(s) base
    URL) the file of the same basename there (mirror/<basename of url path>)."""
    if mirror is None:
        return url
    name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlparse(url).path)).name
    if not name:
        raise DownloadError(f"{url}: no file name in the URL to look up in mirror {mirror}")
    if urllib.parse.urlparse(mirror).scheme in ("http", "https", "file"):
        return f"{mirror.rstrip('/')}/{urllib.parse.quote(name)}"
    return str(Path(mirror) / name)


def fetch_file(
    url: str,
    dest: Path,
    sha256: str | None = None,
    mirror: str | None = None,
    timeout: float = 60.0,
    retries: int = 3,
) -> Path:
    """Download ``url`` (through ``mirror`` if given) to ``dest`` and return dest.

    An existing ``dest`` known to be complete (see the module docstring) is kept and nothing is fetched.
    ``timeout`` bounds each socket operation; transient failures are retried ``retries`` times.
    """
    dest = Path(dest)
    source = source_url(url, mirror)
    expected = _check_digest(sha256, source)
    if dest.is_file() and _known_complete(dest, expected):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    scheme = urllib.parse.urlparse(source).scheme
    if scheme in ("http", "https"):
        _download(source, part, dest, timeout, retries)
    elif scheme == "file":
        _copy(Path(urllib.request.url2pathname(urllib.parse.urlparse(source).path)), part, dest)
    elif len(scheme) <= 1:  # a plain path (one letter: a Windows drive)
        _copy(Path(source), part, dest)
    else:
        raise DownloadError(f"{source}: unsupported URL scheme {scheme!r} (use http, https, file or a path)")
    if expected is not None:
        actual = file_sha256(part)
        if actual != expected:
            part.unlink()
            raise DownloadError(f"{source}: checksum mismatch: expected sha256 {expected}, got {actual}")
    os.replace(part, dest)
    if expected is None:
        _size_record(dest).write_text(f"{dest.stat().st_size}\n", encoding="ascii")
    return dest


def _known_complete(dest: Path, expected: str | None) -> bool:
    """Whether an existing ``dest`` is known complete: by its checksum, or without one by the size its fetch
    recorded (a file no fetch recorded may be a truncated one from an older mtkit, or a stray one)."""
    if expected is not None:
        if file_sha256(dest) == expected:
            return True
        log.info("%s: checksum does not match, fetching it again", dest)
        dest.unlink()
        return False
    if _recorded_size(dest) == dest.stat().st_size:
        return True
    log.info("%s: no record of a complete fetch of this size, fetching it again", dest)
    return False


def _size_record(dest: Path) -> Path:
    return dest.with_name(dest.name + ".size")


def _recorded_size(dest: Path) -> int | None:
    try:
        text = _size_record(dest).read_text(encoding="ascii").strip()
    except (OSError, ValueError):  # missing, unreadable, not ASCII
        return None
    return int(text) if _LENGTH.fullmatch(text) else None


def _check_digest(sha256: str | None, source: str) -> str | None:
    """Normalised digest; a malformed one fails before a long download rather than after it."""
    if sha256 is None:
        return None
    digest = sha256.strip().lower()
    if not _SHA256.fullmatch(digest):
        raise DownloadError(f"{source}: sha256 must be 64 hex digits, got {sha256!r}")
    return digest


def _copy(source: Path, part: Path, dest: Path) -> None:
    """Copy a local file (a real copy: a symlink would break when the mirror moves), in chunks, so that a
    large one shows its progress."""
    log.info("copying %s → %s", source, dest)
    try:
        with open(source, "rb") as src, open(part, "wb") as out:
            size = os.fstat(src.fileno()).st_size
            with StageProgress(f"copying {dest.name}", total=size, unit="bytes", log_ends=False) as bar:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)
                    bar.advance(len(chunk))
    except OSError as err:
        part.unlink(missing_ok=True)  # a copy is not resumed: a partial one is of no use
        problem = "file not found" if isinstance(err, FileNotFoundError) else f"cannot copy ({err.strerror or err})"
        raise DownloadError(f"{source}: {problem}") from None


def _download(url: str, part: Path, dest: Path, timeout: float, retries: int) -> None:
    """Fetch into ``part`` until it holds the whole file, retrying transient failures with exponential backoff."""
    learned = _Learned()
    failures = 0
    while True:
        try:
            if _attempt(url, part, dest, timeout, learned):
                return
        except _Transient as err:
            if failures == retries:
                raise DownloadError(f"{url}: {err} (gave up after {retries + 1} attempts)") from None
            delay = BACKOFF_S * 2**failures
            failures += 1
            log.warning("%s: %s; retry %d of %d in %.0f s", url, err, failures, retries, delay)
            time.sleep(delay)


def _attempt(url: str, part: Path, dest: Path, timeout: float, learned: _Learned) -> bool:
    """One request, resuming from the bytes already in ``part``: True once the part holds the whole file, False
    when its size is still unknown (the next request asks what follows it). Raises _Transient for failures worth
    retrying."""
    offset = part.stat().st_size if part.is_file() else 0
    resuming = offset > 0 or learned.unsized
    headers = {"User-Agent": f"mtkit/{__version__}"}
    if resuming:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as err:
        err.close()
        if err.code == 416 and resuming:
            return _check_unsatisfied(url, err.headers.get("Content-Range"), offset, part, learned)
        if err.code >= 500 or err.code in (408, 429):
            raise _Transient(f"HTTP {err.code} {err.reason}") from None
        raise DownloadError(f"{url}: HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, OSError):  # refused, reset, timed out, name lookup failed
            raise _Transient(str(err.reason)) from None
        raise DownloadError(f"{url}: {err.reason}") from None
    except (OSError, http.client.HTTPException) as err:  # e.g. the server closed before answering
        raise _Transient(str(err) or type(err).__name__) from None
    with response:
        if response.status == 206:
            _check_range(url, response.headers, offset, part, learned)
        elif learned.unsized and _length(response.headers) is None and not _chunked(response.headers):
            return _keep_unsized(url, offset, "a 200 without length")
        else:
            if resuming:
                log.info("%s: server ignored the range request; starting over", url)
                offset = 0
            learned.learn(_length(response.headers), url, part)
        learned.unsized = False
        size = f"{learned.total} bytes" if learned.total is not None else "size unknown"
        resumed = f", resuming at byte {offset}" if offset else ""
        log.info("downloading %s → %s (%s%s)", url, dest, size, resumed)
        start = time.monotonic()
        limit = None if learned.total is None else learned.total - offset
        with StageProgress(f"downloading {dest.name}", learned.total, "bytes", done=offset, log_ends=False) as bar:
            received = _receive(response, part, append=offset > 0, limit=limit, bar=bar)
        chunked = _chunked(response.headers)
    if not _whole(url, part, offset + received, chunked, learned):
        return False
    log.info("downloaded %s: %d bytes in %.1f s", dest, offset + received, time.monotonic() - start)
    return True


def _length(headers: http.client.HTTPMessage) -> int | None:
    value = headers.get("Content-Length")
    return int(value) if value is not None and _LENGTH.fullmatch(value.strip()) else None


def _chunked(headers: http.client.HTTPMessage) -> bool:
    """Whether the body is chunked: http.client then raises IncompleteRead if the connection closes early."""
    return headers.get("Transfer-Encoding", "").strip().lower() == "chunked"


def _check_unsatisfied(url: str, header: str | None, offset: int, part: Path, learned: _Learned) -> bool:
    """A 416 to a resume says the part reaches the file's end or beyond; its total tells which. Without a total
    the part is discarded, unless it holds one whole body whose size no answer has revealed."""
    match = _UNSATISFIED_RANGE.fullmatch((header or "").strip())
    if match is None and learned.unsized:
        return _keep_unsized(url, offset, "a 416 without total")
    learned.learn(int(match[1]) if match else None, url, part)
    if match is None or int(match[1]) != offset:
        learned.forget(part)
        declared = _quoted("Content-Range", header)
        raise _Transient(f"HTTP 416 to a resume at byte {offset} with {declared}; starting over")
    return True


def _keep_unsized(url: str, size: int, answer: str) -> bool:
    """Keep a whole body whose size no answer reveals: without a checksum, the limit of what can be checked."""
    log.warning(
        "%s: no size declared, and %s to a Range request for what follows: cannot check that the %d bytes "
        "received are the whole file",
        url,
        answer,
        size,
    )
    return True


def _check_range(url: str, headers: http.client.HTTPMessage, offset: int, part: Path, learned: _Learned) -> None:
    """A 206 must continue the part to the file's last byte, with a body of that length; otherwise the part is
    discarded and the next try starts over."""
    header = headers.get("Content-Range")
    match = _CONTENT_RANGE.fullmatch((header or "").strip())
    length = _length(headers)
    total = int(match[3]) if match else 0
    if match is None or (int(match[1]), int(match[2])) != (offset, total - 1) or length not in (None, total - offset):
        learned.forget(part)
        declared = _quoted("Content-Range", header) + ("" if length is None else f", Content-Length {length}")
        raise _Transient(f"server answered range {offset}- with {declared}; starting over")
    learned.learn(total, url, part)


def _quoted(name: str, value: str | None) -> str:
    return f"{name} {value!r}" if value is not None else f"no {name}"


def _receive(
    response: http.client.HTTPResponse, part: Path, append: bool, limit: int | None, bar: StageProgress
) -> int:
    """Copy the body into ``part`` as it arrives, so a failure keeps what came; returns the bytes received. Stops
    once more than ``limit`` bytes came: the body is then longer than declared."""
    received = 0
    with open(part, "ab" if append else "wb") as f:
        try:
            while chunk := response.read1(_CHUNK):  # read1: what has arrived, not a full chunk
                f.write(chunk)
                f.flush()  # a killed process keeps every byte it received, for the next fetch to resume from
                received += len(chunk)
                bar.advance(len(chunk))
                if limit is not None and received > limit:
                    break
        except (OSError, http.client.HTTPException) as err:  # timeout, reset, IncompleteRead (chunked)
            raise _Transient(f"{err or type(err).__name__} (after {received} bytes of the response)") from None
    return received


def _whole(url: str, part: Path, size: int, chunked: bool, learned: _Learned) -> bool:
    """Whether the part of ``size`` bytes is the whole file. With no size declared, a chunked body is (its last
    chunk marks the end); a body that ended with the connection is not known to be, and the next request asks."""
    if learned.total is None:
        if not chunked:
            learned.unsized = True
            log.info("%s: %d bytes and no declared size; asking whether more follows", url, size)
        return chunked
    if size > learned.total:
        total = learned.total
        learned.forget(part)
        raise _Transient(f"received more than the {total} bytes declared; starting over")
    if size < learned.total:
        raise _Transient(f"connection closed after {size} of {learned.total} bytes")
    return True
