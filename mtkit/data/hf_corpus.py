"""Any Hugging Face ``datasets`` corpus as sentence pairs: what to load, and its pairs a batch at a time.

The dataset is loaded the way every Hugging Face tool loads one (``datasets.load_dataset_builder``,
then ``download_and_prepare``), so its cache, ``HF_HOME``, ``HF_TOKEN``, offline mode and
``HF_ENDPOINT`` mirrors apply. A Hub id, a local folder laid out as a Hub dataset repository, or a
builder (``json``, ``csv``, ``parquet``) with ``data_files`` all take this one path.

Two layouts of the text: a ``translation`` column of {lang: text} (WMT, OPUS), or one column per side
(named by the language code, or by ``src_column`` and ``tgt_column``). The pairs are read from the
dataset's Arrow cache files a record batch at a time, never one Python dict per row.

Local data is checked before ``datasets`` reads it, so that bad data is one error naming the file: a
folder's loading script is refused (never run), its card's YAML read with the safe loader, and the
files its card names must lie inside it (symlinks resolved); files named by ``--data-files`` must be
data files by their suffix; every local file must be non-empty, a parquet file readable with rows,
and a text file UTF-8.
"""

from __future__ import annotations

import codecs
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from mtkit.data.parallel import DataError
from mtkit.files import file_sha256

PREFIX = "hf:"
DEFAULT_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
OUTPUT_SPLITS = ("train", "valid", "test")
# Rows per record batch of the Arrow cache this conversion writes (datasets: 1,000). Opening a split maps the
# file and reads each batch's header, and the kernel maps 64 KiB around each, so fewer, larger batches keep
# resident memory down (docs/benchmarks.md, "prepare through datasets").
_CACHE_BATCH_ROWS = 10_000
# What --data-files may name: the formats of the hf:json, hf:csv and hf:parquet builders, compressed or not.
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".tsv")
_COMPRESSIONS = ("", ".gz", ".bz2", ".xz", ".zst")
_TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".txt")  # checked to be UTF-8 before datasets reads them
_CARD = "README.md"
_FRONT_MATTER = re.compile(r"\A\s*---[\r\n]+(.*?)[\r\n]+---(?:\r?\n|\Z)", re.DOTALL)  # as the Hub reads a card


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
    def is_folder(self) -> bool:
        return Path(self.path).is_dir()

    @property
    def is_local(self) -> bool:
        """Local data (a folder, or a builder over local files): it has no revision, its files a fingerprint."""
        return self.is_folder or self.data_files is not None and "/" not in self.path

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


def load_hub_corpus(corpus: HubCorpus, num_proc: int | None = None) -> tuple[dict, list[LoadedSplit]]:
    """Load (download and convert to Arrow, or find in the cache) and check every requested split.

    Returns what prepare.json records of the source (resolved revision, data-file checksums) and the splits,
    their pairs read lazily. A missing split, column or language is a DataError naming what the dataset has.
    """
    import datasets

    builder = _builder(corpus)
    files = _data_files(corpus, builder)
    if corpus.is_local:
        for path in itertools.chain.from_iterable(files.values()):
            _check_contents(Path(path))
    available = sorted(files)
    if missing := [theirs for theirs in corpus.splits.values() if theirs not in available]:
        raise DataError(f"{corpus.name}: no split {', '.join(missing)} (splits: {', '.join(available) or 'none'})")
    if hasattr(builder.config, "fragment_scan_options") and builder.config.fragment_scan_options is None:
        import pyarrow.dataset

        # Parquet: pyarrow pre-buffers whole row groups by default, memory a read in record batches does not need.
        builder.config.fragment_scan_options = pyarrow.dataset.ParquetFragmentScanOptions(pre_buffer=False)
    try:
        builder.download_and_prepare(num_proc=num_proc)
    except (datasets.exceptions.DatasetsError, OSError, ValueError) as err:  # unreadable rows, differing schemas
        raise DataError(f"{corpus.name}: cannot read the data ({_first_line(_innermost(err))})") from None
    source = {
        "dataset": corpus.path,
        "config": builder.config.name,
        "data_dir": corpus.data_dir,
        "revision": None if corpus.is_local else builder.hash,  # the Hub commit the files came from
        "data_files": _checksums(files) if corpus.is_local else None,
    }
    pa.default_memory_pool().release_unused()  # what the conversion held, before the reading starts
    splits = []
    for ours, theirs in corpus.splits.items():
        where = f"{corpus.name} {theirs} (in {_listed(files[theirs])})"
        try:
            dataset = builder.as_dataset(split=theirs)
        except ValueError:  # datasets: 'Instruction "train" corresponds to no data!'
            dataset = None
        if dataset is None or dataset.num_rows == 0:
            raise DataError(f"{where}: no rows")
        columns = _columns(corpus, dataset.features, where)
        # The fingerprint is datasets' own name for this exact table (data files, config, version).
        about = {"dataset_split": theirs, "fingerprint": dataset._fingerprint, "rows": dataset.num_rows}
        # The table is its cache files, in order; they are read, and the dataset's memory map let go.
        cache = [cache_file["filename"] for cache_file in dataset.cache_files]
        splits.append(LoadedSplit(ours, _pairs(cache, columns, f"{corpus.name} {theirs}"), dataset.num_rows, about))
        del dataset
    return source, splits


