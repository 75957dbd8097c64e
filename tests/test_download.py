"""Fetching corpus files: resume, retries, checksums and mirrors, against a loopback HTTP server."""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import captions
import pytest

from mtkit.data import download
from mtkit.data.download import DownloadError, fetch_file, source_url

CUT = 10_000  # bytes an interrupted response sends before the connection goes


@pytest.fixture(scope="module")
def payload() -> bytes:
    """A corpus file as published: 3,000 gzipped German captions, about 24 KB."""
    text = "\n".join(captions.parallel(3_000, seed=3, langs=("de",))["de"]) + "\n"
    return gzip.compress(text.encode(), mtime=0)


@pytest.fixture(scope="module")
def payload_file(payload, tmp_path_factory) -> Path:
    """The payload in a local mirror folder, as multi30k/val.de.gz."""
    path = tmp_path_factory.mktemp("mirror") / "multi30k" / "val.de.gz"
    path.parent.mkdir()
    path.write_bytes(payload)
    return path


@dataclass
class Site:
    """What the loopback server does, and what it saw: one (path, Range header) per request."""

    payload: bytes
    honour_range: bool = True
    first_status: int | None = None  # answer the first request with this status and no body
    cut_first: bool = False  # first request: send CUT bytes of the body, then close the connection
    stall_first: bool = False  # first request: send CUT bytes of the body, then go silent until released
    wrong_range: bool = False  # answer range requests with 206 but the whole file (Content-Range 0-)
    no_length: bool = False  # 200 and 206 answers carry no Content-Length: the body ends when the connection closes
    short_first: int = 0  # the first answer's Content-Length falls this many bytes short of the file
    later_payload: bytes | None = None  # the file after the first request (it changed on the server)
    no_content_range: bool = False  # 206 and 416 answers carry no Content-Range
    range_short_end: bool = False  # 206 answers stop one byte before the end (and their Content-Range says so)
    range_trailer: bytes = b""  # sent after the range in a 206 answer (and counted in its Content-Length)
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    @property
    def ranges(self) -> list[str | None]:
        return [r for _, r in self.requests]


class _Handler(BaseHTTPRequestHandler):
    site: Site

    def do_GET(self) -> None:
        site = self.site
        site.requests.append((self.path, self.headers.get("Range")))
        first = len(site.requests) == 1
        data = site.payload if first or site.later_payload is None else site.later_payload
        if first and site.first_status:
            self.send_error(site.first_status)
            return
        if self.headers.get("Range") and site.honour_range:
            start = int(self.headers["Range"].removeprefix("bytes=").removesuffix("-"))
            if start >= len(data):
                self.send_response(416)
                if not site.no_content_range:
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            if site.wrong_range:
                start = 0
            end = len(data) - 1 - site.range_short_end
            if not site.no_content_range:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            body = data[start : end + 1] + site.range_trailer
        else:
            self.send_response(200)
            body = data
        if not site.no_length:
            self.send_header("Content-Length", str(len(body) - (site.short_first if first else 0)))
        self.end_headers()
        if first and (site.cut_first or site.stall_first):
            self.wfile.write(body[:CUT])
            if site.stall_first:
                site.release.wait(timeout=10)
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch) -> None:
    monkeypatch.setattr(download, "BACKOFF_S", 0.0)


@pytest.fixture
def serve() -> Iterator[Callable[[Site], str]]:
    """Starts loopback servers for sites; returns the URL of val.de.gz on each."""
    running = []

    def start(site: Site) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"site": site}))
        threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
        running.append((server, site))
        return f"http://127.0.0.1:{server.server_address[1]}/multi30k/val.de.gz"

    yield start
    for server, site in running:
        site.release.set()
        server.shutdown()
        server.server_close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_interrupted_transfer_resumes_with_range_and_is_byte_identical(serve, payload, tmp_path, caplog):
    site = Site(payload, cut_first=True)
    url = serve(site)
    dest = tmp_path / "raw" / "val.de.gz"
    with caplog.at_level(logging.INFO, logger="mtkit"):
        assert fetch_file(url, dest, sha256=sha(payload)) == dest
    assert dest.read_bytes() == payload
    assert site.ranges == [None, f"bytes={CUT}-"]
    assert not dest.with_name("val.de.gz.part").exists()
    assert f"downloading {url} → {dest} ({len(payload)} bytes, resuming at byte {CUT})" in caplog.messages
    assert any(m.startswith(f"downloaded {dest}: {len(payload)} bytes in") for m in caplog.messages)


def test_on_a_terminal_a_transfer_shows_its_size_with_the_resumed_part_counted(
    serve, payload, payload_file, tmp_path, caplog, capsys, terminal
):
    def bars(starting: str) -> list[str]:
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith(starting)]

    kib = f"{len(payload) / 1024:.1f}"
    with caplog.at_level(logging.INFO, logger="mtkit"):
        fetch_file(serve(Site(payload, cut_first=True)), tmp_path / "val.de.gz")
        cut, resumed = bars("downloading val.de.gz")
        assert f"/{kib} KiB" in cut and f"100% {kib}/{kib} KiB" in resumed
        fetch_file(str(payload_file), tmp_path / "copy" / "val.de.gz")
        assert f"100% {kib}/{kib} KiB" in bars("copying val.de.gz")[0]


def test_server_ignoring_range_still_yields_the_file(serve, payload, tmp_path):
    site = Site(payload, cut_first=True, honour_range=False)
    dest = fetch_file(serve(site), tmp_path / "val.de.gz")
    assert site.ranges == [None, f"bytes={CUT}-"]  # asked to resume, got 200 and started over
    assert dest.read_bytes() == payload


def test_206_starting_elsewhere_is_discarded_and_fetched_again(serve, payload, tmp_path):
    site = Site(payload, cut_first=True, wrong_range=True)
    dest = fetch_file(serve(site), tmp_path / "val.de.gz")
    assert site.ranges == [None, f"bytes={CUT}-", None]
    assert dest.read_bytes() == payload


def test_complete_part_answered_416_is_verified_and_kept(serve, payload, tmp_path):
    site = Site(payload)
    dest = tmp_path / "val.de.gz"
    dest.with_name("val.de.gz.part").write_bytes(payload)
    fetch_file(serve(site), dest, sha256=sha(payload))
    assert site.ranges == [f"bytes={len(payload)}-"]
    assert dest.read_bytes() == payload


def test_404_fails_at_once_with_a_one_line_error(serve, payload, tmp_path):
    site = Site(payload, first_status=404)
    url = serve(site)
    with pytest.raises(DownloadError) as err:
        fetch_file(url, tmp_path / "val.de.gz")
    message = str(err.value)
    assert url in message and "404" in message and "\n" not in message
    assert len(site.requests) == 1
    assert list(tmp_path.iterdir()) == []


def test_server_error_is_retried(serve, payload, tmp_path):
    site = Site(payload, first_status=503)
    dest = fetch_file(serve(site), tmp_path / "val.de.gz")
    assert len(site.requests) == 2
    assert dest.read_bytes() == payload


def test_silent_server_times_out_and_each_retry_resumes(serve, payload, tmp_path):
    site = Site(payload, stall_first=True)
    dest = tmp_path / "val.de.gz"
    started = time.monotonic()
    fetch_file(serve(site), dest, timeout=0.3, retries=1)
    assert time.monotonic() - started < 3
    assert site.ranges == [None, f"bytes={CUT}-"]
    assert dest.read_bytes() == payload


def test_checksum_mismatch_is_an_error_and_leaves_no_file(serve, payload, tmp_path):
    url = serve(Site(payload))
    dest = tmp_path / "val.de.gz"
    with pytest.raises(DownloadError) as err:
        fetch_file(url, dest, sha256="0" * 64)
    message = str(err.value)
    assert url in message and "0" * 64 in message and sha(payload) in message
    assert list(tmp_path.iterdir()) == []


def test_existing_dest_is_kept_if_its_checksum_matches_and_fetched_again_if_not(serve, payload, tmp_path):
    site = Site(payload)
    url = serve(site)
    dest = tmp_path / "val.de.gz"
    dest.write_bytes(payload)
    fetch_file(url, dest, sha256=sha(payload))
    assert site.requests == []
    dest.write_bytes(b"stale")
    fetch_file(url, dest, sha256=sha(payload))
    assert len(site.requests) == 1
    assert dest.read_bytes() == payload


