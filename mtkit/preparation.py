"""A corpus in, line-aligned plain text out: download (or load through ``datasets``), read, clean train, write.

Layout of the output folder::

    raw/                        the downloaded files, kept so that a re-run fetches nothing
    train.SRC train.TGT         cleaned (mtkit.clean): normalised, filtered, deduplicated
    valid.SRC valid.TGT         as published, so that scores on them stay comparable
    test.SRC test.TGT
    prepare.json                what was done: corpus, files, cleaning settings, line counts, drops;
                                for a ``datasets`` corpus also its revision and each split's fingerprint

Every text file is written under a temporary name and renamed, and prepare.json last: a folder
whose prepare.json matches the request is complete, and is left alone on a re-run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from mtkit import untrusted
from mtkit.clean import CleanSummary, clean_pairs
from mtkit.config import CleanConfig
from mtkit.corpora import Corpus, RemoteFile, Split
from mtkit.data import DataError, count_lines, iter_aligned
from mtkit.download import fetch, source_url
from mtkit.files import atomic_write
from mtkit.hf_corpus import HubCorpus
from mtkit.progress import StageProgress, shows_bar

log = logging.getLogger("mtkit")

RECORD = "prepare.json"
# Line and paragraph separators that would break line alignment if written inside a segment.
_LINE_BREAKS = str.maketrans({c: " " for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def prepare_corpus(corpus: Corpus, out: Path, mirror: str | None = None, clean: CleanConfig = CleanConfig()) -> dict:
    """Prepare ``corpus`` into ``out`` (see the module docstring); returns the prepare.json record."""
    settings = _settings(corpus, clean)
    done = _record(out)
    if done is not None and done.get("settings") == settings:
        log.info("%s: already prepared in %s", corpus.name, out)
        return done

    def splits() -> Iterator[tuple[str, Iterator[tuple[str, str]], int | None, dict]]:
        for name, split in corpus.splits.items():
            paths = [_download(f, out / "raw", mirror) for f in split.files]
            yield name, _read(split, paths, corpus.langs), _pair_count(split, paths) if shows_bar() else None, {}

    return _write_prepared(out, corpus.name, corpus.langs, settings, clean, splits())


def _settings(corpus: Corpus, clean: CleanConfig) -> dict:
    """What a prepared folder depends on: the corpus's files and the cleaning (a mirror holds the same files)."""
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
    corpus: HubCorpus, out: Path, clean: CleanConfig = CleanConfig(), num_proc: int | None = None
) -> dict:
    """Prepare a Hugging Face ``datasets`` corpus into ``out``, laid out as ``prepare_corpus`` lays a standard
    one; prepare.json adds the source's resolved revision (or its files' checksums) and each split's fingerprint."""
    from mtkit import hf_corpus

    settings = {"dataset": corpus.settings(), "clean": asdict(clean)}
    done = _record(out)
    if done is not None and done.get("settings") == settings:
        log.info("%s: already prepared in %s", corpus.name, out)
        return done
    source, loaded = hf_corpus.load(corpus, num_proc)
    splits = ((split.name, split.pairs, split.rows, split.about) for split in loaded)
    return _write_prepared(out, corpus.name, corpus.langs, settings, clean, splits, source)


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


def _read(split: Split, paths: list[Path], langs: tuple[str, str]) -> Iterator[tuple[str, str]]:
    if split.form == "text":
        return iter_aligned(*paths, allow_nul=True)  # stray NULs in published text: cleaning removes them
    return _parquet_pairs(paths, langs)


def _pair_count(split: Split, paths: list[Path]) -> int | None:
    """The pairs to read, where they are cheap to count: lines of an uncompressed text file, rows of parquet
    files (in their footers); None otherwise."""
    if split.form == "text":
        return count_lines(paths[0])
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return sum(pq.read_metadata(path).num_rows for path in paths)
    except (pa.ArrowException, OSError):  # reading them says what is wrong
        return None


def _parquet_pairs(paths: list[Path], langs: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """The ``translation`` column's pairs, in file order, a few thousand rows at a time.

    Read with pyarrow, pre-buffering off: memory stays near 100 MiB whatever the shard size (with
    pre-buffering, or through ``datasets`` streaming, a 1.5M-row shard held 240-950 MiB).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in paths:
        try:
            with pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20) as parquet:
                if "translation" not in parquet.schema_arrow.names:
                    raise DataError(f"{path}: no translation column (columns: {', '.join(parquet.schema_arrow.names)})")
                number = 0
                for batch in parquet.iter_batches(batch_size=8192, columns=["translation"]):
                    column = batch.column(0)
                    sides = [_field(column, lang, path) for lang in langs]
                    for number, pair in enumerate(zip(*sides), start=number + 1):
                        if not all(isinstance(text, str) for text in pair):
                            raise DataError(
                                f"{path}: row {number} has no translation.{langs[0]} and translation.{langs[1]} text"
                            )
                        yield pair
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: not a readable parquet file ({err})") from None


def _field(column, lang: str, path: Path) -> list:
    try:
        return column.field(lang).to_pylist()
    except (KeyError, ValueError, AttributeError):  # no such field, or the column is not a struct
        raise DataError(f"{path}: the translation column has no {lang!r} field") from None


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
