"""`mtkit prepare` and data_scripts/ against local mirrors: a folder, file:// and a loopback HTTP server.

The mirrors hold captions (tests/captions.py) in the published files' layout; the catalogue of each test expects
their digests (the ``multi30k_mirror`` fixture).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import captions
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import invoke

from mtkit.data import download
from mtkit.data.corpora import CORPORA
from mtkit.data.hf_corpus import HubCorpus

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch) -> None:
    monkeypatch.setattr(download, "BACKOFF_S", 0.0)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def read_gz(path: Path) -> list[str]:
    return gzip.decompress(path.read_bytes()).decode().splitlines()


TRAIN_READ = captions.MIRROR_SPLITS["train"] + 3  # the captions and the three pairs added for cleaning to drop
TEST_LINES = captions.MIRROR_SPLITS["test_2016_flickr"]


def test_multi30k_from_a_folder_mirror_is_complete_aligned_and_prepared_once(tmp_path, multi30k_mirror):
    out = tmp_path / "m30k"
    result = invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", multi30k_mirror)
    assert result.exit_code == 0, result.output
    # valid and test are written as published; train is cleaned, and the record adds up.
    assert lines(out / "test.de") == read_gz(multi30k_mirror / "test_2016_flickr.de.gz")
    assert lines(out / "valid.en") == read_gz(multi30k_mirror / "val.en.gz")
    record = json.loads((out / "prepare.json").read_text())
    train = record["splits"]["train"]
    assert train["clean"] == {
        "read": TRAIN_READ,
        "kept": TRAIN_READ - 3,
        "empty": 1,
        "too_short": 0,
        "too_long": 0,
        "ratio": 1,
        "duplicate": 1,
        "changed": 1,
    }
    assert train["lines"] == train["clean"]["kept"] == len(lines(out / "train.en")) == len(lines(out / "train.de"))
    first = read_gz(multi30k_mirror / "train.en.gz")[0]
    assert lines(out / "train.en")[0] == " ".join(first.split()) != first  # normalised
    assert record["splits"]["test"]["lines"] == TEST_LINES
    assert "multi30k_en_de in" in result.stdout and f"test {TEST_LINES:,}" in result.stdout
    assert f"INFO preparing multi30k_en_de train: {TRAIN_READ:,} pairs in " in result.stderr  # stderr is no terminal

    # The same request again changes nothing; another cleaning setting prepares again.
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    again = invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", multi30k_mirror)
    assert again.exit_code == 0 and "already prepared" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == stamps
    invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", multi30k_mirror, "--no-dedupe")
    record = json.loads((out / "prepare.json").read_text())
    assert record["settings"]["clean"]["dedupe"] is False and record["splits"]["train"]["clean"]["duplicate"] == 0


def test_reversed_direction_swaps_the_sides(tmp_path, multi30k_mirror):
    out = tmp_path / "de_en"
    assert invoke("prepare", "multi30k_de_en", "--out", out, "--mirror", f"file://{multi30k_mirror}").exit_code == 0
    assert lines(out / "test.de") == read_gz(multi30k_mirror / "test_2016_flickr.de.gz")
    assert (out / "train.de").is_file() and not (out / "train.fr").exists()


def test_a_corrupted_mirror_file_is_refused_in_one_line(tmp_path, multi30k_mirror):
    from mtkit.data.corpora import _MULTI30K_SHA256

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz"):
        (mirror / name).write_bytes((multi30k_mirror / name).read_bytes())
    (mirror / "val.de.gz").write_bytes(gzip.compress(b"Ein Hund.\n" * 100))  # not the published file
    result = invoke("prepare", "multi30k_en_de", "--out", tmp_path / "out", "--mirror", mirror)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert "val.de.gz" in line and _MULTI30K_SHA256["val.de.gz"][:16] in line
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


def test_http_mirror_with_an_interrupted_transfer_resumes_it(tmp_path, multi30k_mirror):
    files = {p.name: p.read_bytes() for p in multi30k_mirror.glob("*.gz")}
    handler = type("Handler", (_Files,), {"files": files, "cut": "train.de.gz", "seen": []})
    result = prepare_from_server(handler, "multi30k_en_de", tmp_path / "out")
    assert result.exit_code == 0, result.output
    resumed = [r for n, r in handler.seen if n == "train.de.gz"]
    assert resumed == [None, f"bytes={len(files['train.de.gz']) // 2}-"]
    assert (tmp_path / "out" / "raw" / "train.de.gz").read_bytes() == files["train.de.gz"]


def test_a_download_of_unknown_size_cut_short_is_completed_not_kept(tmp_path, multi30k_mirror):
    """A body without Content-Length that ended early was once taken as the whole file; now mtkit asks for what
    follows, and the file is completed (and passes its checksum)."""
    files = {p.name: p.read_bytes() for p in multi30k_mirror.glob("*.gz")}
    handler = type("Handler", (_Files,), {"files": files, "cut": "", "seen": [], "unsized": "train.de.gz"})
    result = prepare_from_server(handler, "multi30k_en_de", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "raw" / "train.de.gz").read_bytes() == files["train.de.gz"]
    assert [r for n, r in handler.seen if n == "train.de.gz"] == [None, f"bytes={len(files['train.de.gz']) // 2}-"]


# -- the Hub corpora, from mirrors laid out as their Hub repositories ------------------------------------------

HUB_CORPORA = ["wmt14_en_de", "wmt14_de_en", "wmt16_en_ro", "wmt16_ro_en", "iwslt17_de_en", "iwslt17_en_de"]
# A second config beside the catalogue's, as on the Hub, that must not be read.
OTHER_CONFIG = {"wmt/wmt14": "cs-en", "wmt/wmt16": "de-en", "IWSLT/iwslt2017": "iwslt2017-ar-en"}
SPLIT_SIZES = {"train": 600, "validation": 100, "test": 100}


def card(configs: list[str]) -> str:
    """A dataset card as wmt/wmt14's and wmt/wmt16's: each config's translation feature and parquet shards."""
    lines = ["---", "dataset_info:"]
    for config in configs:
        lines += [f"- config_name: {config}", "  features:", "  - name: translation", "    dtype:"]
        lines += ["      translation:", "        languages:", *(f"        - {lang}" for lang in config.split("-"))]
    lines.append("configs:")
    for config in configs:
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {config}/{split}-*" for split in SPLIT_SIZES]
    return "\n".join(lines) + "\n---\n# Dataset Card\n"


