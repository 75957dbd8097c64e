"""Fetching corpus files: the one place mtkit downloads anything for users.

Corpus files are large and servers drop connections, so a download is written to ``DEST.part``,
resumed from there with an HTTP ``Range`` request after a transient failure (or a killed process),
checked against its SHA-256 when one is given, and only then renamed to ``DEST``. A file at ``DEST``
is therefore always complete. Every socket operation has a timeout, so a dead server cannot hang a
data preparation script. Standard library only, so the scripts need nothing beyond mtkit.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

from mtkit import __version__
from mtkit.data import DataError

log = logging.getLogger("mtkit")

BACKOFF_S = 1.0  # retry i waits BACKOFF_S * 2**i seconds; tests set it to 0
_CHUNK = 1 << 16
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class DownloadError(DataError):
    """A file could not be fetched or failed its checksum; the one-line message names the URL or file."""


class _Transient(Exception):
    """A failure worth retrying (dropped connection, timeout, 5xx): the next attempt resumes the part file."""


def resolve(url: str, mirror: str | None) -> str:
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


def fetch(
    url: str,
    dest: Path,
    sha256: str | None = None,
    mirror: str | None = None,
    timeout: float = 60.0,
    retries: int = 3,
) -> Path:
    """Download ``url`` (through ``mirror`` if given) to ``dest`` and return dest.

    An existing ``dest`` that passes the checksum (or any, without one) is kept and nothing is fetched.
    ``timeout`` bounds each socket operation; transient failures are retried ``retries`` times.
    """
    dest = Path(dest)
    source = resolve(url, mirror)
    expected = _check_digest(sha256, source)
    if dest.is_file():
        if expected is None or _sha256(dest) == expected:
            return dest
        log.info("%s: checksum does not match, fetching it again", dest)
        dest.unlink()
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
        actual = _sha256(part)
        if actual != expected:
            part.unlink()
            raise DownloadError(f"{source}: checksum mismatch: expected sha256 {expected}, got {actual}")
    os.replace(part, dest)
    return dest


def _check_digest(sha256: str | None, source: str) -> str | None:
    """Normalised digest; a malformed one fails before a long download rather than after it."""
    if sha256 is None:
        return None
    digest = sha256.strip().lower()
    if not _SHA256.fullmatch(digest):
        raise DownloadError(f"{source}: sha256 must be 64 hex digits, got {sha256!r}")
    return digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _copy(source: Path, part: Path, dest: Path) -> None:
    """Copy a local file (a real copy: a symlink would break when the mirror moves)."""
    log.info("copying %s → %s", source, dest)
    try:
        shutil.copyfile(source, part)
    except FileNotFoundError:
        raise DownloadError(f"{source}: file not found") from None
    except OSError as err:
        raise DownloadError(f"{source}: cannot copy ({err.strerror or err})") from None


def _download(url: str, part: Path, dest: Path, timeout: float, retries: int) -> None:
    """Fetch into ``part``, retrying transient failures with exponential backoff."""
    for attempt in range(retries + 1):
        try:
            _attempt(url, part, dest, timeout)
            return
        except _Transient as err:
            if attempt == retries:
                raise DownloadError(f"{url}: {err} (gave up after {retries + 1} attempts)") from None
            delay = BACKOFF_S * 2**attempt
            log.warning("%s: %s; retry %d of %d in %.0f s", url, err, attempt + 1, retries, delay)
            time.sleep(delay)


def _attempt(url: str, part: Path, dest: Path, timeout: float) -> None:
    """One request, resuming from the bytes already in ``part``; raises _Transient for failures worth retrying."""
    offset = part.stat().st_size if part.is_file() else 0
    headers = {"User-Agent": f"mtkit/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as err:
        err.close()
        if err.code == 416 and offset:
            return  # the part holds the whole file already; the checksum (if any) has the last word
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
            _check_range(response.headers.get("Content-Range"), offset, part)
        elif offset:
            log.info("%s: server ignored the range request; starting over", url)
            offset = 0
        length = response.headers.get("Content-Length")
        remaining = int(length) if length and length.isdigit() else None
        size = f"{offset + remaining} bytes" if remaining is not None else "size unknown"
        resumed = f", resuming at byte {offset}" if offset else ""
        log.info("downloading %s → %s (%s%s)", url, dest, size, resumed)
        start = time.monotonic()
        received = _receive(response, part, append=offset > 0)
    if remaining is not None and received < remaining:
        raise _Transient(f"connection closed after {offset + received} of {offset + remaining} bytes")
    log.info("downloaded %s: %d bytes in %.1f s", dest, offset + received, time.monotonic() - start)


def _check_range(header: str | None, offset: int, part: Path) -> None:
    """A 206 must continue where the part file ends; otherwise the part is discarded and the next try starts over."""
    if header is None:
        return
    match = _CONTENT_RANGE.fullmatch(header.strip())
    if match is None or int(match[1]) != offset:
        part.unlink()
        raise _Transient(f"server answered range {offset}- with Content-Range {header!r}; starting over")


def _receive(response: http.client.HTTPResponse, part: Path, append: bool) -> int:
    """Copy the body into ``part`` as it arrives, so a failure keeps what came; returns the bytes received."""
    received = 0
    with open(part, "ab" if append else "wb") as f:
        try:
            while chunk := response.read1(_CHUNK):  # read1: what has arrived, not a full chunk
                f.write(chunk)
                f.flush()  # a killed process keeps every byte it received, for the next fetch to resume from
                received += len(chunk)
        except (OSError, http.client.HTTPException) as err:  # timeout, reset, IncompleteRead (chunked)
            raise _Transient(f"{err or type(err).__name__} (after {received} bytes of the response)") from None
    return received
