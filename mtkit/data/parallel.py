"""Parallel text in, token-budget batches out.

Reading is strict and names file and line on any problem; batching sorts by length and fills each
batch up to a budget of padded tokens, so padding stays small and batches stay similar in cost.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtkit.errors import MtkitError
from mtkit.files import file_sha256


class DataError(MtkitError, ValueError):
    """Unusable input data; the message names the file (and line) at fault."""


@contextlib.contextmanager
def open_binary(path: str | Path) -> Iterator[BinaryIO]:
    """``path`` opened for reading bytes, through gzip when its content starts as gzip does.

    The first bytes are peeked at, not read, so a pipe or FIFO (``<(zcat ...)``) works too.
    """
    with open(path, "rb") as f:
        if f.peek(2)[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=f, mode="rb") as unzipped:
                yield unzipped
        else:
            yield f


def count_lines(path: str | Path) -> int | None:
    """Lines in a regular uncompressed file, counted as the readers here split them (a last line without
    ``\\n`` counts), in 1 MiB chunks: a quick pass beside the real reading (docs/benchmarks.md, WMT-scale
    data). None for gzip, a pipe or an unreadable file, whose lines cannot be counted without reading them
    all for real."""
    count, last = 0, b"\n"
    try:
        if not Path(path).is_file():
            return None
        with open(path, "rb") as f:
            if f.peek(2)[:2] == b"\x1f\x8b":
                return None
            while chunk := f.read(1 << 20):
                count, last = count + chunk.count(b"\n"), chunk[-1:]
    except OSError:
        return None
    return count + (last != b"\n")


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Errors of reading ``path`` (unreadable, or a corrupt or truncated .gz) as one DataError naming it."""
    try:
        yield
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err) or type(err).__name__
        if isinstance(err, (EOFError, zlib.error, gzip.BadGzipFile)):
            reason = f"corrupt or truncated gzip data: {reason}"
        raise DataError(f"{path}: cannot read ({reason})") from None


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a data file's bytes; an unreadable file is a DataError naming it, as ``reading`` says."""
    with reading(path):
        return file_sha256(Path(path))


UTF8_BOM = b"\xef\xbb\xbf"


