"""Vocabulary shortlists: decode over the target tokens a batch's source tokens can translate to.

The output projection and the softmax over an 8k-32k vocabulary are a third to a half of a
decoding step. With a shortlist, each batch projects onto the union of its source tokens'
candidates instead (a few thousand ids), as Marian's lexical shortlists and CTranslate2's
vocabulary maps do. It is an opt-in that can change outputs: probabilities are normalised over
the candidates, and a token outside them cannot be produced.

A shortlist is built from training pairs. Each source token keeps the ``per_source`` target
tokens with the highest Dice coefficient of sentence co-occurrence (2 c(s, t) / (c(s) + c(t)),
which favours translations over merely frequent tokens), and the ``frequent`` most frequent
target tokens are candidates for every batch, as are the special ids. It is stored as
safetensors beside the model, tied to the tokenizers it was built with (their SHA-256).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mtkit.config import MAX_PER_SOURCE, ShortlistConfig
from mtkit.data.tokenizer import EOS_ID, Tokenizer
from mtkit.errors import MtkitError
from mtkit.model.transformer import Candidates

CHUNK_PAIRS = 20_000  # pairs whose co-occurrences are counted at once
# A batch's candidates are rounded up to a multiple of this many ids (with the lowest ids not among them):
# oneDNN builds a bf16 matmul kernel for every new shape, so fewer candidate counts make bf16 search faster
# (docs/benchmarks.md, "Vocabulary shortlist").
CANDIDATE_MULTIPLE = 256
FORMAT = "mtkit-shortlist-1"


class ShortlistError(MtkitError, ValueError):
    """A shortlist file that is unreadable, malformed or built for other tokenizers."""


@dataclass(frozen=True)
class Shortlist:
    table: Tensor  # (source vocabulary, per_source) target ids per source id, -1 where it has fewer
    always: Tensor  # target ids that are candidates for every batch: the special ids and the most frequent
    tgt_vocab: int  # the target vocabulary's size
    src_sha256: str
    tgt_sha256: str

    def candidates(self, src: Tensor, prefixes: list[list[int]] | None = None) -> Candidates:
        """The candidates of a batch of source ids (B, S): its tokens' shortlists, the fixed ones and
        the tokens of any forced target prefixes, on ``src``'s device."""
        ids = self.table.to(src.device)[src.flatten()].flatten()
        parts = [self.always.to(src.device), ids[ids >= 0]]
        if prefixes:
            parts.append(torch.tensor([t for p in prefixes for t in p], dtype=torch.long, device=src.device))
        ids = torch.unique(torch.cat(parts))
        short = min(-ids.numel() % CANDIDATE_MULTIPLE, self.tgt_vocab - ids.numel())
        if short:
            unused = torch.ones(self.tgt_vocab, dtype=torch.bool, device=src.device)
            unused[ids] = False
            ids = torch.unique(torch.cat([ids, unused.nonzero().squeeze(1)[:short]]))
        return Candidates(ids)

    def save(self, path: Path) -> None:
        from safetensors.torch import save

        from mtkit.files import atomic_write

        meta = {"format": FORMAT, "src_sha256": self.src_sha256, "tgt_sha256": self.tgt_sha256}
        tensors = {"table": self.table.to(torch.int32).contiguous(), "always": self.always.to(torch.int32)}
        atomic_write(Path(path), lambda f: f.write(save(tensors, metadata=meta)))


def co_occurring_pairs(
    src_tok: Tokenizer, tgt_tok: Tokenizer, pairs: Iterable[tuple[str, str]], max_pairs: int = ShortlistConfig.pairs
) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """The first ``max_pairs`` text pairs, encoded a chunk at a time: (source ids, target ids) per chunk."""
    it = islice(iter(pairs), max_pairs)
    while chunk := list(islice(it, CHUNK_PAIRS)):
        yield src_tok.encode([s for s, _ in chunk]), tgt_tok.encode([t for _, t in chunk])