def local_checksums(corpus: HubCorpus) -> dict[str, list[dict]]:
    """The SHA-256 of a local corpus's data files as they are now, laid out as prepare.json records them."""
    return _checksums(_data_files(corpus, _builder(corpus)))


def _builder(corpus: HubCorpus):
    """The dataset's builder; a dataset that cannot be found (offline, misspelled, gated, a revision the Hub
    does not have) is a DataError naming the revision.

    ``trust_remote_code`` is not passed: datasets 4.0 and later (the floor) never run a loading script, and
    ``load_dataset_builder`` refuses the argument; a local folder's script is refused before that."""
    import datasets

    if corpus.is_folder:
        _check_folder(Path(corpus.path))
    elif corpus.path.endswith(".py"):
        raise DataError(f"{corpus.path}: a dataset loading script; mtkit never runs one (give its data files)")
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
    except (datasets.exceptions.DatasetsError, OSError, ValueError, RuntimeError, yaml.YAMLError) as err:
        # not found, offline, no such config or revision; a Hub dataset's script (RuntimeError), a bad card
        at = f" revision {corpus.revision}" if corpus.revision else ""
        raise DataError(f"{corpus.name}{at}: cannot load the dataset ({_first_line(err)})") from None


def _check_folder(folder: Path) -> None:
    """Refuse what ``datasets`` would act on in a folder before reading a data file: a loading script (the one
    datasets < 4.0 ran: FOLDER/NAME.py) and a card whose YAML front matter the safe loader cannot read (a
    ``!!python`` tag is such an error, never code)."""
    for name in filter(None, {folder.name, folder.resolve().name}):  # as given, and resolved (hf:. has no name)
        if (script := folder / f"{name}.py").is_file():
            raise DataError(f"{script}: a dataset loading script; mtkit never runs one (convert the data to parquet)")
    card = folder / _CARD
    if not card.is_file():
        return
    try:
        front = _FRONT_MATTER.match(card.read_text(encoding="utf-8"))
        yaml.safe_load(front.group(1) if front else "")
    except UnicodeDecodeError as err:
        raise DataError(f"{card}: not UTF-8 text (byte {err.start:,})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 2}" if mark is not None else ""  # the line after the opening ---
        problem = getattr(err, "problem", None) or _first_line(err)
        raise DataError(f"{card}: unreadable YAML front matter{at} ({problem})") from None


def _data_files(corpus: HubCorpus, builder) -> dict[str, list[str]]:
    """Each split's files, as datasets resolved them. A folder's card may name only files inside the folder
    (symlinks resolved); files named by --data-files are the user's choice, anywhere, but must be data files."""
    files = {str(split): [str(path) for path in paths] for split, paths in (builder.config.data_files or {}).items()}
    if not corpus.is_local:
        return files
    folder = Path(corpus.path).resolve() if corpus.is_folder and corpus.data_files is None else None
    for path in map(Path, itertools.chain.from_iterable(files.values())):
        if folder is not None and not (real := path.resolve()).is_relative_to(folder):
            via = f" (it is {real})" if real != path.absolute() else ""
            raise DataError(f"{path}: outside the dataset folder {folder}{via}; a folder's data must lie inside it")
        if folder is None and not path.name.endswith(tuple(s + c for s in DATA_SUFFIXES for c in _COMPRESSIONS)):
            suffixes = f"{', '.join(DATA_SUFFIXES[:-1])} or {DATA_SUFFIXES[-1]}"
            raise DataError(f"{path}: not a data file (--data-files takes {suffixes} files, compressed or not)")
    return files


def _check_contents(path: Path) -> None:
    """A local data file that datasets would fail on with a traceback, or read wrongly, is a DataError naming it."""
    if path.stat().st_size == 0:
        raise DataError(f"{path}: an empty file")
    if path.suffix == ".parquet":
        try:
            rows = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: not a readable parquet file ({_first_line(err)})") from None
        if rows == 0:
            raise DataError(f"{path}: no rows")
    elif path.suffix in _TEXT_SUFFIXES:
        _check_utf8(path)


def _check_utf8(path: Path) -> None:
    """Invalid UTF-8 is an error naming FILE:LINE (the json builder would carry it into the Arrow table)."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with open(path, "rb") as f:
        for chunk in itertools.chain(iter(lambda: f.read(1 << 20), b""), [b""]):
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the chunk before
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                line += chunk[: max(err.start - pending, 0)].count(b"\n")
                raise DataError(f"{path}:{line}: not UTF-8 text") from None
            line += chunk.count(b"\n")


def _innermost(err: BaseException) -> BaseException:
    """The error datasets wrapped (DatasetGenerationError says only that one occurred)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _listed(paths: list[str]) -> str:
    return paths[0] + (f" and {len(paths) - 1} more" if len(paths) > 1 else "") if paths else "no file"


def _checksums(data_files: dict[str, Iterable[str]]) -> dict[str, list[dict]]:
    """SHA-256 of each local data file: what a report needs to say exactly which data it used."""
    return {
        split: [{"file": path, "sha256": file_sha256(Path(path))} for path in paths]
        for split, paths in data_files.items()
    }


def _columns(corpus: HubCorpus, features, where: str) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """Where each side's text is: (column, field of the translation dict or None), source first."""
    names = list(features)
    if corpus.src_column is not None:
        pairs = ((corpus.src_column, None), (corpus.tgt_column, None))
    elif "translation" in names:
        feature = features["translation"]
        langs = getattr(feature, "languages", None) or (list(feature) if isinstance(feature, dict) else None)
        if langs is None:
            kind = getattr(feature, "dtype", type(feature).__name__)
            raise DataError(f"{where}: the translation column holds {kind}, not {{language: text}}")
        if absent := [lang for lang in corpus.langs if lang not in langs]:
            raise DataError(
                f"{where}: the translation column has no {', '.join(absent)} (languages: {', '.join(sorted(langs))})"
            )
        return ("translation", corpus.src_lang), ("translation", corpus.tgt_lang)
    else:
        pairs = ((corpus.src_lang, None), (corpus.tgt_lang, None))
    if absent := [column for column, _ in pairs if column not in names]:
        problem = f"{where}: no column {', '.join(absent)} (columns: {', '.join(names)})"
        if corpus.src_column is None:
            problem += "; no translation column either: name the text columns with --src-column and --tgt-column"
        raise DataError(problem)
    return pairs


def _pairs(files: list[str], columns, label: str) -> Iterator[tuple[str, str]]:
    """The pairs in table order, one Arrow record batch at a time.

    The Arrow files are read, not memory-mapped: every page of a memory map once read counts as the
    process's resident memory while the map lasts (docs/benchmarks.md); a batch read is freed with it.
    """
    number = 0
    for path in files:
        with pa.OSFile(path) as source:
            for batch in pa.ipc.open_stream(source):
                sides = [_texts(batch, column, key) for column, key in columns]
                first = number + 1  # rows are numbered across batches and files
                for number, pair in enumerate(zip(*sides), start=first):
                    if not all(isinstance(text, str) for text in pair):
                        raise DataError(f"{label}: row {number} has no text on both sides")
                    yield pair


def _texts(batch: pa.RecordBatch, column: str, key: str | None) -> list:
    values = batch.column(column)
    return (values if key is None else pc.struct_field(values, key)).to_pylist()