def check_input_file(path: str | Path, stream_ok: bool = False) -> None:
    """DataError unless ``path`` is an existing file (a folder or a missing path are named as such).

    With ``stream_ok`` a pipe, FIFO or device (``/dev/null``, ``<(...)``) will do too: for input that
    is read once. Training data is read more than once, so it must be a regular file.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a folder, not a text file")
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not stream_ok and not path.is_file():
        raise DataError(f"{path}: not a regular file (training data is read more than once; copy it to a file)")


def iter_lines(path: str | Path, allow_nul: bool = False) -> Iterator[str]:
    """The lines of a UTF-8 text file (gzip detected by content), without line terminators, one at a time.

    CRLF endings and a byte-order mark are accepted, as editors on Windows write them. Invalid UTF-8 is
    an error naming the line, and so is a NUL byte (binary data, or text pasted from it) unless
    ``allow_nul``: corpora being prepared are cleaned of control characters anyway.
    """
    path = Path(path)
    check_input_file(path, stream_ok=True)
    with reading(path), open_binary(path) as f:
        yield from iter_stream_lines(f, path, allow_nul)


def iter_stream_lines(stream: BinaryIO, name: str | Path, allow_nul: bool = False) -> Iterator[str]:
    """The lines of an open binary stream (standard input), checked and decoded as ``iter_lines`` does a file's."""
    for number, raw in enumerate(stream, start=1):
        if number == 1:
            raw = raw.removeprefix(UTF8_BOM)
        if not allow_nul and b"\0" in raw:
            raise DataError(f"{name}:{number}: NUL byte (byte {raw.index(0) + 1} of the line): binary data, not text")
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as err:
            raise DataError(f"{name}:{number}: invalid UTF-8 (byte {err.start + 1} of the line)") from None


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file (gzip detected by content), without line terminators."""
    return list(iter_lines(path))


def is_tsv(path: str | Path) -> bool:
    name = str(path).lower()
    return name.endswith(".tsv") or name.endswith(".tsv.gz")


def iter_parallel(src_path: str | Path, tgt_path: str | Path | None) -> Iterator[tuple[str, str]]:
    """Line-aligned (source, target) pairs from two files, or from one two-column TSV file, streamed.

    A corpus of any size passes through in constant memory. Missing files are reported at once;
    files of different lengths when the shorter one ends (with both line counts), and an empty
    corpus when it turns out to have no line.
    """
    if not tgt_path and not is_tsv(src_path):
        raise DataError(f"{src_path}: a target file is needed unless the source is a .tsv file")
    for path in (src_path, tgt_path) if tgt_path else (src_path,):
        check_input_file(path)
    return _nonempty(_tsv_pairs(src_path) if not tgt_path else iter_aligned(src_path, tgt_path), src_path)


def _nonempty(pairs: Iterator[tuple[str, str]], src_path: str | Path) -> Iterator[tuple[str, str]]:
    empty = True
    for pair in pairs:
        empty = False
        yield pair
    if empty:
        raise DataError(f"{src_path}: empty corpus (no lines)")


def _tsv_pairs(path: str | Path) -> Iterator[tuple[str, str]]:
    for number, line in enumerate(iter_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{path}:{number}: expected 2 tab-separated columns, found {len(fields)}")
        yield fields[0], fields[1]


def iter_aligned(src_path: str | Path, tgt_path: str | Path, allow_nul: bool = False) -> Iterator[tuple[str, str]]:
    """The lines of two files side by side; DataError with both line counts if one ends first."""
    src_lines, tgt_lines = iter_lines(src_path, allow_nul), iter_lines(tgt_path, allow_nul)
    for count, pair in enumerate(itertools.zip_longest(src_lines, tgt_lines), start=1):
        if None in pair:
            n_src = count - 1 + sum(1 for _ in src_lines) + (pair[0] is not None)
            n_tgt = count - 1 + sum(1 for _ in tgt_lines) + (pair[1] is not None)
            raise DataError(f"parallel files differ in length: {src_path} has {n_src} lines, {tgt_path} has {n_tgt}")
        yield pair


def read_parallel(src_path: str | Path, tgt_path: str | Path | None) -> tuple[list[str], list[str]]:
    """All line-aligned (source, target) sentences of a corpus small enough to hold, e.g. a validation set."""
    src, tgt = [], []
    for s, t in iter_parallel(src_path, tgt_path):
        src.append(s)
        tgt.append(t)
    return src, tgt


@dataclass(frozen=True)
class FilterReport:
    kept: int
    empty: int
    too_long: int
    bad_ratio: int

    def __add__(self, other: FilterReport) -> FilterReport:
        return FilterReport(
            self.kept + other.kept,
            self.empty + other.empty,
            self.too_long + other.too_long,
            self.bad_ratio + other.bad_ratio,
        )

    def describe(self) -> str:
        dropped = self.empty + self.too_long + self.bad_ratio
        return (
            f"kept {self.kept} pairs, dropped {dropped} "
            f"({self.empty} empty, {self.too_long} too long, {self.bad_ratio} beyond the length ratio)"
        )


def filter_pairs(
    src: list[list[int]], tgt: list[list[int]], max_tokens: int, max_ratio: float
) -> tuple[list[list[int]], list[list[int]], FilterReport]:
    """Drop empty pairs, pairs with a side over ``max_tokens`` and pairs beyond ``max_ratio``."""
    keep_src, keep_tgt = [], []
    empty = too_long = bad_ratio = 0
    for s, t in zip(src, tgt):
        if not s or not t:
            empty += 1
        elif len(s) > max_tokens or len(t) > max_tokens:
            too_long += 1
        elif max(len(s), len(t)) > max_ratio * min(len(s), len(t)):
            bad_ratio += 1
        else:
            keep_src.append(s)
            keep_tgt.append(t)
    return keep_src, keep_tgt, FilterReport(len(keep_src), empty, too_long, bad_ratio)


@dataclass
class Batch:
    """One padded batch. tgt_in = bos + y, tgt_out = y + eos; src_pad_mask is True at padding.

    ``target_index`` lists the real (non-pad) positions of tgt_out, flattened, known when the batch is made: the
    loss gathers them by index, where a boolean mask would make an accelerator report their number to the host.
    """

    src: Tensor  # (B, S)
    src_pad_mask: Tensor  # (B, S)
    tgt_in: Tensor  # (B, T)
    tgt_out: Tensor  # (B, T)
    target_index: Tensor | None = None  # (N,) int64, into tgt_out.flatten()

    @property
    def target_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())

    def tensors(self) -> tuple[Tensor, ...]:
        """What the training loss takes, in order."""
        tensors = (self.src, self.src_pad_mask, self.tgt_in, self.tgt_out)
        return tensors if self.target_index is None else (*tensors, self.target_index)

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in self.tensors()))

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory, which a GPU copies from while it computes (``to`` does not wait)."""
        return Batch(*(t.pin_memory() for t in self.tensors()))


