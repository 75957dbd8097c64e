"""Parallel text in, token-budget batches out.

Reading is strict and names file and line on any problem; batching sorts by length and fills each
batch up to a budget of padded tokens, so padding stays small and batches stay similar in cost.
"""

from __future__ import annotations

import gzip
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mtkit.tokenizer import BOS_ID, EOS_ID, PAD_ID


class DataError(ValueError):
    """Unusable input data; the message names the file (and line) at fault."""


def _open_binary(path: Path):
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def iter_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (gzip detected by content), without line terminators, one at a time."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        with _open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                try:
                    yield raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}:{number}: invalid UTF-8 (byte {err.start + 1} of the line)") from None
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"{path}: cannot read ({err})") from None


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file (gzip detected by content), without line terminators."""
    return list(iter_lines(path))


def is_tsv(path: str | Path) -> bool:
    name = str(path).lower()
    return name.endswith(".tsv") or name.endswith(".tsv.gz")


def read_parallel(src_path: str | Path, tgt_path: str | Path | None) -> tuple[list[str], list[str]]:
    """Line-aligned (source, target) sentences from two files, or from one two-column TSV file."""
    if not tgt_path:
        if not is_tsv(src_path):
            raise DataError(f"{src_path}: a target file is needed unless the source is a .tsv file")
        src, tgt = [], []
        for number, line in enumerate(read_lines(src_path), start=1):
            fields = line.split("\t")
            if len(fields) != 2:
                raise DataError(f"{src_path}:{number}: expected 2 tab-separated columns, found {len(fields)}")
            src.append(fields[0])
            tgt.append(fields[1])
    else:
        src, tgt = read_lines(src_path), read_lines(tgt_path)
        if len(src) != len(tgt):
            raise DataError(
                f"parallel files differ in length: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}"
            )
    if not src:
        raise DataError(f"{src_path}: empty corpus (no lines)")
    return src, tgt


@dataclass(frozen=True)
class FilterReport:
    kept: int
    empty: int
    too_long: int
    bad_ratio: int

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
    """One padded batch. tgt_in = bos + y, tgt_out = y + eos; src_pad_mask is True at padding."""

    src: Tensor  # (B, S)
    src_pad_mask: Tensor  # (B, S)
    tgt_in: Tensor  # (B, T)
    tgt_out: Tensor  # (B, T)

    @property
    def target_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(t.to(device, non_blocking=True) for t in (self.src, self.src_pad_mask, self.tgt_in, self.tgt_out))
        )


def pad(seqs: list[list[int]], prefix: list[int] = (), suffix: list[int] = ()) -> Tensor:
    """(B, L) right-padded tensor of prefix + seq + suffix for each sequence."""
    rows = [list(prefix) + list(s) + list(suffix) for s in seqs]
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def source_tensor(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Source ids + eos, padded, and its padding mask."""
    src = pad(seqs, suffix=[EOS_ID])
    return src, src == PAD_ID


def collate(src: list[list[int]], tgt: list[list[int]]) -> Batch:
    src_ids, src_pad_mask = source_tensor(src)
    return Batch(src_ids, src_pad_mask, pad(tgt, prefix=[BOS_ID]), pad(tgt, suffix=[EOS_ID]))


def token_batches(src_lens: list[int], tgt_lens: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Indices grouped into batches of at most ``batch_tokens`` padded tokens per side, shuffled.

    Examples are ordered by length (ties broken at random, so batches differ between epochs), cut
    greedily into batches, and the batch order is shuffled. A pair longer than the budget alone
    still forms a batch of one rather than being lost.
    """
    rng = random.Random(seed)
    order = list(range(len(src_lens)))
    rng.shuffle(order)
    order.sort(key=lambda i: (tgt_lens[i], src_lens[i]))
    batches, current, longest = [], [], 0
    for i in order:
        length = max(src_lens[i], tgt_lens[i]) + 1  # + eos (or bos)
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches
