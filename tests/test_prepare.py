"""`mtkit prepare` and data_scripts/ against local mirrors: a folder, file:// and a loopback HTTP server."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DATA, MULTI30K, read_gz
from test_cli import invoke

from mtkit import download
from mtkit.corpora import CORPORA
from mtkit.data import DataError

REPO = Path(__file__).resolve().parents[1]
WMT22 = DATA / "wmt22"


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch) -> None:
    monkeypatch.setattr(download, "BACKOFF_S", 0.0)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_multi30k_from_a_folder_mirror_is_complete_aligned_and_prepared_once(tmp_path):
    out = tmp_path / "m30k"
    result = invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", MULTI30K)
    assert result.exit_code == 0, result.output
    # valid and test are written as published; train is cleaned, and the record adds up.
    assert lines(out / "test.de") == read_gz(MULTI30K / "test_2016_flickr.de.gz")
    assert lines(out / "valid.en") == read_gz(MULTI30K / "val.en.gz")
    record = json.loads((out / "prepare.json").read_text())
    train = record["splits"]["train"]
    assert train["clean"]["read"] == 29_000
    assert train["lines"] == train["clean"]["kept"] == len(lines(out / "train.en")) == len(lines(out / "train.de"))
    drops = sum(train["clean"][k] for k in ("empty", "too_short", "too_long", "ratio", "duplicate"))
    assert train["clean"]["kept"] + drops == 29_000 and 28_000 < train["lines"] < 29_000
    assert record["splits"]["test"]["lines"] == 1000
    assert "multi30k_en_de in" in result.stdout and "test 1,000" in result.stdout
    assert "INFO preparing multi30k_en_de train: 29,000 pairs in " in result.stderr  # stderr is no terminal

    # The same request again changes nothing; another cleaning setting prepares again.
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    again = invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", MULTI30K)
    assert again.exit_code == 0 and "already prepared" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == stamps
    invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", MULTI30K, "--no-dedupe")
    assert json.loads((out / "prepare.json").read_text())["settings"]["clean"]["dedupe"] is False


def test_reversed_direction_swaps_the_sides(tmp_path):
    out = tmp_path / "de_en"
    assert invoke("prepare", "multi30k_de_en", "--out", out, "--mirror", f"file://{MULTI30K}").exit_code == 0
    assert lines(out / "test.de") == read_gz(MULTI30K / "test_2016_flickr.de.gz")
    assert (out / "train.de").is_file() and not (out / "train.fr").exists()


def test_a_corrupted_mirror_file_is_refused_in_one_line(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz"):
        (mirror / name).write_bytes((MULTI30K / name).read_bytes())
    (mirror / "val.de.gz").write_bytes(gzip.compress(b"Ein Hund.\n" * 1014))  # not the published file
    result = invoke("prepare", "multi30k_en_de", "--out", tmp_path / "out", "--mirror", mirror)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert "val.de.gz" in line and "f0cba2f995189cf5" in line
    assert not (tmp_path / "out" / "prepare.json").exists()


class _Files(BaseHTTPRequestHandler):
    """Serves ``files`` with byte ranges; the first request for ``cut`` stops halfway through the body."""

    files: dict[str, bytes]
    cut: str
    seen: list[tuple[str, str | None]]
    unsized: str = ""  # the first request for it gets half the file, with no Content-Length, then a close

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        self.seen.append((name, self.headers.get("Range")))
        if name not in self.files:
            self.send_error(404)
            return
        data = self.files[name]
        if name == self.unsized and [n for n, _ in self.seen].count(name) == 1:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        start = int(self.headers["Range"].removeprefix("bytes=").removesuffix("-")) if self.headers["Range"] else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if name == self.cut and [n for n, _ in self.seen].count(name) == 1:
            self.wfile.write(data[start : start + len(data) // 2])
            self.close_connection = True
            return
        self.wfile.write(data[start:])

    def log_message(self, *args) -> None:
        pass


def prepare_from_server(handler: type, corpus: str, out: Path):
    """`mtkit prepare CORPUS` with a loopback server of ``handler`` as the mirror."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    try:
        return invoke(
            "prepare", corpus, "--out", out, "--mirror", f"http://127.0.0.1:{server.server_address[1]}/mirror"
        )
    finally:
        server.shutdown()
        server.server_close()


def test_http_mirror_with_an_interrupted_transfer_resumes_it(tmp_path):
    files = {p.name: p.read_bytes() for p in MULTI30K.glob("*.gz")}
    handler = type("Handler", (_Files,), {"files": files, "cut": "train.de.gz", "seen": []})
    result = prepare_from_server(handler, "multi30k_en_de", tmp_path / "out")
    assert result.exit_code == 0, result.output
    resumed = [r for n, r in handler.seen if n == "train.de.gz"]
    assert resumed == [None, f"bytes={len(files['train.de.gz']) // 2}-"]
    assert (tmp_path / "out" / "raw" / "train.de.gz").read_bytes() == files["train.de.gz"]


