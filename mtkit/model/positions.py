"""Position information inside self-attention: rotary embeddings and relative position representations.

Absolute positions (sinusoidal or learned) are added to the token embeddings, in ``mtkit.model.transformer``.
The two schemes here act on the attention itself, so a score depends on the distance between two
tokens rather than on where they stand:

- ``Rotary`` (Su et al., 2021) rotates each query and key by an angle proportional to its position;
  the dot product of a rotated query and key then depends only on their difference.
- ``RelativePositions`` (Shaw et al., 2018) adds a learned vector for the clipped distance j - i to
  each key (in the scores) and to each value (in the output), shared by the heads of one layer.

Both take absolute positions so that incremental decoding (one new query against cached keys) sees
the same distances as decoding the whole sequence at once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ROTARY_BASE = 10000.0  # the angle of dimension pair i at position p is p * ROTARY_BASE ** (-2i / Dh)


def building_skeleton() -> bool:
    """Whether modules are being built on the meta device, as a skeleton that shows only shapes
    (mtkit.model.loading): position tables need no values there, and torch computes them on the meta device
    with Python kernels whose first use imports dynamo and sympy (1.5 s and 75 MB of every process)."""
    return torch.empty(0).is_meta


class Rotary(nn.Module):
    """Rotate the two halves of each head's vector by position-dependent angles (GPT-NeoX layout)."""

    def __init__(self, d_head: int, max_positions: int, base: float = ROTARY_BASE) -> None:
        super().__init__()
        if d_head % 2:
            raise ValueError(f"rotary positions need an even head size, got {d_head}")
        if building_skeleton():
            cos = sin = torch.empty(max_positions, d_head // 2)
        else:
            inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)  # (Dh/2,)
            angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq  # (max_positions, Dh/2)
            cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        """x (B, H, L, Dh) at positions start..start+L-1, rotated; ``start`` is one for all rows, or (B,), each
        row's own (rows of a continuous search began at different steps)."""
        length = x.size(-2)
        last = int(start.max()) if isinstance(start, Tensor) else start
        if last + length > self.cos.size(0):
            raise ValueError(f"position {last + length - 1} is beyond model.max_positions {self.cos.size(0)}")
        if isinstance(start, Tensor):
            at = start[:, None] + torch.arange(length, device=start.device)  # (B, L)
            cos, sin = self.cos[at][:, None].to(x.dtype), self.sin[at][:, None].to(x.dtype)  # (B, 1, L, Dh/2)
        else:
            cos, sin = self.cos[start : start + length].to(x.dtype), self.sin[start : start + length].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class RelativePositions(nn.Module):
    """Learned key and value vectors for each distance j - i, clipped to [-clip, clip]."""

    def __init__(self, d_head: int, clip: int) -> None:
        super().__init__()
        self.clip = clip
        # A default of N(0, 1/Dh), as nn.Linear has its own; a Transformer applies ``init_weights`` once built.
        self.keys = nn.Parameter(nn.init.normal_(torch.empty(2 * clip + 1, d_head), std=d_head**-0.5))
        self.values = nn.Parameter(nn.init.normal_(torch.empty(2 * clip + 1, d_head), std=d_head**-0.5))

    def init_weights(self) -> None:
        """Xavier-uniform tables, as the Transformer initialises its other matrices."""
        nn.init.xavier_uniform_(self.keys)
        nn.init.xavier_uniform_(self.values)

    def index(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """(Tq, Tk) row of the table for each query-key pair: clip(j - i) + clip."""
        distance = key_positions[None, :] - query_positions[:, None]
        return distance.clamp(-self.clip, self.clip) + self.clip

    def score(self, q: Tensor, index: Tensor) -> Tensor:
        """q (..., Tq, Dh) -> the key term q_i . a_ij of each score, (..., Tq, Tk).

        Each query meets only 2 * clip + 1 distinct vectors: score against those, then pick.
        """
        per_distance = q @ self.keys.to(q.dtype).t()  # (..., Tq, 2 clip + 1)
        return per_distance.gather(-1, index.expand(*per_distance.shape[:-2], *index.shape))

    def mix(self, weights: Tensor, index: Tensor) -> Tensor:
        """weights (..., Tq, Tk) -> the value term sum_j w_ij a_ij, (..., Tq, Dh): weights summed per distance."""
        per_distance = weights.new_zeros(*weights.shape[:-1], self.keys.size(0))
        per_distance.scatter_add_(-1, index.expand_as(weights), weights)
        return per_distance @ self.values.to(weights.dtype)
