"""A corpus in, line-aligned plain text out: download (or load through ``datasets``), read, clean train, write.

Layout of the output folder::

    raw/                        the downloaded text files, kept so that a re-run fetches nothing (a Hub
                                corpus is kept in the ``datasets`` cache instead)
    train.SRC train.TGT         cleaned (mtkit.data.clean): normalised, filtered, deduplicated; then, when a
                                ``TrainFilter`` is given, filtered by it (dual conditional cross-entropy)
    valid.SRC valid.TGT         as published, so that scores on them stay comparable
    test.SRC test.TGT
    prepare.json                what was done: corpus, files, cleaning settings, line counts, drops;
                                for a Hub or other ``datasets`` corpus also its source (dataset, config,
                                resolved revision) and each split's fingerprint

Every text file is written under a temporary name and renamed, and prepare.json last: a folder
whose prepare.json matches the request is complete, and is left alone on a re-run, unless the local
data files it was made from no longer have the SHA-256 it records. prepare.json is read as untrusted
data: a record not of the form written here (edited, damaged, too large) means prepare again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Protocol

from mtkit import untrusted
from mtkit.config import CleanConfig, ConfigError
from mtkit.data import hf_corpus
from mtkit.data.clean import CleanSummary, clean_pairs
from mtkit.data.corpora import Corpus, RemoteFile
from mtkit.data.download import fetch_file, source_url
from mtkit.data.parallel import DataError, count_lines, iter_aligned
from mtkit.files import atomic_write
from mtkit.progress import StageProgress, shows_bar

log = logging.getLogger("mtkit")

RECORD = "prepare.json"
# A record is a few KB, or ~150 bytes per local data file: 16 MiB is ~100k files; larger is not one mtkit wrote.
_RECORD_MAX_BYTES = 16 << 20
# Line and paragraph separators that would break line alignment if written inside a segment.
DEFAULT_CLEANING = CleanConfig()  # `mtkit prepare`'s cleaning when no option changes it
_LINE_BREAKS = str.maketrans(dict.fromkeys("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


class TrainFilter(Protocol):
    """A filter of the cleaned training split that needs the split written first (it reads it twice): the
    models of mtkit.translation.pair_filter, which a command above this layer hands in."""

    def settings(self) -> dict:
        """What the filtered split depends on (its models' digests, its settings), for prepare.json."""

    def __call__(self, source: Path, target: Path) -> dict[str, int]:
        """Filter the two files in place; the counts to record, "kept" among them."""


def prepare_corpus(
    corpus: Corpus,
    out: Path,
    mirror: str | None = None,
    clean: CleanConfig = DEFAULT_CLEANING,
    train_filter: TrainFilter | None = None,
) -> dict:
    """Prepare ``corpus`` into ``out`` (see the module docstring); returns the prepare.json record.

    A Hub corpus is loaded as ``prepare_dataset`` loads one, from its mirror if given (see ``_mirrored``)."""
    _check_out(out)
    settings = _settings(corpus, clean) | _filtering(train_filter)
    dataset = _mirrored(corpus.dataset, mirror) if corpus.dataset is not None else None
    if (done := _done(out, settings, corpus.name, dataset)) is not None:
        return done
    if dataset is not None:
        return _load_and_write(dataset, out, corpus.name, settings, clean, train_filter=train_filter)

    def splits() -> Iterator[tuple[str, Iterator[tuple[str, str]], int | None, dict]]:
        for name, split in corpus.splits.items():
            paths = [_download(f, out / "raw", mirror) for f in split.files]
            # Stray NULs in published text: cleaning removes them.
            yield name, iter_aligned(*paths, allow_nul=True), count_lines(paths[0]) if shows_bar() else None, {}

    return _write_prepared(out, corpus.name, corpus.langs, settings, clean, splits(), train_filter=train_filter)


def _filtering(train_filter: TrainFilter | None) -> dict:
    """The record's settings of the filter after cleaning: none without one, so earlier records still match."""
    return {"filter": train_filter.settings()} if train_filter is not None else {}


def _settings(corpus: Corpus, clean: CleanConfig) -> dict:
    """What a prepared folder depends on: the corpus's files, or its dataset, and the cleaning (a mirror holds
    the same data)."""
    if corpus.dataset is not None:
        return {"corpus": corpus.name, "dataset": corpus.dataset.settings(), "clean": asdict(clean)}
    return {
        "corpus": corpus.name,
        "files": {name: [f.url for f in split.files] for name, split in corpus.splits.items()},
        "clean": asdict(clean),
    }


def shared_folder(corpus: Corpus, clean: CleanConfig = DEFAULT_CLEANING) -> Path:
    """Where `mtkit run` prepares ``corpus`` when its recipe names no folder: one folder per corpus and
    settings under $MTKIT_DATA_DIR (else $XDG_CACHE_HOME/mtkit/prepared, else ~/.cache/mtkit/prepared), so
    every run directory of a recipe uses one download and one prepared copy."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtkit" / "prepared"
    root = Path(os.environ.get("MTKIT_DATA_DIR") or cache)
    digest = hashlib.sha256(json.dumps(_settings(corpus, clean), sort_keys=True).encode()).hexdigest()
    return root / f"{corpus.name}-{digest[:12]}"


def prepare_dataset(
    corpus: hf_corpus.HubCorpus,
    out: Path,
    clean: CleanConfig = DEFAULT_CLEANING,
    num_proc: int | None = None,
    train_filter: TrainFilter | None = None,
) -> dict:
    """Prepare a Hugging Face ``datasets`` corpus into ``out``, laid out as ``prepare_corpus`` lays a standard
    one; prepare.json adds the source's resolved revision (or its files' checksums) and each split's fingerprint."""
    _check_out(out)
    settings = {"dataset": corpus.settings(), "clean": asdict(clean)} | _filtering(train_filter)
    if (done := _done(out, settings, corpus.name, corpus)) is not None:
        return done
    return _load_and_write(corpus, out, corpus.name, settings, clean, num_proc, train_filter)


