"""Several models decoding as one: the search sees their averaged log-probabilities.

``Ensemble`` offers what search uses of a model (``encode``, ``decode`` with a cache, the length
limits), so greedy, beam and sampled search need no ensemble code of their own. Two tricks keep it
that way: the members' encoder outputs travel side by side in one tensor (concatenated on the
feature axis), so search can repeat and reorder it like a single model's memory; and the members'
layer caches live in the one ``DecoderCache`` search holds, so its ``select`` reorders them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mtkit.model.attention import DecoderCache, LayerCache
from mtkit.model.transformer import Candidates, Transformer


class Ensemble:
    """Members must share one target vocabulary (the caller checks their tokenizers)."""

    def __init__(self, members: list[Transformer]) -> None:
        self.members = members
        self.widths = [m.encoder.embed.tokens.embedding_dim for m in members]

    @property
    def max_source_positions(self) -> int:
        """The most source positions every member reads."""
        return min(m.max_source_positions for m in self.members)

    @property
    def max_target_positions(self) -> int:
        """The most target positions every member reads."""
        return min(m.max_target_positions for m in self.members)

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Tensor:
        """(B, S, sum of the members' widths): each member's memory in its own slice."""
        return torch.cat([m.encode(src, src_pad_mask) for m in self.members], dim=-1)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor | None,
        src_pad_mask: Tensor,
        cache: DecoderCache | None = None,
        candidates: Candidates | None = None,
    ) -> Tensor:
        """The mean of the members' log-probabilities, (B, T, V) or over ``candidates``; search's log-softmax
        renormalises it. ``memory`` may be None once the cache holds the members' keys and values."""
        memories = memory.split(self.widths, dim=-1) if memory is not None else [None] * len(self.members)
        views = self._member_caches(cache)
        lprobs = [
            F.log_softmax(m.decode(tgt_in, mem, src_pad_mask, view, candidates).float(), dim=-1)
            for m, mem, view in zip(self.members, memories, views)
        ]
        if cache is not None:
            cache.length += tgt_in.size(1)
        return torch.stack(lprobs).mean(dim=0)

    def _member_caches(self, cache: DecoderCache | None) -> list[DecoderCache | None]:
        """One view per member onto the shared cache's layers, all at the shared length."""
        if cache is None:
            return [None] * len(self.members)
        sizes = [len(m.decoder.layers) for m in self.members]
        if not cache.layers:
            cache.layers = [LayerCache() for _ in range(sum(sizes))]
        views, start = [], 0
        for n in sizes:
            views.append(DecoderCache(cache.layers[start : start + n], cache.length))
            start += n
        return views