@dataclass(frozen=True)
class ShapeBuckets:
    """Batch shapes from a small set, so that a compiled training step meets few shapes.

    With ``multiple`` above 1 each side's padded length is rounded up to a multiple of it (8 suits tensor
    cores; never past ``max_width``, the model's positions), and a batch's rows are padded with empty pairs
    to the most ``batch_tokens`` holds at its longer side's length, which the batcher then cuts by: a side
    of length L has at most L / multiple + 1 widths, and the rows follow from them. Padding is masked as any
    padding is, so the loss is unchanged. ``multiple`` 1 pads to the longest sentence of each batch, nothing
    more.
    """

    multiple: int = 1
    batch_tokens: int = 0
    max_width: int = 1 << 62  # the model's positions: a width rounded past them is cut back to them

    def width(self, longest: int) -> int:
        return max(longest, min(-(-longest // self.multiple) * self.multiple, self.max_width))

    def rows(self, pairs: int, longer_width: int) -> int:
        if self.multiple == 1 or not self.batch_tokens:
            return pairs
        return max(pairs, self.batch_tokens // longer_width)


NO_BUCKETS = ShapeBuckets()


def pad(seqs: list[list[int]], prefix: list[int] = (), suffix: list[int] = ()) -> Tensor:
    """(B, L) right-padded tensor of prefix + seq + suffix for each sequence."""
    return pad_flat(*_back_to_back(seqs), prefix, suffix)


def _back_to_back(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' ids concatenated, and their lengths: what ``pad_flat`` takes."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    return np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum())), lengths


def pad_flat(
    flat: np.ndarray,
    lengths: np.ndarray,
    prefix: list[int] = (),
    suffix: list[int] = (),
    width: int = 0,
    rows: int = 0,
) -> Tensor:
    """``pad`` for sequences given back to back in ``flat``, with their ``lengths``; at least ``width`` columns
    and ``rows`` rows (the rows after the sequences' hold the prefix alone).

    One scatter into the padded array: a row at a time was slower (docs/benchmarks.md, "What moved the
    training figures").
    """
    return torch.from_numpy(_padded(flat, lengths, prefix, suffix, width, rows))


def _padded(
    flat: np.ndarray, lengths: np.ndarray, prefix: list[int], suffix: list[int], width: int = 0, rows: int = 0
) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    count = len(lengths)
    columns = max(width, len(prefix) + int(lengths.max()) + len(suffix))
    out = np.full((max(rows, count), columns), PAD_ID, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    row_of = np.repeat(np.arange(count), lengths)
    out[row_of, np.arange(len(flat)) - starts[row_of] + len(prefix)] = flat
    for column, token in enumerate(prefix):
        out[:, column] = token
    for offset, token in enumerate(suffix):
        out[np.arange(count), lengths + len(prefix) + offset] = token
    return out


def source_tensor(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Source ids + eos, padded, and its padding mask."""
    src = pad(seqs, suffix=[EOS_ID])
    return src, src == PAD_ID


def collate(src: list[list[int]], tgt: list[list[int]]) -> Batch:
    return collate_flat(*_back_to_back(src), *_back_to_back(tgt))


def collate_flat(
    src: np.ndarray,
    src_lengths: np.ndarray,
    tgt: np.ndarray,
    tgt_lengths: np.ndarray,
    buckets: ShapeBuckets = NO_BUCKETS,
) -> Batch:
    """``collate`` for sentences given back to back, as a token store holds them, in ``buckets``' shapes.

    A row added to fill a shape is an empty pair: a source of eos alone (a row of padding alone would leave
    attention nothing to attend to), and a target with nothing to predict.
    """
    src_width = buckets.width(int(np.max(src_lengths)) + 1)
    tgt_width = buckets.width(int(np.max(tgt_lengths)) + 1)
    rows = buckets.rows(len(src_lengths), max(src_width, tgt_width))
    src_ids = _padded(src, src_lengths, [], [EOS_ID], src_width, rows)
    src_ids[len(src_lengths) :, 0] = EOS_ID
    tgt_out = _padded(tgt, tgt_lengths, [], [EOS_ID], tgt_width, rows)
    return Batch(
        torch.from_numpy(src_ids),
        torch.from_numpy(src_ids == PAD_ID),
        pad_flat(tgt, tgt_lengths, [BOS_ID], [], tgt_width, rows),
        torch.from_numpy(tgt_out),
        torch.from_numpy(np.flatnonzero(tgt_out != PAD_ID)),
    )


def token_batches(
    src_lens: np.ndarray, tgt_lens: np.ndarray, batch_tokens: int, seed: int, multiple: int = 1
) -> list[np.ndarray]:
    """Indices grouped into batches of at most ``batch_tokens`` padded tokens per side, shuffled; padded
    lengths counted rounded up to ``multiple`` (ShapeBuckets).

    Examples are ordered by target length and, within one target length, by source length, up
    for even target lengths and down for odd ones: this "snake" order keeps source lengths close
    where one target length gives way to the next, so no batch straddles a short and a long source
    and less of each batch is padding (docs/benchmarks.md, "What moved the training figures"). Ties are
    broken at random, so batches differ between epochs. The order is cut greedily into batches, and the
    batch order is shuffled. A pair longer than the budget alone still forms a batch of one rather than
    being lost. Index arrays rather than lists keep an epoch of a WMT-size corpus at a few bytes per pair.
    """
    rng = np.random.default_rng(seed)
    src_lens, tgt_lens = np.asarray(src_lens, dtype=np.int64), np.asarray(tgt_lens, dtype=np.int64)
    order = rng.permutation(len(src_lens))
    longest_src = int(src_lens.max(initial=0))
    src_rank = np.where(tgt_lens[order] % 2 == 0, src_lens[order], longest_src - src_lens[order])
    key = tgt_lens[order] * (longest_src + 1) + src_rank
    order = order[np.argsort(key, kind="stable")]
    lengths = np.maximum(src_lens, tgt_lens)[order] + 1  # + eos (or bos)
    lengths = (-(-lengths // multiple) * multiple).tolist()
    cuts, start, longest = [], 0, 0
    for position, length in enumerate(lengths):
        if position > start and max(longest, length) * (position - start + 1) > batch_tokens:
            cuts.append(position)
            start, longest = position, 0
        longest = max(longest, length)
    batches = np.split(order, cuts)
    return [batches[i] for i in rng.permutation(len(batches))]
