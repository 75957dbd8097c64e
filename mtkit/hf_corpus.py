"""Any Hugging Face ``datasets`` corpus as sentence pairs: what to load, and its pairs a batch at a time.

The dataset is loaded the way every Hugging Face tool loads one (``datasets.load_dataset_builder``,
then ``download_and_prepare``), so its cache, ``HF_HOME``, ``HF_TOKEN``, offline mode and
``HF_ENDPOINT`` mirrors apply. A Hub id, a local folder laid out as a Hub dataset repository, or a
builder (``json``, ``csv``, ``parquet``) with ``data_files`` all take this one path.

Two layouts of the text: a ``translation`` column of {lang: text} (WMT, OPUS), or one column per side
(named by the language code, or by ``src_column`` and ``tgt_column``). The pairs are read from the
dataset's Arrow cache files a record batch at a time, never one Python dict per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from mtkit.data import DataError
from mtkit.files import file_sha256

PREFIX = "hf:"
DEFAULT_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
OUTPUT_SPLITS = ("train", "valid", "test")
# Rows per record batch of the Arrow cache this conversion writes (datasets: 1,000). Opening a split maps the
# file and reads each batch's header, and the kernel maps 64 KiB around each: 280 MiB of resident memory for
# 4.5M pairs in 1,000-row batches, 30 MiB in these.
_CACHE_BATCH_ROWS = 10_000


@dataclass(frozen=True)
class HubCorpus:
    """A request for a corpus through ``datasets``: what ``mtkit prepare hf:PATH`` was given."""

    path: str  # a Hub id (ORG/NAME), a local folder, or a builder name (json, csv, parquet) with data_files
    src_lang: str
    tgt_lang: str
    config: str | None = None  # the dataset's config (subset), e.g. "de-en" for wmt/wmt14
    revision: str | None = None  # a Hub branch, tag or commit; None: the default branch
    splits: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_SPLITS))  # ours (train...) → the dataset's
    src_column: str | None = None  # flat layout: the source side's column; None: translation, or the language code
    tgt_column: str | None = None
    data_files: dict[str, list[str]] | None = None  # the dataset's split → files, as load_dataset takes them
    data_dir: str | None = None  # the folder of the repository to read, where one holds several corpora

    def __post_init__(self) -> None:
        if unknown := set(self.splits) - set(OUTPUT_SPLITS):
            raise DataError(f"--splits: unknown output split {', '.join(sorted(unknown))} (use train, valid, test)")
        if (self.src_column is None) != (self.tgt_column is None):
            raise DataError("give both --src-column and --tgt-column, or neither")

    @property
    def name(self) -> str:
        return PREFIX + self.path

    @property
    def langs(self) -> tuple[str, str]:
        return self.src_lang, self.tgt_lang

    @property
    def is_local(self) -> bool:
        """Local data (a folder, or a builder over local files): it has no revision, its files a fingerprint."""
        return Path(self.path).is_dir() or self.data_files is not None and "/" not in self.path

    def settings(self) -> dict:
        """The request as prepare.json records it; the same settings again means nothing to do."""
        return {
            "dataset": self.path,
            "config": self.config,
            "revision": self.revision,
            "langs": list(self.langs),
            "splits": self.splits,
            "columns": [self.src_column, self.tgt_column] if self.src_column else None,
            "data_files": self.data_files,
            "data_dir": self.data_dir,
        }


def parse_splits(text: str | None) -> dict[str, str]:
    """``train=train,valid=validation`` → {"train": "train", "valid": "validation"}; None: DEFAULT_SPLITS."""
    if text is None:
        return dict(DEFAULT_SPLITS)
    splits = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        ours, sep, theirs = item.partition("=")
        if not sep or not ours.strip() or not theirs.strip():
            raise DataError(f"--splits: {item!r} is not OURS=THEIRS, e.g. valid=validation")
        splits[ours.strip()] = theirs.strip()
    return splits


def parse_data_files(items: list[str]) -> dict[str, list[str]] | None:
    """``["train=a.jsonl", "validation=b.jsonl"]`` → {split: [files]}; an item without ``SPLIT=`` is train's."""
    if not items:
        return None
    files: dict[str, list[str]] = {}
    for item in items:
        split, sep, path = item.partition("=")
        split, path = (split, path) if sep and "/" not in split else ("train", item)
        files.setdefault(split.strip(), []).append(path.strip())
    return files


@dataclass
class LoadedSplit:
    """One output split: its pairs, their count and what prepare.json says of its source."""

    name: str
    pairs: Iterator[tuple[str, str]]
    rows: int
    about: dict