def hub_clone(root: Path, dataset: HubCorpus, pairs: dict[str, list[tuple[str, str]]], shards: int = 1) -> None:
    """``dataset``'s Hub repository under ``root`` as `git clone` lays it out, its parquet shards holding ``pairs``
    ({split: [(first, second language of the folder's name)]}): wmt's de-en/train-00000-of-00003.parquet and a
    card naming the configs; iwslt's parquet conversion, iwslt2017-de-en/train/0000.parquet and no card."""
    repo = root / dataset.path
    repo.mkdir(parents=True)
    folders = [dataset.config or dataset.data_dir, OTHER_CONFIG[dataset.path]]
    for folder in folders:
        langs = folder.removeprefix("iwslt2017-").split("-")
        for split, split_pairs in pairs.items():
            count = shards if split == "train" else 1
            size = -(-len(split_pairs) // count)
            for i in range(count):
                if dataset.config:
                    path = repo / folder / f"{split}-{i:05d}-of-{count:05d}.parquet"
                else:
                    path = repo / folder / split / f"{i:04d}.parquet"
                path.parent.mkdir(parents=True, exist_ok=True)
                chunk = split_pairs[i * size : (i + 1) * size]
                if folder != folders[0]:
                    chunk = [(a[::-1], b[::-1]) for a, b in chunk]  # another corpus's text
                rows = [{"translation": dict(zip(langs, pair))} for pair in chunk]
                pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=250)
    if dataset.config:
        (repo / "README.md").write_text(card(folders), encoding="utf-8")


def hub_pairs(corpus) -> dict[str, list[tuple[str, str]]]:
    """En-De captions (a stand-in for every Hub corpus: only the form matters here) per dataset split, as
    (first, second language of the dataset's folder name); one train segment holds a line break."""
    text = captions.parallel(sum(SPLIT_SIZES.values()), seed=22)
    english, german = text["en"], text["de"]
    english[0] += "\nsecond line"
    first = (corpus.dataset.config or corpus.dataset.data_dir).removeprefix("iwslt2017-").split("-")[0]
    ordered = list(zip(english, german) if first == "en" else zip(german, english))
    pairs, start = {}, 0
    for split, size in SPLIT_SIZES.items():
        pairs[split], start = ordered[start : start + size], start + size
    return pairs


