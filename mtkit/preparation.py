"""A corpus in, line-aligned plain text out: download (or load through ``datasets``), read, clean train, write.

Layout of the output folder::

    raw/                        the downloaded text files, kept so that a re-run fetches nothing (a Hub
                                corpus is kept in the ``datasets`` cache instead)
    train.SRC train.TGT         cleaned (mtkit.clean): normalised, filtered, deduplicated
    valid.SRC valid.TGT         as published, so that scores on them stay comparable
    test.SRC test.TGT
    prepare.json                what was done: corpus, files, cleaning settings, line counts, drops;
                                for a Hub or other ``datasets`` corpus also its source (dataset, config,
                                resolved revision) and each split's fingerprint

Every text file is written under a temporary name and renamed, and prepare.json last: a folder
whose prepare.json matches the request is complete, and is left alone on a re-run.
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

from mtkit import hf_corpus, untrusted
from mtkit.clean import CleanSummary, clean_pairs
from mtkit.config import CleanConfig, ConfigError
from mtkit.corpora import Corpus, RemoteFile
from mtkit.data import count_lines, iter_aligned
from mtkit.download import fetch, source_url
from mtkit.files import atomic_write
from mtkit.progress import StageProgress, shows_bar

log = logging.getLogger("mtkit")

RECORD = "prepare.json"
# Line and paragraph separators that would break line alignment if written inside a segment.
_LINE_BREAKS = str.maketrans({c: " " for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def prepare_corpus(corpus: Corpus, out: Path, mirror: str | None = None, clean: CleanConfig = CleanConfig()) -> dict:
    """Prepare ``corpus`` into ``out`` (see the module docstring); returns the prepare.json record.

    A Hub corpus is loaded as ``prepare_dataset`` loads one, from its mirror if given (see ``_mirrored``)."""
    settings = _settings(corpus, clean)
    if (done := _done(out, settings, corpus.name)) is not None:
        return done
    if corpus.dataset is not None:
        return _load_and_write(_mirrored(corpus.dataset, mirror), out, corpus.name, settings, clean)

    def splits() -> Iterator[tuple[str, Iterator[tuple[str, str]], int | None, dict]]:
        for name, split in corpus.splits.items():
            paths = [_download(f, out / "raw", mirror) for f in split.files]
            # Stray NULs in published text: cleaning removes them.
            yield name, iter_aligned(*paths, allow_nul=True), count_lines(paths[0]) if shows_bar() else None, {}

    return _write_prepared(out, corpus.name, corpus.langs, settings, clean, splits())


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


def shared_folder(corpus: Corpus, clean: CleanConfig = CleanConfig()) -> Path:
    """Where `mtkit run` prepares ``corpus`` when its recipe names no folder: one folder per corpus and
    settings under $MTKIT_DATA_DIR (else $XDG_CACHE_HOME/mtkit/prepared, else ~/.cache/mtkit/prepared), so
    every run directory of a recipe uses one download and one prepared copy."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtkit" / "prepared"
    root = Path(os.environ.get("MTKIT_DATA_DIR") or cache)
    digest = hashlib.sha256(json.dumps(_settings(corpus, clean), sort_keys=True).encode()).hexdigest()
    return root / f"{corpus.name}-{digest[:12]}"


def prepare_dataset(
    corpus: hf_corpus.HubCorpus, out: Path, clean: CleanConfig = CleanConfig(), num_proc: int | None = None
) -> dict:
    """Prepare a Hugging Face ``datasets`` corpus into ``out``, laid out as ``prepare_corpus`` lays a standard
    one; prepare.json adds the source's resolved revision (or its files' checksums) and each split's fingerprint."""
    settings = {"dataset": corpus.settings(), "clean": asdict(clean)}
    if (done := _done(out, settings, corpus.name)) is not None:
        return done
    return _load_and_write(corpus, out, corpus.name, settings, clean, num_proc)


def _done(out: Path, settings: dict, label: str) -> dict | None:
    """The record of an earlier run with the same settings: the folder is complete, and left alone."""
    done = _record(out)
    if done is None or done.get("settings") != settings:
        return None
    log.info("%s: already prepared in %s", label, out)
    return done


def _load_and_write(
    corpus: hf_corpus.HubCorpus, out: Path, label: str, settings: dict, clean: CleanConfig, num_proc: int | None = None
) -> dict:
    source, loaded = hf_corpus.load(corpus, num_proc)
    splits = ((split.name, split.pairs, split.rows, split.about) for split in loaded)
    return _write_prepared(out, label, corpus.langs, settings, clean, splits, source)


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
) -> dict:
    """Write each (name, pairs, pair count or None, about) split, cleaning train only; then prepare.json."""
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
    record = {"settings": settings, **({"source": source} if source else {}), "splits": written}
    record["seconds"] = round(time.perf_counter() - start, 1)
    atomic_write(out / RECORD, lambda f: f.write(json.dumps(record, indent=1).encode("utf-8")))
    return record


def _record(out: Path) -> dict | None:
    """The prepare.json of an earlier run, if it has the form ``prepare`` writes; None means prepare again."""
    try:
        record = json.loads((out / RECORD).read_text(encoding="utf-8"))
        untrusted.mapping(record, RECORD, required=("settings", "splits"))
        for name, split in untrusted.mapping(record["splits"], "splits").items():
            untrusted.integer(untrusted.mapping(split, name, required=("lines",))["lines"], f"{name}.lines")
    except (OSError, ValueError, RecursionError):  # missing, not JSON, or not of that form (Malformed)
        return None
    return record


def _download(file: RemoteFile, folder: Path, mirror: str | None) -> Path:
    source = source_url(file.filename, mirror) if mirror else file.url
    return fetch(source, folder / file.filename, file.sha256)


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
