"""Training pairs encoded once into memory-mapped token arrays, so a WMT-size corpus costs disk, not RAM.

A store is a directory in the encoding cache (``data.cache_dir``)::

    src.ids, tgt.ids          every kept sentence's token ids back to back (uint16 when the vocabulary fits)
    src.offsets, tgt.offsets  int64, where each sentence starts, plus the end
    meta.json                 what was encoded (files, tokenizers, filters), the files' SHA-256, the counts,
                              and how long it took

Its name is a digest of what it was built from: the training files (path, size, modification
time), both tokenizers' SHA-256 and the length filters. Any run with the same inputs reuses it
instead of encoding again; a changed file or tokenizer gets a new store (a training file that an
older store in the cache holds at another size or modification time is named in a warning). The
SHA-256 of each training file is taken once, when its store is built, so a run can tell whether the
data it resumes on is the data it started on without reading a large corpus again. Encoding streams the
corpus a chunk at a time (SentencePiece encodes each chunk on all cores), and training reads only
the sentence lengths into memory: about 8 bytes per pair. Stores are never deleted by mtkit; old ones
can be removed by hand at any time when no run is starting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import filelock
import numpy as np

from mtkit import untrusted
from mtkit.data.parallel import (
    NO_BUCKETS,
    Batch,
    DataError,
    FilterReport,
    ShapeBuckets,
    check_input_file,
    collate_flat,
    count_lines,
    file_digest,
    filter_pairs,
    token_batches,
)
from mtkit.data.tokenizer import Tokenizer
from mtkit.files import atomic_write_directory
from mtkit.progress import StageProgress, shows_bar

log = logging.getLogger("mtkit")

FORMAT = 1
CHUNK_PAIRS = 20_000  # pairs encoded at a time: enough for SentencePiece's threads, a few MiB of Python lists
SIDES = ("src", "tgt")
_META_MAX_BYTES = 1 << 20  # a meta.json is under 2 KB


def default_cache_dir() -> Path:
    """$MTKIT_CACHE_DIR, else $XDG_CACHE_HOME/mtkit/encoded, else ~/.cache/mtkit/encoded."""
    if os.environ.get("MTKIT_CACHE_DIR"):
        return Path(os.environ["MTKIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtkit" / "encoded"


def store_key(
    train_files: list[str | Path],
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    max_tokens: int,
    max_ratio: float,
    source_prefix: str = "",
    leads: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
) -> dict:
    """Everything the encoded pairs depend on; its digest names the store. ``source_prefix``: the tags put before
    each source, ``leads`` the language tokens' ids put before each source and target of a model told its
    languages by tokens (mtkit.data.directions), each part of the key only where there are some."""
    files = []
    for name in train_files:
        check_input_file(name)
        stat = Path(name).stat()
        files.append({"path": str(Path(name).resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    key = {
        "format": FORMAT,
        "files": files,
        "src_tokenizer": src_tok.sha256,
        "tgt_tokenizer": tgt_tok.sha256,
        "max_tokens": max_tokens,
        "max_ratio": max_ratio,
    }
    if source_prefix:
        key["source_prefix"] = source_prefix
    if any(leads):
        key["leads"] = [list(lead) for lead in leads]
    return key


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


ID_DTYPES = ("uint16", "int32")
FILTER_FIELDS = tuple(field.name for field in dataclasses.fields(FilterReport))


def _id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


class TokenStore:
    """A read-only encoded corpus: lengths in memory, token ids memory-mapped and read per batch."""

    def __init__(self, directory: Path, vocab_sizes: tuple[int, int] | None = None) -> None:
        """Opens the store; DataError if its files do not agree with its meta.json (damaged or edited).

        With ``vocab_sizes`` (source, target), every id is checked to be below them: one quick pass over
        the ids (docs/benchmarks.md, WMT-scale data) instead of a crash in the middle of training.
        """
        self.directory = Path(directory)
        try:
            self.meta = _check_meta(json.loads((self.directory / "meta.json").read_text()))
            self.ids = {side: self._map(f"{side}.ids", self.meta["dtype"][side]) for side in SIDES}
            self.offsets = {side: self._map(f"{side}.offsets", "int64") for side in SIDES}
        except (OSError, ValueError, RecursionError) as err:  # untrusted.Malformed is a ValueError
            raise DataError(f"{self.directory}: unreadable token store ({str(err)[:200]})") from None
        lengths = {}
        for side in SIDES:
            offsets = self.offsets[side]
            if len(offsets) != self.meta["pairs"] + 1 or len(self.ids[side]) != offsets[-1]:
                raise DataError(f"{self.directory}: damaged token store ({side} files do not match meta.json)")
            lengths[side] = np.diff(offsets)
            if offsets[0] != 0 or (len(offsets) > 1 and lengths[side].min() < 0):
                raise DataError(f"{self.directory}: damaged token store ({side}.offsets are not in order)")
        for side, vocab_size in zip(SIDES, vocab_sizes or ()):
            ids = self.ids[side]
            if len(ids) and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
                raise DataError(
                    f"{self.directory}: damaged token store ({side} ids outside the vocabulary of {vocab_size})"
                )
        self.src_lengths, self.tgt_lengths = (lengths[side].astype(np.int32) for side in SIDES)

    @property
    def file_sha256s(self) -> list[str] | None:
        """The SHA-256 of each training file encoded here, in the order of ``store_key``'s files, as they were when
        the store was built; None for a store built before they were recorded."""
        return self.meta.get("sha256")

    def _map(self, name: str, dtype: str) -> np.ndarray:
        return np.memmap(self.directory / name, dtype=np.dtype(dtype), mode="r")

    @property
    def report(self) -> FilterReport:
        return FilterReport(**self.meta["filter"])

    def __len__(self) -> int:
        return len(self.src_lengths)

    def sentence(self, side: str, index: int) -> list[int]:
        offsets = self.offsets[side]
        return self.ids[side][offsets[index] : offsets[index + 1]].tolist()

    def batch_indices(self, batch_tokens: int, seed: int, multiple: int = 1) -> list[np.ndarray]:
        return token_batches(self.src_lengths, self.tgt_lengths, batch_tokens, seed, multiple)

    def collate(self, indices: Iterable[int], buckets: ShapeBuckets = NO_BUCKETS) -> Batch:
        return collate_flat(*self._gather("src", indices), *self._gather("tgt", indices), buckets)

    def _gather(self, side: str, indices: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of sentences ``indices`` back to back, read in one indexing of the memory map, and their lengths."""
        indices = np.fromiter(indices, dtype=np.int64)
        offsets = self.offsets[side]
        starts, lengths = offsets[indices], offsets[indices + 1] - offsets[indices]
        before = np.cumsum(lengths) - lengths
        return self.ids[side][np.arange(int(lengths.sum())) + np.repeat(starts - before, lengths)], lengths

    def target_tokens(self, indices: np.ndarray) -> int:
        """Real target tokens of a batch (each sentence plus eos), known without collating it."""
        return int(self.tgt_lengths[indices].sum()) + len(indices)

    def batches(self, batch_tokens: int, seed: int) -> list[Batch]:
        return [self.collate(indices) for indices in self.batch_indices(batch_tokens, seed)]


def open_or_build(
    cache_dir: Path,
    pairs: Iterable[tuple[str, str]],
    key: dict,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
) -> TokenStore:
    """The store for ``key`` in ``cache_dir``, encoding ``pairs`` into it first unless it is there already.

    Builders of the same store take turns under a file lock, so two runs starting together encode
    once; a store appears whole (written aside, then renamed) or not at all.
    """
    cache_dir = Path(cache_dir)
    directory = cache_dir / _digest(key)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(cache_dir / f".{directory.name}.lock"):
        vocab_sizes = (src_tok.vocab_size, tgt_tok.vocab_size)
        store = _open_if_complete(directory, vocab_sizes)
        if store is not None:
            log.info("training data: reusing the encoded pairs in %s", directory)
        else:
            if changed := _edited_files(cache_dir, key):
                log.warning(
                    "training data: %s changed since an earlier run encoded it; encoding it again",
                    " and ".join(changed),
                )
            log.info("training data: encoding the pairs into %s", directory)
            atomic_write_directory(directory, lambda tmp: _encode(tmp, pairs, key, src_tok, tgt_tok))
            store = TokenStore(directory, vocab_sizes)
            seconds = max(store.meta["encode_seconds"], 1e-9)
            log.info(
                "training data: encoded %s pairs in %.1f s (%s pairs/s, %s tokens/s) into %s",
                f"{store.meta['read']:,}",
                seconds,
                f"{store.meta['read'] / seconds:,.0f}",
                f"{(store.meta['src_tokens'] + store.meta['tgt_tokens']) / seconds:,.0f}",
                directory,
            )
    log.info("training data: %s", store.report.describe())
    return store


def _open_if_complete(directory: Path, vocab_sizes: tuple[int, int]) -> TokenStore | None:
    """The store in ``directory`` if there is a whole one; a damaged one is reported, to be encoded again."""
    if not directory.exists():
        return None
    try:
        return TokenStore(directory, vocab_sizes)
    except DataError as err:
        log.warning("%s; encoding it again", err)
        return None