def _check_out(out: Path) -> None:
    """Refuse an output folder that is a file (or lies under one) before any download or conversion."""
    existing = next((path for path in (out, *out.absolute().parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        what = "a file" if existing == out else f"{existing} is a file"
        raise ConfigError(f"{out}: {what}, not a folder; --out names the folder to prepare into")


def _done(out: Path, settings: dict, label: str, dataset: hf_corpus.HubCorpus | None) -> dict | None:
    """The record of an earlier run with the same settings and, for local data, the same data files: the folder
    is complete, and left alone."""
    done = _record(out)
    if done is None or done["settings"] != settings:
        return None
    recorded = (done.get("source") or {}).get("data_files")
    if dataset is not None and dataset.is_local and recorded is not None:
        if changed := _changed_files(recorded, hf_corpus.local_checksums(dataset)):
            log.warning("%s: %s changed since %s was prepared from it; preparing again", label, changed, out)
            return None
    log.info("%s: already prepared in %s", label, out)
    return done


def _changed_files(recorded: dict, now: dict) -> str:
    """The first data file whose SHA-256 differs from the record (or that came or went); empty if none."""
    if recorded == now:
        return ""
    before, after = ({f["file"]: f["sha256"] for fs in files.values() for f in fs} for files in (recorded, now))
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    return changed[0] if changed else "the split of its data files"


def _load_and_write(
    corpus: hf_corpus.HubCorpus,
    out: Path,
    label: str,
    settings: dict,
    clean: CleanConfig,
    num_proc: int | None = None,
    train_filter: TrainFilter | None = None,
) -> dict:
    """Load a ``datasets`` corpus and write it; an error names the catalogue corpus too, if it is one."""
    try:
        source, loaded = hf_corpus.load_hub_corpus(corpus, num_proc)
    except DataError as err:
        if label == corpus.name:
            raise
        raise DataError(f"{label}: {err}") from None
    splits = ((split.name, split.pairs, split.rows, split.about) for split in loaded)
    return _write_prepared(out, label, corpus.langs, settings, clean, splits, source, train_filter)


def _mirrored(dataset: hf_corpus.HubCorpus, mirror: str | None) -> hf_corpus.HubCorpus:
    """The catalogue's Hub dataset, or with a mirror the clone of its repository there (MIRROR/ORG/NAME, as
    ``git clone`` lays it out), loaded as a local folder: no revision, the folder is what it holds."""
    if mirror is None:
        return dataset
    url = urllib.parse.urlparse(mirror)
    if url.scheme in ("http", "https"):
        raise ConfigError(
            f"mirror {mirror}: a Hub corpus's mirror is a local folder holding {dataset.path}/; "
            "for a Hub mirror served over HTTP, set HF_ENDPOINT to it instead"
        )
    folder = Path(urllib.request.url2pathname(url.path) if url.scheme == "file" else mirror) / dataset.path
    if not folder.is_dir():
        raise ConfigError(f"mirror {mirror}: no folder {dataset.path} (a clone of the Hub dataset repository)")
    return replace(dataset, path=str(folder), revision=None)


def _write_prepared(
    out: Path,
    label: str,
    langs: tuple[str, str],
    settings: dict,
    clean: CleanConfig,
    splits: Iterable[tuple[str, Iterator[tuple[str, str]], int | None, dict]],
    source: dict | None = None,
    train_filter: TrainFilter | None = None,
) -> dict:
    """Write each (name, pairs, pair count or None, about) split, cleaning train only (then ``train_filter`` filters
    it); then prepare.json."""
    start = time.perf_counter()
    written = {}
    for name, pairs, total, about in splits:
        with StageProgress(f"preparing {label} {name}", total, "pairs") as bar:
            pairs = bar.each(pairs)
            summary = None
            if name == "train":
                summary = CleanSummary()
                pairs = clean_pairs(pairs, clean, summary)
            lines = _write(pairs, out / f"{name}.{langs[0]}", out / f"{name}.{langs[1]}")
        written[name] = {"lines": lines, **({"clean": summary.to_dict()} if summary else {}), **about}
        log.info("%s %s: %s", label, name, summary.line() if summary else f"{lines:,} lines")
        if name == "train" and train_filter is not None:
            counts = train_filter(out / f"{name}.{langs[0]}", out / f"{name}.{langs[1]}")
            written[name] |= {"lines": counts["kept"], "filter": counts}
            log.info("%s %s: %s of %s pairs kept by the filter", label, name, f"{counts['kept']:,}", f"{lines:,}")
    record = {"settings": settings, **({"source": source} if source else {}), "splits": written}
    record["seconds"] = round(time.perf_counter() - start, 1)
    atomic_write(out / RECORD, lambda f: f.write(json.dumps(record, indent=1).encode("utf-8")))
    return record


def _record(out: Path) -> dict | None:
    """The prepare.json of an earlier run, if it has the form ``prepare`` writes, whole; None means prepare
    again (with a warning when there was a record)."""
    try:
        with open(out / RECORD, "rb") as f:
            raw = f.read(_RECORD_MAX_BYTES + 1)
    except OSError:  # missing, or unreadable: prepared again, and rewritten
        return None
    try:
        if len(raw) > _RECORD_MAX_BYTES:
            raise untrusted.Malformed(f"larger than {_RECORD_MAX_BYTES >> 20} MiB")
        return _checked(json.loads(raw))
    except (ValueError, RecursionError) as err:  # not JSON, nested too deep, or not of that form (Malformed)
        log.warning("%s: not a record mtkit wrote (%s); preparing again", out / RECORD, str(err)[:200])
        return None


def _checked(record: object) -> dict:
    """``record`` if every value has the type ``_write_prepared`` gives it, else Malformed."""
    untrusted.mapping(record, RECORD, required=("settings", "splits"), optional=("source", "seconds"))
    untrusted.mapping(record["settings"], "settings")
    for name, split in untrusted.mapping(record["splits"], "splits").items():
        untrusted.one_of(name, "a split's name", hf_corpus.OUTPUT_SPLITS)
        optional = ("clean", "filter", "dataset_split", "fingerprint", "rows")
        untrusted.mapping(split, name, required=("lines",), optional=optional)
        for key in ("lines", "rows"):
            if key in split:
                untrusted.integer(split[key], f"{name}.{key}")
        for counts in ("clean", "filter"):
            for key, value in untrusted.mapping(split.get(counts, {}), f"{name}.{counts}").items():
                untrusted.integer(value, f"{name}.{counts}.{key}")
        for key in ("dataset_split", "fingerprint"):
            if key in split:
                untrusted.string(split[key], f"{name}.{key}")
    if "source" in record:
        _check_source(record["source"])
    if "seconds" in record:
        untrusted.number(record["seconds"], "seconds")
    return record


def _check_source(source: object) -> None:
    """prepare.json's ``source``, as hf_corpus.load_hub_corpus returns it (read by `mtkit run` for its report)."""
    keys = ("dataset", "config", "data_dir", "revision", "data_files")
    untrusted.mapping(source, "source", required=keys, optional=())
    untrusted.string(source["dataset"], "source.dataset")
    for key in ("config", "data_dir", "revision"):
        if source[key] is not None:
            untrusted.string(source[key], f"source.{key}")
    if source["data_files"] is not None:
        for split, files in untrusted.mapping(source["data_files"], "source.data_files").items():
            if not isinstance(files, list):
                raise untrusted.Malformed(f"source.data_files.{split} must be a list, got {untrusted.shown(files)}")
            for i, entry in enumerate(files):
                what = f"source.data_files.{split}[{i}]"
                untrusted.mapping(entry, what, required=("file", "sha256"), optional=())
                untrusted.string(entry["file"], f"{what}.file")
                untrusted.sha256(entry["sha256"], f"{what}.sha256")


def _download(file: RemoteFile, folder: Path, mirror: str | None) -> Path:
    source = source_url(file.filename, mirror) if mirror else file.url
    return fetch_file(source, folder / file.filename, file.sha256)


def _write(pairs: Iterable[tuple[str, str]], src_path: Path, tgt_path: Path) -> int:
    """Both sides, one segment per line (a line break inside a segment becomes a space); the line count."""
    count = 0

    def write_both(src_file) -> None:
        def write_target(tgt_file) -> None:
            nonlocal count
            for s, t in pairs:
                src_file.write((s.translate(_LINE_BREAKS) + "\n").encode("utf-8"))
                tgt_file.write((t.translate(_LINE_BREAKS) + "\n").encode("utf-8"))
                count += 1

        atomic_write(tgt_path, write_target)

    atomic_write(src_path, write_both)
    return count
