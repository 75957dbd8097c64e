"""Cleaning of parallel corpora before tokenizer training: normalise, filter by length and ratio, deduplicate.

It streams, so a WMT-sized corpus (4.5M pairs) costs no more memory than Multi30k, except for the
deduplication set: one 8-byte blake2b digest per kept pair, about 8 bytes each in ``SeenDigests``
(36 MiB for 4.5M pairs). Two different pairs share a digest with probability about n^2 / 2^65, under
1e-6 at that size.
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
import re
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from mtkit.config import CleanConfig

# Format characters (Unicode category Cf) that real text needs, kept while every other Cf is removed:
# ZWNJ and ZWJ shape Persian, Arabic and Indic words and join emoji sequences (👩‍💻); the tag characters
# spell subdivision flags (🏴 + "gbeng" + cancel tag = England); prepended concatenation marks such as the
# Arabic number sign U+0600 and end of ayah U+06DD are visible signs, not formatting.
_KEPT_FORMAT = {0x200C, 0x200D, *range(0xE0020, 0xE0080), *range(0x0600, 0x0606), 0x06DD, 0x070F}
_KEPT_FORMAT |= {0x0890, 0x0891, 0x08E2, 0x110BD, 0x110CD}


@functools.cache
def _invisible() -> re.Pattern[str]:
    """Control and format characters to delete; whitespace controls (tab, CR, NEL...) are left for ``str.split``.

    Built on first use (it scans every code point), so importing this module stays instant.
    """
    codes = [
        c
        for c in range(sys.maxunicode + 1)
        if unicodedata.category(chr(c)) in ("Cc", "Cf") and not chr(c).isspace() and c not in _KEPT_FORMAT
    ]
    ranges: list[list[int]] = []
    for c in codes:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    # A class of ranges, not of single characters: it matches faster (docs/benchmarks.md, WMT-scale data).
    return re.compile("[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges) + "]")


@dataclass
class CleanSummary:
    """Counts of every decision; each dropped pair is counted once, under the first rule that drops it."""

    read: int = 0
    kept: int = 0
    empty: int = 0
    too_short: int = 0
    too_long: int = 0
    ratio: int = 0
    duplicate: int = 0
    changed: int = 0  # lines (one side of a pair) altered by normalisation, whether or not the pair was kept

    def line(self) -> str:
        return (
            f"read {self.read:,} pairs, kept {self.kept:,}; dropped {self.empty:,} empty, "
            f"{self.too_short:,} too short, {self.too_long:,} too long, {self.ratio:,} by length ratio, "
            f"{self.duplicate:,} duplicates; {self.changed:,} lines normalised"
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def strip_invisible(text: str) -> str:
    """``text`` without the control and format characters ``normalize`` deletes (whitespace controls stay)."""
    return _invisible().sub("", text)


def normalize(text: str, nfkc: bool) -> str:
    """Text with control and format characters removed, whitespace collapsed to single spaces, and stripped.

    Control characters (Cc) that are whitespace (tab, CR, LF, NEL...) become a space; the others (NUL, DEL,
    escape...) are deleted. Format characters (Cf) are deleted: BOM U+FEFF, soft hyphen U+00AD, zero-width
    space, bidi marks and the like; except the few in ``_KEPT_FORMAT`` (ZWNJ, ZWJ, emoji tags, Arabic marks)
    whose loss changes what the text says. All Unicode whitespace, no-break spaces included, becomes one
    space. Deletion happens before NFKC so that combining marks a soft hyphen separated compose.
    """
    text = strip_invisible(text)
    if nfkc:
        text = unicodedata.normalize("NFKC", text)
    return " ".join(text.split())


def clean_pairs(pairs: Iterable[tuple[str, str]], cfg: CleanConfig, summary: CleanSummary) -> Iterator[tuple[str, str]]:
    """Normalised pairs that pass the filters, in input order; counts every decision in ``summary``.

    Lazy: each input pair is read only when the next output is asked for, so it works on endless streams.
    """
    seen = SeenDigests()
    for src_raw, tgt_raw in pairs:
        summary.read += 1
        src, tgt = normalize(src_raw, cfg.nfkc), normalize(tgt_raw, cfg.nfkc)
        summary.changed += (src != src_raw) + (tgt != tgt_raw)
        if not src or not tgt:
            summary.empty += 1
            continue
        # Normalised text has single spaces and no edge spaces, so words are spaces + 1.
        src_words, tgt_words = src.count(" ") + 1, tgt.count(" ") + 1
        shorter, longer = min(src_words, tgt_words), max(src_words, tgt_words)
        if shorter < cfg.min_words:
            summary.too_short += 1
        elif longer > cfg.max_words:
            summary.too_long += 1
        elif longer > cfg.max_ratio * shorter:
            summary.ratio += 1
        elif cfg.dedupe and not seen.add(_digest(src, tgt)):
            summary.duplicate += 1
        else:
            summary.kept += 1
            yield src, tgt


def _digest(src: str, tgt: str) -> int:
    """64 bits standing for the pair; a tab cannot occur in normalised text, so it separates the sides."""
    return int.from_bytes(hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).digest(), "little")


class SeenDigests:
    """A set of 64-bit digests at about 8 bytes each, so deduplicating a WMT-size corpus stays small.

    A Python set costs about 70 bytes per digest (over 300 MiB for WMT14's 4.5M pairs). Here the
    newest digests sit in a set of at most ``spill`` entries, the rest in a sorted array. Digests are
    uniform, so their top 16 bits pick a bucket of the array directly and a lookup bisects only
    that bucket (a few dozen entries) instead of the whole array.
    """

    BUCKET_SHIFT = 48

    def __init__(self, spill: int = 1 << 18) -> None:
        self.spill = spill
        self.recent: set[int] = set()
        self.older = np.empty(0, dtype=np.uint64)
        self._older_view = memoryview(self.older)  # bisect reads it as Python ints, no numpy call per lookup
        self._bucket_starts = array.array("q", bytes(8 * ((1 << (64 - self.BUCKET_SHIFT)) + 1)))

    def add(self, digest: int) -> bool:
        """Records ``digest``; False if it was there already."""
        if digest in self.recent:
            return False
        bucket = digest >> self.BUCKET_SHIFT
        lo, hi = self._bucket_starts[bucket], self._bucket_starts[bucket + 1]
        position = bisect.bisect_left(self._older_view, digest, lo, hi)
        if position < hi and self._older_view[position] == digest:
            return False
        self.recent.add(digest)
        if len(self.recent) >= self.spill:
            self._spill()
        return True

    def _spill(self) -> None:
        """Move the recent digests into the sorted array."""
        newer = np.sort(np.fromiter(self.recent, np.uint64, len(self.recent)))
        self.older = np.sort(np.concatenate([self.older, newer]), kind="stable")  # merges two sorted runs
        self._older_view = memoryview(self.older)
        firsts = np.arange(len(self._bucket_starts) - 1, dtype=np.uint64) << np.uint64(self.BUCKET_SHIFT)
        starts = np.append(self.older.searchsorted(firsts), len(self.older)).astype(np.int64)
        self._bucket_starts = array.array("q", starts.tobytes())
        self.recent.clear()

    def __len__(self) -> int:
        return len(self.recent) + len(self.older)