@pytest.mark.usefixtures("hf_offline")
@pytest.mark.parametrize("name", HUB_CORPORA)
def test_hub_corpora_prepare_from_a_mirror_of_their_repository_once(tmp_path, name):
    corpus = CORPORA[name]
    folder_langs = (corpus.dataset.config or corpus.dataset.data_dir).removeprefix("iwslt2017-").split("-")
    pairs = hub_pairs(corpus)
    hub_clone(tmp_path / "mirror", corpus.dataset, pairs, shards=3 if name.startswith("wmt14") else 1)
    # As (source, target): the folder names the languages in its own order, not the corpus's.
    expected = {split: [p if folder_langs == list(corpus.langs) else p[::-1] for p in split_pairs]
                for split, split_pairs in pairs.items()}  # fmt: skip
    mirror = f"file://{tmp_path / 'mirror'}" if name.endswith("_en") else tmp_path / "mirror"
    out = tmp_path / "out"
    result = invoke("prepare", name, "--out", out, "--mirror", mirror)
    assert result.exit_code == 0, result.output
    assert f"{name} in {out}: train " in result.stdout and "valid 100, test 100 lines" in result.stdout

    src, tgt = corpus.langs
    for ours, theirs in (("valid", "validation"), ("test", "test")):
        assert lines(out / f"{ours}.{src}") == [s for s, _ in expected[theirs]]
        assert lines(out / f"{ours}.{tgt}") == [t for _, t in expected[theirs]]
    train_src, train_tgt = lines(out / f"train.{src}"), lines(out / f"train.{tgt}")
    assert len(train_src) == len(train_tgt)
    assert (train_src if src == "en" else train_tgt)[0].endswith(" second line")  # a space: alignment holds

    record = json.loads((out / "prepare.json").read_text())
    assert record["settings"]["corpus"] == name
    assert record["settings"]["dataset"] == corpus.dataset.settings()  # the catalogue's, pinned revision and all
    source = record["source"]
    assert source["dataset"] == str(tmp_path / "mirror" / corpus.dataset.path) and source["revision"] is None
    assert source["config"] == (corpus.dataset.config or "default")
    assert source["data_dir"] == corpus.dataset.data_dir
    assert len(source["data_files"]["train"]) == (3 if name.startswith("wmt14") else 1)
    train = record["splits"]["train"]
    assert train["clean"]["read"] == train["rows"] == 600 and train["lines"] == len(train_src)
    assert record["splits"]["valid"]["dataset_split"] == "validation"
    assert len({split["fingerprint"] for split in record["splits"].values()}) == 3

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = invoke("prepare", name, "--out", out, "--mirror", mirror)
    assert again.exit_code == 0 and "already prepared" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


@pytest.mark.usefixtures("hf_offline")
def test_on_a_terminal_each_hub_split_shows_its_pairs_out_of_the_dataset_rows(tmp_path, terminal):
    corpus = CORPORA["wmt16_en_ro"]
    english = captions.parallel(120, seed=23, langs=("en",))["en"]
    sizes = {"train": 120, "validation": 50, "test": 40}
    hub_clone(tmp_path / "mirror", corpus.dataset, {s: [(e, e[::-1]) for e in english[:n]] for s, n in sizes.items()})
    result = invoke("prepare", "wmt16_en_ro", "--out", tmp_path / "out", "--mirror", tmp_path / "mirror")
    assert result.exit_code == 0, result.output
    for ours, rows in (("train", 120), ("valid", 50), ("test", 40)):
        [bar] = [line for line in result.stderr.splitlines() if line.startswith(f"preparing wmt16_en_ro {ours} ")]
        assert f"100% {rows}/{rows} pairs" in bar


@pytest.mark.parametrize("mirror", ["http://127.0.0.1:9/mirror", "https://hub.example/datasets"])
def test_an_http_mirror_of_a_hub_corpus_is_refused_in_one_line(tmp_path, mirror):
    result = invoke("prepare", "wmt16_en_ro", "--out", tmp_path / "out", "--mirror", mirror)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: mirror {mirror}: ") and "HF_ENDPOINT" in line
    assert not (tmp_path / "out").exists()


def test_shared_folders_differ_by_the_dataset_settings():
    """`mtkit run` prepares a Hub corpus in a folder of its dataset's settings: another revision, another folder."""
    from dataclasses import replace

    from mtkit.data.preparation import shared_folder

    wmt14 = CORPORA["wmt14_en_de"]
    assert shared_folder(wmt14) == shared_folder(wmt14)
    for change in ({"revision": "main"}, {"config": "fr-en"}, {"data_dir": "de-en"}, {"path": "someone/wmt14"}):
        other = replace(wmt14, dataset=replace(wmt14.dataset, **change))
        assert shared_folder(other) != shared_folder(wmt14)
    assert shared_folder(wmt14).name.startswith("wmt14_en_de-")