def test_file_url_is_copied(payload, payload_file, tmp_path):
    dest = fetch_file(payload_file.as_uri(), tmp_path / "val.de.gz", sha256=sha(payload))
    assert not dest.is_symlink() and dest.read_bytes() == payload


def test_resolve_points_at_the_same_basename_in_the_mirror(tmp_path):
    url = "https://example.org/wmt/2014/val.de.gz?download=1"
    assert source_url(url, None) == url
    assert source_url(url, str(tmp_path)) == str(tmp_path / "val.de.gz")
    assert source_url(url, "file:///srv/corpora/") == "file:///srv/corpora/val.de.gz"
    assert source_url(url, "http://mirror.local/mt") == "http://mirror.local/mt/val.de.gz"


def test_local_directory_mirror_is_used_instead_of_the_url(payload, payload_file, tmp_path):
    mirror = str(payload_file.parent)
    dest = fetch_file("https://unreachable.invalid/multi30k/val.de.gz", tmp_path / "val.de.gz", mirror=mirror)
    assert not dest.is_symlink() and dest.read_bytes() == payload
    with pytest.raises(DownloadError, match="no-such.gz: file not found"):
        fetch_file("https://unreachable.invalid/no-such.gz", tmp_path / "x.gz", mirror=str(tmp_path))


def test_http_mirror_is_asked_for_the_basename(serve, payload, tmp_path):
    site = Site(payload)
    mirror = serve(site).rsplit("/", 2)[0] + "/mirror"
    fetch_file("https://unreachable.invalid/multi30k/val.de.gz", tmp_path / "val.de.gz", mirror=mirror)
    assert site.requests == [("/mirror/val.de.gz", None)]


def test_killed_transfer_leaves_only_the_part_and_the_next_fetch_completes_it(serve, payload, tmp_path):
    site = Site(payload, stall_first=True)
    url = serve(site)
    dest = tmp_path / "val.de.gz"
    part = tmp_path / "val.de.gz.part"
    code = f"from mtkit.data.download import fetch_file; fetch_file({url!r}, {str(dest)!r})"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not (part.is_file() and part.stat().st_size == CUT):
            assert child.poll() is None and time.monotonic() < deadline, "the child never received the first bytes"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val.de.gz.part"]
    fetch_file(url, dest, sha256=sha(payload))
    assert site.ranges == [None, f"bytes={CUT}-"]
    assert dest.read_bytes() == payload and not part.exists()


def fetch_again(site: Site, url: str, dest: Path) -> list[str | None]:
    """A second fetch of the same file; returns the Range headers it sent ([] when it kept DEST)."""
    seen = len(site.requests)
    fetch_file(url, dest)
    return site.ranges[seen:]


def test_body_without_length_cut_short_is_resumed_to_the_size_its_range_declares(serve, payload, tmp_path):
    site = Site(payload, no_length=True, cut_first=True)
    url = serve(site)
    dest = fetch_file(url, tmp_path / "val.de.gz")
    assert dest.read_bytes() == payload
    assert site.ranges == [None, f"bytes={CUT}-"]  # an early close looks like the end: the range request tells
    assert fetch_again(site, url, dest) == []


@pytest.mark.parametrize(
    "misbehaviour", [{"honour_range": False}, {"no_content_range": True}], ids=["no-ranges", "416-without-total"]
)
def test_body_whose_size_no_answer_reveals_is_kept_with_a_warning(serve, payload, tmp_path, caplog, misbehaviour):
    site = Site(payload, no_length=True, **misbehaviour)
    url = serve(site)
    with caplog.at_level(logging.WARNING, logger="mtkit"):
        dest = fetch_file(url, tmp_path / "val.de.gz")
    assert site.ranges == [None, f"bytes={len(payload)}-"]
    assert dest.read_bytes() == payload
    assert any("cannot check" in m and url in m for m in caplog.messages)
    assert fetch_again(site, url, dest) == []