def _edited_files(cache_dir: Path, key: dict) -> list[str]:
    """The training files of ``key`` that another store in ``cache_dir`` encoded at another size or modification
    time. Its meta.json is untrusted: one that is not of the form written here is passed over."""
    now = {f["path"]: f for f in key["files"]}
    changed = set()
    for meta in cache_dir.glob("*/meta.json"):
        try:
            if meta.stat().st_size > _META_MAX_BYTES:
                continue
            files = json.loads(meta.read_text(encoding="utf-8"))["key"]["files"]
            changed.update(f["path"] for f in files if f["path"] in now and f != now[f["path"]])
        except (OSError, ValueError, RecursionError, LookupError, TypeError):  # unreadable, or not of that form
            continue
    return sorted(changed)


def _check_meta(meta: object) -> dict:
    """meta.json as ``_encode`` writes it: the counts and the two id types that are read back."""
    untrusted.mapping(meta, "meta.json", required=("pairs", "read", "src_tokens", "tgt_tokens", "filter", "dtype"))
    for name in ("pairs", "read", "src_tokens", "tgt_tokens"):
        untrusted.integer(meta[name], name)
    report = untrusted.mapping(meta["filter"], "filter", required=FILTER_FIELDS, optional=())
    for name in FILTER_FIELDS:
        untrusted.integer(report[name], f"filter.{name}")
    dtypes = untrusted.mapping(meta["dtype"], "dtype", required=SIDES, optional=())
    for side in SIDES:
        untrusted.one_of(dtypes[side], f"dtype.{side}", ID_DTYPES)  # a name of a numpy type, from a fixed set
    for i, digest in enumerate(untrusted.strings(meta.get("sha256", []), "sha256")):  # none in older stores
        untrusted.sha256(digest, f"sha256[{i}]")
    return meta


def _encode(tmp: Path, pairs: Iterable[tuple[str, str]], key: dict, src_tok: Tokenizer, tgt_tok: Tokenizer) -> None:
    """Encode, filter and append ``pairs`` chunk by chunk; then write the offsets and meta.json.

    The pairs to come are the source file's lines: counted first for the bar's total where that is cheap.
    """
    start = time.perf_counter()
    digests = [file_digest(f["path"]) for f in key["files"]]  # one read, cheap beside the encoding
    total = count_lines(key["files"][0]["path"]) if shows_bar() else None
    # open_or_build logs the start, and the end with the token counts
    bar = StageProgress("encoding the training pairs", total, "pairs", log_ends=False)
    dtypes = {"src": _id_dtype(src_tok.vocab_size), "tgt": _id_dtype(tgt_tok.vocab_size)}
    lengths: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
    report, read = FilterReport(0, 0, 0, 0), 0
    pairs = iter(pairs)
    with open(tmp / "src.ids", "wb") as src_out, open(tmp / "tgt.ids", "wb") as tgt_out, bar:
        while chunk := list(itertools.islice(pairs, CHUNK_PAIRS)):
            read += len(chunk)
            src, tgt, chunk_report = filter_pairs(
                src_tok.encode([s for s, _ in chunk]),
                tgt_tok.encode([t for _, t in chunk]),
                key["max_tokens"],
                key["max_ratio"],
            )
            report += chunk_report
            if "leads" in key:  # after the filter, which counts the text's tokens alone
                src_lead, tgt_lead = key["leads"]
                src, tgt = [src_lead + ids for ids in src], [tgt_lead + ids for ids in tgt]
            for side, encoded, out in (("src", src, src_out), ("tgt", tgt, tgt_out)):
                side_lengths = np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded))
                flat = itertools.chain.from_iterable(encoded)
                np.fromiter(flat, dtype=dtypes[side], count=int(side_lengths.sum())).tofile(out)
                lengths[side].append(side_lengths)
            bar.advance(len(chunk))
    if not report.kept:
        files = " and ".join(f["path"] for f in key["files"])
        raise DataError(f"{files}: no usable training pairs ({report.describe()})")
    tokens = {}
    for side in SIDES:
        side_lengths = np.concatenate(lengths[side])
        offsets = np.zeros(len(side_lengths) + 1, dtype=np.int64)
        np.cumsum(side_lengths, out=offsets[1:], dtype=np.int64)
        offsets.tofile(tmp / f"{side}.offsets")
        tokens[side] = int(offsets[-1])
    meta = {
        "key": key,
        "read": read,
        "pairs": report.kept,
        "src_tokens": tokens["src"],
        "tgt_tokens": tokens["tgt"],
        "filter": dataclasses.asdict(report),
        "dtype": {side: dtypes[side].name for side in SIDES},
        "sha256": digests,
        "encode_seconds": round(time.perf_counter() - start, 3),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