def test_list_and_bad_requests(tmp_path):
    listed = invoke("prepare", "--list")
    assert listed.exit_code == 0 and set(CORPORA) == {row.split()[0] for row in listed.stdout.splitlines()}
    [wmt14] = [row for row in listed.stdout.splitlines() if row.startswith("wmt14_en_de ")]
    assert "[hf:wmt/wmt14 config de-en revision b199e406369ec1b7634206d3ded5ba45de2fe696" in wmt14
    unknown = invoke("prepare", "wmt99_xx_yy", "--out", tmp_path / "x")
    assert unknown.exit_code == 1 and unknown.stderr.startswith("error: unknown corpus 'wmt99_xx_yy'")
    missing = invoke("prepare", "multi30k_en_de", "--out", tmp_path / "x", "--mirror", tmp_path / "empty")
    assert missing.exit_code == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("error: ")
    no_clone = invoke("prepare", "wmt14_en_de", "--out", tmp_path / "x", "--mirror", tmp_path / "empty")
    assert no_clone.exit_code == 1 and "Traceback" not in no_clone.stderr
    [line] = no_clone.stderr.strip().splitlines()
    assert line == f"error: mirror {tmp_path / 'empty'}: no folder wmt/wmt14 (a clone of the Hub dataset repository)"


def test_the_listing_says_the_wmt14_pin_is_unchecked():
    listed = invoke("prepare", "--list").stdout.splitlines()
    for name in ("wmt14_en_de", "wmt14_de_en"):
        [row] = [row for row in listed if row.startswith(f"{name} ")]
        assert row.endswith(
            "revision b199e406369ec1b7634206d3ded5ba45de2fe696; revision not yet checked against the Hub]"
        )
    assert not any("not yet checked" in row for row in listed if not row.startswith("wmt14_"))


class _HubWithoutRevisions(BaseHTTPRequestHandler):
    """A Hub mirror (HF_ENDPOINT) that has no revision of any dataset: every request is the Hub's answer for an
    unknown revision."""

    seen: list[str] = []

    def _unknown_revision(self) -> None:
        self.seen.append(self.path)
        self.send_response(404)
        self.send_header("X-Error-Code", "RevisionNotFound")
        self.send_header("X-Error-Message", "Invalid rev id")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _unknown_revision

    def log_message(self, *args) -> None:
        pass


def test_a_pinned_revision_the_hub_mirror_does_not_have_is_one_error_line(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubWithoutRevisions)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # online, to the mirror: the revision is asked for
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        result = invoke("prepare", "wmt14_en_de", "--out", tmp_path / "out")
    finally:
        server.shutdown()
        server.server_close()
    revision = CORPORA["wmt14_en_de"].dataset.revision
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.output
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert line.startswith(f"error: wmt14_en_de: hf:wmt/wmt14 revision {revision}: cannot load the dataset ("), line
    assert any(f"/datasets/wmt/wmt14/resolve/{revision}/" in p for p in _HubWithoutRevisions.seen)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda record: record.update(source="x"),
        lambda record: record.update(source={"a": 1}),
        lambda record: record["splits"]["test"].update(lines="many"),
        lambda record: record["splits"].update({"../../x": {"lines": 1}}),
        lambda record: record.update(padding="x" * (16 << 20)),
    ],
    ids=["source-string", "source-other-mapping", "lines-text", "split-path", "huge"],
)
def test_an_edited_prepare_json_is_prepared_again_with_a_warning(tmp_path, multi30k_mirror, edit):
    out = tmp_path / "m30k"
    assert invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", multi30k_mirror).exit_code == 0
    record = json.loads((out / "prepare.json").read_text())
    edit(record)
    (out / "prepare.json").write_text(json.dumps(record))
    again = invoke("prepare", "multi30k_en_de", "--out", out, "--mirror", multi30k_mirror)
    assert again.exit_code == 0, again.output
    assert f"{out / 'prepare.json'}: not a record mtkit wrote (" in again.stderr and "preparing again" in again.stderr
    rewritten = json.loads((out / "prepare.json").read_text())
    assert "source" not in rewritten and set(rewritten["splits"]) == {"train", "valid", "test"}
    assert f"test {TEST_LINES:,} lines" in again.stdout


def test_data_script_runs_prepare_with_its_arguments(tmp_path, mirror_files):
    """The script runs the `mtkit` on PATH: here one whose catalogue expects the mirror's digests."""
    mirror, digests = mirror_files
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mtkit").write_text(
        f"#!{sys.executable}\n"
        "from mtkit.data import corpora\n"
        f"corpora._MULTI30K_SHA256.update({digests!r})\n"
        "corpora.CORPORA.update(corpora._catalogue())\n"
        "from mtkit.cli import main\n"  # not mtkit.launch, whose restart under mimalloc would drop the digests
        "main()\n"
    )
    (bin_dir / "mtkit").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = tmp_path / "fr"
    done = subprocess.run(
        ["bash", str(REPO / "data_scripts" / "multi30k.sh"), "en-fr", str(out), "--mirror", str(mirror)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert lines(out / "test.fr") == read_gz(mirror / "test_2016_flickr.fr.gz")
    assert lines(out / "test.en") == read_gz(mirror / "test_2016_flickr.en.gz")