@pytest.mark.parametrize("no_content_range", [False, True], ids=["416-with-total", "416-without-total"])
def test_416_to_a_resume_promotes_the_part_only_if_its_total_is_its_size(serve, payload, tmp_path, no_content_range):
    site = Site(payload, no_content_range=no_content_range)
    url = serve(site)
    dest = tmp_path / "val.de.gz"
    dest.with_name("val.de.gz.part").write_bytes(payload + b"junk")  # e.g. left by a fetch of another version
    fetch_file(url, dest)
    assert dest.read_bytes() == payload
    assert site.ranges == [f"bytes={len(payload) + 4}-", None]
    assert fetch_again(site, url, dest) == []


def test_206_without_content_range_is_not_appended(serve, payload, tmp_path):
    site = Site(payload, cut_first=True, wrong_range=True, no_content_range=True)
    url = serve(site)
    dest = fetch_file(url, tmp_path / "val.de.gz")
    assert dest.read_bytes() == payload
    assert site.ranges == [None, f"bytes={CUT}-", None]
    assert fetch_again(site, url, dest) == []


@pytest.mark.parametrize(
    "misbehaviour",
    [{"range_short_end": True}, {"range_trailer": b"junk"}, {"range_trailer": b"junk", "no_length": True}],
    ids=["short-end", "long-body", "long-body-without-length"],
)
def test_206_that_stops_short_of_the_end_or_runs_past_its_range_is_discarded(serve, payload, tmp_path, misbehaviour):
    site = Site(payload, cut_first=True, **misbehaviour)
    url = serve(site)
    dest = fetch_file(url, tmp_path / "val.de.gz")
    assert dest.read_bytes() == payload
    assert site.ranges[:3] == [None, f"bytes={CUT}-", None]  # the part was dropped: the third asks from byte 0
    assert fetch_again(site, url, dest) == []


def test_file_changed_between_the_cut_and_the_resume_is_refused_and_fetched_whole_next_time(serve, payload, tmp_path):
    changed = payload + payload[:100]
    site = Site(payload, cut_first=True, later_payload=changed)
    url = serve(site)
    dest = tmp_path / "val.de.gz"
    with pytest.raises(DownloadError) as err:
        fetch_file(url, dest)
    assert site.ranges == [None, f"bytes={CUT}-"]
    message = str(err.value)
    assert url in message and str(len(payload)) in message and str(len(changed)) in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []
    assert fetch_again(site, url, dest) == [None]
    assert dest.read_bytes() == changed


def test_short_content_length_contradicted_by_a_range_total_is_refused(serve, payload, tmp_path):
    site = Site(payload, cut_first=True, short_first=100)
    url = serve(site)
    dest = tmp_path / "val.de.gz"
    with pytest.raises(DownloadError, match=f"{len(payload) - 100} bytes, then {len(payload)}"):
        fetch_file(url, dest)
    assert site.ranges == [None, f"bytes={CUT}-"]
    assert list(tmp_path.iterdir()) == []
    assert fetch_again(site, url, dest) == [None]
    assert dest.read_bytes() == payload


def test_existing_dest_without_checksum_is_kept_only_if_its_size_was_recorded_by_a_fetch(serve, payload, tmp_path):
    site = Site(payload)
    url = serve(site)
    dest = tmp_path / "val.de.gz"
    dest.write_bytes(payload[:CUT])  # a file no fetch recorded, e.g. a truncated one from an older mtkit
    fetch_file(url, dest)
    assert dest.read_bytes() == payload
    assert site.ranges == [None]
    assert dest.with_name("val.de.gz.size").read_text() == f"{len(payload)}\n"
    assert fetch_again(site, url, dest) == []
    dest.write_bytes(payload[:-1])  # changed since: its size no longer matches the record
    assert fetch_again(site, url, dest) == [None]
    assert dest.read_bytes() == payload


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device that is always full")
def test_failed_copy_leaves_neither_dest_nor_part(payload, payload_file, tmp_path):
    dest = tmp_path / "val.de.gz"
    dest.with_name("val.de.gz.part").symlink_to("/dev/full")  # the copy runs into a full disk
    with pytest.raises(DownloadError) as err:
        fetch_file(str(payload_file), dest)
    assert str(err.value) == f"{payload_file}: cannot copy (No space left on device)"
    assert list(tmp_path.iterdir()) == []
    assert fetch_file(str(payload_file), dest).read_bytes() == payload