def write_parquet(path: Path, pairs: list[tuple[str, str]], langs: tuple[str, str]) -> None:
    rows = [{"translation": {langs[0]: a, langs[1]: b}} for a, b in pairs]
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("name", ["wmt14_en_de", "wmt16_en_ro", "wmt16_ro_en", "iwslt17_de_en"])
def test_hub_corpora_prepare_from_a_parquet_mirror(tmp_path, name):
    """The mirror holds the Hub's parquet files under the catalogue's names; the text is WMT22's
    (a stand-in: only the form matters here), one segment with a line break inside."""
    corpus = CORPORA[name]
    english = read_gz(WMT22 / "generaltest2022.en-de.src.en.gz")
    german = read_gz(WMT22 / "generaltest2022.en-de.ref.A.de.gz")
    pairs = [(e, g) if corpus.src_lang == "en" else (g, e) for e, g in zip(english, german)]
    pairs[0] = (pairs[0][0] + "\nsecond line", pairs[0][1])
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    expected = {}
    start = 0
    for split, spec in corpus.splits.items():
        size = 300 if split == "train" else 100
        chunk = pairs[start : start + size * len(spec.files)]
        start += len(chunk)
        for i, file in enumerate(spec.files):
            write_parquet(mirror / file.filename, chunk[i * size : (i + 1) * size], corpus.langs)
        expected[split] = chunk
    result = invoke("prepare", name, "--out", tmp_path / "out", "--mirror", mirror)
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    for split in ("valid", "test"):
        assert lines(out / f"{split}.{corpus.src_lang}") == [s for s, _ in expected[split]]
        assert lines(out / f"{split}.{corpus.tgt_lang}") == [t for _, t in expected[split]]
    train_src = lines(out / f"train.{corpus.src_lang}")
    assert train_src[0].endswith(" second line")  # the line break became a space: alignment holds
    assert len(train_src) == len(lines(out / f"train.{corpus.tgt_lang}")) <= len(expected["train"])


def test_on_a_terminal_each_split_shows_its_pairs_out_of_the_parquet_rows(tmp_path, terminal):
    corpus = CORPORA["wmt16_en_ro"]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    english = read_gz(WMT22 / "generaltest2022.en-de.src.en.gz")[:50]
    for spec in corpus.splits.values():
        for file in spec.files:
            write_parquet(mirror / file.filename, [(e, e[::-1]) for e in english], corpus.langs)
    result = invoke("prepare", "wmt16_en_ro", "--out", tmp_path / "out", "--mirror", mirror)
    assert result.exit_code == 0, result.output
    for split, spec in corpus.splits.items():
        rows = 50 * len(spec.files)
        [bar] = [line for line in result.stderr.splitlines() if line.startswith(f"preparing wmt16_en_ro {split} ")]
        assert f"100% {rows}/{rows} pairs" in bar


def test_a_download_of_unknown_size_cut_short_is_completed_not_kept(tmp_path):
    """A body without Content-Length that ended early was once taken as the whole file, and kept in OUT/raw,
    so every later prepare failed on it; now mtkit asks for what follows, and the file is completed."""
    corpus = CORPORA["wmt16_en_ro"]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    english = read_gz(WMT22 / "generaltest2022.en-de.src.en.gz")
    for split, spec in corpus.splits.items():
        for i, file in enumerate(spec.files):
            write_parquet(
                mirror / file.filename, [(e, e[::-1]) for e in english[i * 200 : (i + 1) * 200]], corpus.langs
            )
    files = {path.name: path.read_bytes() for path in mirror.iterdir()}
    unsized = corpus.splits["train"].files[0].filename
    handler = type("Handler", (_Files,), {"files": files, "cut": "", "seen": [], "unsized": unsized})
    result = prepare_from_server(handler, "wmt16_en_ro", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "raw" / unsized).read_bytes() == files[unsized]
    assert [r for n, r in handler.seen if n == unsized] == [None, f"bytes={len(files[unsized]) // 2}-"]


def test_parquet_is_read_in_order_across_row_groups_and_a_missing_side_names_the_row(tmp_path):
    from mtkit.preparation import _parquet_pairs

    rows = [{"translation": {"en": f"sentence {i}", "de": f"Satz {i}"}} for i in range(20_000)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3_000)
    assert list(_parquet_pairs([path, path], ("de", "en")))[19_999:20_001] == [
        ("Satz 19999", "sentence 19999"),
        ("Satz 0", "sentence 0"),
    ]
    rows[12_344]["translation"]["de"] = None
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3_000)
    with pytest.raises(DataError, match=r"train\.parquet: row 12345 has no translation\.en and translation\.de"):
        list(_parquet_pairs([path], ("en", "de")))
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"train\.parquet: not a readable parquet file"):
        list(_parquet_pairs([path], ("en", "de")))


def test_list_and_bad_requests(tmp_path):
    listed = invoke("prepare", "--list")
    assert listed.exit_code == 0 and set(CORPORA) == {row.split()[0] for row in listed.stdout.splitlines()}
    unknown = invoke("prepare", "wmt99_xx_yy", "--out", tmp_path / "x")
    assert unknown.exit_code == 1 and unknown.stderr.startswith("error: unknown corpus 'wmt99_xx_yy'")
    missing = invoke("prepare", "multi30k_en_de", "--out", tmp_path / "x", "--mirror", tmp_path / "empty")
    assert missing.exit_code == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("error: ")


def test_data_script_runs_prepare_with_its_arguments(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = tmp_path / "fr"
    done = subprocess.run(
        ["bash", str(REPO / "data_scripts" / "multi30k.sh"), "en-fr", str(out), "--mirror", str(MULTI30K)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert lines(out / "test.fr") == read_gz(MULTI30K / "test_2016_flickr.fr.gz")