def build_shortlist(
    chunks: Iterable[tuple[list[list[int]], list[list[int]]]],
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    per_source: int = ShortlistConfig.per_source,
    frequent: int = ShortlistConfig.frequent,
) -> Shortlist:
    """A shortlist from encoded training pairs (``co_occurring_pairs``), for these tokenizers."""
    if not 1 <= per_source <= MAX_PER_SOURCE:
        raise ShortlistError(f"per_source must be between 1 and {MAX_PER_SOURCE}, got {per_source}")
    if frequent < 0:
        raise ShortlistError(f"frequent must be >= 0, got {frequent}")
    n_src, n_tgt = src_tok.vocab_size, tgt_tok.vocab_size
    keys = np.zeros(0, np.int64)  # distinct s * n_tgt + t seen together, with their sentence counts
    counts = np.zeros(0, np.int64)
    src_sentences = np.zeros(n_src, np.int64)  # sentences holding each source token
    tgt_sentences = np.zeros(n_tgt, np.int64)
    tgt_tokens = np.zeros(n_tgt, np.int64)  # occurrences of each target token
    for src_ids, tgt_ids in chunks:
        chunk_keys, src_sets, tgt_sets = [], [], []
        for s, t in zip(src_ids, tgt_ids):
            s_set, t_set = np.unique(np.asarray(s, np.int64)), np.unique(np.asarray(t, np.int64))
            src_sets.append(s_set)
            tgt_sets.append(t_set)
            chunk_keys.append((s_set[:, None] * n_tgt + t_set[None, :]).ravel())
        src_sentences += np.bincount(np.concatenate([np.zeros(0, np.int64), *src_sets]), minlength=n_src)
        tgt_sentences += np.bincount(np.concatenate([np.zeros(0, np.int64), *tgt_sets]), minlength=n_tgt)
        every_target = np.fromiter((t for seq in tgt_ids for t in seq), np.int64)
        tgt_tokens += np.bincount(every_target, minlength=n_tgt)
        merged, at = np.unique(np.concatenate([keys, *chunk_keys]), return_inverse=True)
        added = np.concatenate([counts, np.ones(sum(k.size for k in chunk_keys), np.int64)])
        keys, counts = merged, np.bincount(at, weights=added, minlength=merged.size).astype(np.int64)
    if not keys.size:
        raise ShortlistError("no training pairs to build a shortlist from")
    s_of, t_of = keys // n_tgt, keys % n_tgt
    dice = 2 * counts / (src_sentences[s_of] + tgt_sentences[t_of])
    order = np.lexsort((t_of, -dice, s_of))  # by source, then best first (ties: lower id)
    s_sorted, t_sorted = s_of[order], t_of[order]
    starts = np.searchsorted(s_sorted, np.arange(n_src))
    rank = np.arange(s_sorted.size) - starts[s_sorted]
    keep = rank < per_source
    table = np.full((n_src, per_source), -1, np.int64)
    table[s_sorted[keep], rank[keep]] = t_sorted[keep]
    specials = np.arange(EOS_ID + 1)
    most_frequent = np.argsort(-tgt_tokens, kind="stable")[:frequent]
    always = np.union1d(specials, most_frequent[tgt_tokens[most_frequent] > 0])
    return Shortlist(torch.from_numpy(table), torch.from_numpy(always), n_tgt, src_tok.sha256, tgt_tok.sha256)


def load_shortlist(path: Path, src_tok: Tokenizer, tgt_tok: Tokenizer) -> Shortlist:
    """A shortlist file, checked before use: its format, shapes, ids and that it was built for these tokenizers."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ShortlistError(f"{path}: shortlist not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or set(f.keys()) != {"table", "always"}:
                raise ShortlistError(f"{path}: not an mtkit shortlist (`mtkit shortlist` writes one)")
            if (meta.get("src_sha256"), meta.get("tgt_sha256")) != (src_tok.sha256, tgt_tok.sha256):
                raise ShortlistError(f"{path}: built for other tokenizers than this model's")
            table_shape, always_shape = f.get_slice("table").get_shape(), f.get_slice("always").get_shape()
            if (
                len(table_shape) != 2
                or table_shape[0] != src_tok.vocab_size
                or not 1 <= table_shape[1] <= MAX_PER_SOURCE
            ):
                raise ShortlistError(
                    f"{path}: table has shape {table_shape}, expected ({src_tok.vocab_size}, 1..{MAX_PER_SOURCE})"
                )
            if len(always_shape) != 1 or always_shape[0] > tgt_tok.vocab_size:
                raise ShortlistError(
                    f"{path}: always has shape {always_shape}, expected at most {tgt_tok.vocab_size} ids"
                )
            table, always = f.get_tensor("table").long(), f.get_tensor("always").long()
    except (SafetensorError, OSError) as err:
        raise ShortlistError(f"{path}: unreadable shortlist ({err})") from None
    n_tgt = tgt_tok.vocab_size
    if table.numel() and not (table.min() >= -1 and table.max() < n_tgt):
        raise ShortlistError(f"{path}: table holds ids outside the target vocabulary of {n_tgt}")
    if always.numel() and not (always.min() >= 0 and always.max() < n_tgt):
        raise ShortlistError(f"{path}: always holds ids outside the target vocabulary of {n_tgt}")
    always = torch.unique(torch.cat([always, torch.arange(EOS_ID + 1)]))  # the special ids, whatever the file says
    return Shortlist(table, always, n_tgt, src_tok.sha256, tgt_tok.sha256)


def vocabulary_map(shortlist: Shortlist, src_pieces: list[str], tgt_pieces: list[str]) -> str:
    """The shortlist as CTranslate2's vocabulary map text: 'source piece<TAB>target pieces' per line, the
    fixed candidates on a line whose source is empty."""
    lines = ["\t" + " ".join(tgt_pieces[t] for t in shortlist.always.tolist())]
    for s, row in enumerate(shortlist.table.tolist()):
        targets = [tgt_pieces[t] for t in row if t >= 0]
        if targets and src_pieces[s].strip():
            lines.append(src_pieces[s] + "\t" + " ".join(targets))
    return "\n".join(lines) + "\n"