def load(corpus: HubCorpus, num_proc: int | None = None) -> tuple[dict, list[LoadedSplit]]:
    """Load (download and convert to Arrow, or find in the cache) and check every requested split.

    Returns what prepare.json records of the source (resolved revision, data-file checksums) and the splits,
    their pairs read lazily. A missing split, column or language is a DataError naming what the dataset has.
    """
    builder = _builder(corpus)
    available = sorted(str(split) for split in builder.config.data_files or {})
    if missing := [theirs for theirs in corpus.splits.values() if theirs not in available]:
        raise DataError(f"{corpus.name}: no split {', '.join(missing)} (splits: {', '.join(available) or 'none'})")
    if hasattr(builder.config, "fragment_scan_options") and builder.config.fragment_scan_options is None:
        import pyarrow.dataset

        # Parquet: pyarrow pre-buffers whole row groups by default, 200 MiB more for 4.5M pairs.
        builder.config.fragment_scan_options = pyarrow.dataset.ParquetFragmentScanOptions(pre_buffer=False)
    try:
        builder.download_and_prepare(num_proc=num_proc)
    except (OSError, ValueError) as err:  # unreadable files, a schema that differs between files
        raise DataError(f"{corpus.name}: cannot read the data ({_first_line(err)})") from None
    source = {
        "dataset": corpus.path,
        "config": builder.config.name,
        "data_dir": corpus.data_dir,
        "revision": None if corpus.is_local else builder.hash,  # the Hub commit the files came from
        "data_files": _checksums(builder.config.data_files) if corpus.is_local else None,
    }
    pa.default_memory_pool().release_unused()  # what the conversion held, before the reading starts
    splits = []
    for ours, theirs in corpus.splits.items():
        dataset = builder.as_dataset(split=theirs)
        columns = _columns(corpus, dataset.features, theirs)
        # The fingerprint is datasets' own name for this exact table (data files, config, version).
        about = {"dataset_split": theirs, "fingerprint": dataset._fingerprint, "rows": dataset.num_rows}
        # The table is its cache files, in order; they are read, and the dataset's memory map let go.
        files = [cache_file["filename"] for cache_file in dataset.cache_files]
        splits.append(LoadedSplit(ours, _pairs(files, columns, f"{corpus.name} {theirs}"), dataset.num_rows, about))
        del dataset
    return source, splits


def _builder(corpus: HubCorpus):
    """The dataset's builder; a dataset that cannot be found (offline, misspelled, gated) is a DataError."""
    import datasets

    kwargs = {}
    files = [f for paths in (corpus.data_files or {}).values() for f in paths]
    if corpus.path == "csv" and files and all(f.endswith(".tsv") for f in files):
        kwargs["sep"] = "\t"  # as datasets itself reads .tsv files it finds in a folder
    try:
        return datasets.load_dataset_builder(
            corpus.path,
            corpus.config,
            data_dir=corpus.data_dir,
            data_files=corpus.data_files,
            revision=corpus.revision,
            writer_batch_size=_CACHE_BATCH_ROWS,
            **kwargs,
        )
    except (datasets.exceptions.DatasetsError, OSError, ValueError) as err:  # not found, offline, no such config
        raise DataError(f"{corpus.name}: cannot load the dataset ({_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _checksums(data_files) -> dict[str, list[dict]]:
    """SHA-256 of each local data file: what a report needs to say exactly which data it used."""
    return {
        str(split): [{"file": str(path), "sha256": file_sha256(Path(path))} for path in paths]
        for split, paths in (data_files or {}).items()
    }


def _columns(corpus: HubCorpus, features, split: str) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """Where each side's text is: (column, field of the translation dict or None), source first."""
    names = list(features)
    if corpus.src_column is not None:
        pairs = ((corpus.src_column, None), (corpus.tgt_column, None))
    elif "translation" in names:
        langs = sorted(getattr(features["translation"], "languages", None) or features["translation"])
        if absent := [lang for lang in corpus.langs if lang not in langs]:
            raise DataError(
                f"{corpus.name} {split}: the translation column has no {', '.join(absent)} "
                f"(languages: {', '.join(langs)})"
            )
        return ("translation", corpus.src_lang), ("translation", corpus.tgt_lang)
    else:
        pairs = ((corpus.src_lang, None), (corpus.tgt_lang, None))
    if absent := [column for column, _ in pairs if column not in names]:
        problem = f"{corpus.name} {split}: no column {', '.join(absent)} (columns: {', '.join(names)})"
        if corpus.src_column is None:
            problem += "; no translation column either: name the text columns with --src-column and --tgt-column"
        raise DataError(problem)
    return pairs


def _pairs(files: list[str], columns, label: str) -> Iterator[tuple[str, str]]:
    """The pairs in table order, one Arrow record batch at a time.

    The Arrow files are read, not memory-mapped: every page of a memory map once read counts as the
    process's resident memory while the map lasts (1.4 GiB for 4.5M pairs); a batch read is freed with it.
    """
    number = 0
    for path in files:
        with pa.OSFile(path) as source:
            for batch in pa.ipc.open_stream(source):
                sides = [_texts(batch, column, key) for column, key in columns]
                for number, pair in enumerate(zip(*sides), start=number + 1):
                    if not all(isinstance(text, str) for text in pair):
                        raise DataError(f"{label}: row {number} has no text on both sides")
                    yield pair


def _texts(batch: pa.RecordBatch, column: str, key: str | None) -> list:
    values = batch.column(column)
    return (values if key is None else pc.struct_field(values, key)).to_pylist()
