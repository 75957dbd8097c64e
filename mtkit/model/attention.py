"""Multi-head attention with its caches and CPU kernels: what the Transformer's layers attend with.

Shape legend: B batch, H heads, Tq query positions, Tk key positions, Dh = d_model // H. Mask
polarity: masks handed to attention (``attn_allowed``) are True where a query may attend.

- ``LayerCache`` / ``DecoderCache``: the keys and values incremental decoding reuses, reordered
  in place as beam search keeps and drops rows.
- ``dropout``: inverted dropout with masks cut from 64-bit random words (the layers use it too).
- ``attention_weights`` and the explicit attention path, used where fused SDPA is slow (bf16 on CPU)
  or cannot apply (relative positions, windows, weights handed to a hook).
- ``MultiHeadAttention``: self- or cross-attention, with rotary or relative positions and a window,
  and hooks that observe its weights (``register_weights_hook``); over whole sequences (``forward``) or
  over a decoding step's new positions with their cache (``self_attend_step``, ``cross_attend_step``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mtkit.config import ModelConfig
from mtkit.model.derived import Derived
from mtkit.model.linear import Linear
from mtkit.model.positions import RelativePositions, Rotary

# fp32 attention of at most this many queries per row (a decoding step: one, or a sentence's beams in
# cross-attention) is written out on CPU, where that is faster than SDPA's flash kernel (docs/benchmarks.md).
SMALL_QUERY = 8


@dataclass
class LayerCache:
    """Keys/values one decoder layer reuses across incremental steps, each (B, H, len, Dh).

    The self-attention buffers may be longer than ``self_len``, the positions they hold: reordering
    (``DecoderCache.select``) leaves room for the next step, so appending it copies nothing.
    """

    self_k: Tensor | None = None
    self_v: Tensor | None = None
    self_len: int = 0
    cross_k: Tensor | None = None
    cross_v: Tensor | None = None
    qkv: Callable[[Tensor], Tensor] | None = None  # the self-attention's joint_qkv, the same for the whole search

    def append_self(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' keys/values; returns those of every position so far."""
        start, end = self.self_len, self.self_len + k.size(2)
        if self.self_k is None or self.self_k.size(2) < end:
            self.self_k, self.self_v = _with_room(self.self_k, start, k, end), _with_room(self.self_v, start, v, end)
        self.self_k[:, :, start:end] = k
        self.self_v[:, :, start:end] = v
        self.self_len = end
        return self.self_k[:, :, :end], self.self_v[:, :, :end]

    @torch.no_grad()  # search-only: writing into a preallocated buffer has no gradient
    def select_self(self, index: Tensor, front: int = 0, new_rows: int = 0) -> None:
        """Keep (and reorder) rows ``index`` without their first ``front`` positions, with room for one more,
        then ``new_rows`` rows of zeros (rows joining a continuous search, which masks their slots)."""
        used, kept = self.self_len - front, index.numel()
        for name in ("self_k", "self_v"):
            old = getattr(self, name)
            new = old.new_empty(kept + new_rows, old.size(1), used + 1, old.size(3))
            torch.index_select(old[:, :, front : front + used], 0, index, out=new[:kept, :, :used])
            new[kept:, :, :used].zero_()
            setattr(self, name, new)
        self.self_len = used

    def join_sources(self, other: LayerCache) -> None:
        """Append the cross-attention keys/values of ``other``'s sentences, both sides padded to one length."""
        length = max(self.cross_k.size(2), other.cross_k.size(2))

        def padded(x: Tensor) -> Tensor:
            return F.pad(x, (0, 0, 0, length - x.size(2)))

        self.cross_k = torch.cat([padded(self.cross_k), padded(other.cross_k)])
        self.cross_v = torch.cat([padded(self.cross_v), padded(other.cross_v)])


def _with_room(old: Tensor | None, used: int, like: Tensor, size: int) -> Tensor:
    """A (B, H, size, Dh) buffer holding the first ``used`` positions of ``old``."""
    new = like.new_empty(like.size(0), like.size(1), size, like.size(3))
    if old is not None:
        new[:, :, :used] = old[:, :, :used]
    return new


@dataclass
class DecoderCache:
    """Everything incremental decoding carries between steps; ``select`` follows beam reordering."""

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0  # target positions already consumed
    # Continuous batching (mtkit.decoding.continuous), where rows start at different steps: each row's position,
    # and the self-attention slots (B, 1, 1, length + 1) each row may see, its own from its start on.
    positions: Tensor | None = None
    self_allowed: Tensor | None = None

    def select(self, index: Tensor, cross_index: Tensor | None = None, front: int = 0, new_rows: int = 0) -> None:
        """Keep (and reorder) batch rows ``index`` of the self-attention keys/values in place, dropping the
        first ``front`` positions (slots no row kept can see any more) and adding ``new_rows`` empty rows.

        The cross-attention keys/values depend on the source alone and hold one row per sentence
        (shared by its beams), so they follow ``cross_index``, the sentences kept, when given and
        stay as they are otherwise.
        """
        for layer in self.layers:
            layer.select_self(index, front, new_rows)
            if cross_index is not None and layer.cross_k is not None:
                layer.cross_k = layer.cross_k.index_select(0, cross_index)
                layer.cross_v = layer.cross_v.index_select(0, cross_index)
        self.length -= front

    def narrow_sources(self, length: int) -> None:
        """Keep the first ``length`` source positions of the cross-attention keys/values (the rest is padding)."""
        for layer in self.layers:
            if layer.cross_k is not None and layer.cross_k.size(2) > length:
                layer.cross_k = layer.cross_k[:, :, :length].contiguous()
                layer.cross_v = layer.cross_v[:, :, :length].contiguous()

    def join_sources(self, other: DecoderCache) -> None:
        """Append the cross-attention keys/values of ``other``'s sentences (a ``Decoder.cross_cache``)."""
        for layer, new in zip(self.layers, other.layers):
            layer.join_sources(new)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout: zero each element with probability ``p``, scale the rest by 1 / (1 - p).

    Why not F.dropout on CPU: its bernoulli_ draws one random number per element, a sizeable share
    of a CPU training step (docs/benchmarks.md). Here each 64-bit random word is cut into four
    16-bit draws, so a mask costs a quarter of the generator calls. ``p`` is rounded to a multiple
    of 1/65536 and the kept elements are scaled by that rounded probability, so the expectation
    stays exactly ``x``. CUDA keeps F.dropout.
    """
    if not training or p == 0.0:
        return x
    if x.is_cuda or torch.compiler.is_compiling():
        return F.dropout(x, p, training=True)
    drop = round(p * 65536)
    words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    keep = words.view(torch.int16)[: x.numel()].view(x.shape) >= drop - 32768  # uniform over [-32768, 32767]
    return x * keep.to(x.dtype).mul_(65536 / (65536 - drop))


class Dropout(nn.Module):
    """``dropout`` as a module, so a model's structure shows where it drops."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def attention_weights(
    q: Tensor, k: Tensor, attn_allowed: Tensor | None, causal: bool, bias: Tensor | None = None
) -> Tensor:
    """softmax((q k^T + bias) / sqrt(Dh)) in fp32, (B, H, Tq, Tk), masked as SDPA masks it (causal: top-left aligned).

    ``bias`` is the relative-position key term. A row with nothing allowed (a padding query in a
    block of windowed attention) gets uniform weights rather than NaN. Shared by the explicit
    attention below, by windowed and relative attention, and by ``MultiHeadAttention.weights``.
    """
    scores = (q @ k.transpose(-2, -1)).float()  # (B, H, Tq, Tk)
    if bias is not None:
        scores = scores + bias.float()
    scores = scores * q.size(-1) ** -0.5
    masked = torch.finfo(torch.float32).min
    if causal:
        tq, tk = scores.shape[-2:]
        future = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, masked)
    if attn_allowed is not None:
        scores = torch.where(attn_allowed, scores, masked)
    return torch.softmax(scores, dim=-1)


def _explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_allowed: Tensor | None, causal: bool, dropout_p: float
) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v written out, softmax in fp32.

    Used for bf16/fp16 on CPU, where PyTorch's fused SDPA kernel is much slower than this on the
    short sequences of sentence-level MT, and in fp32 for at most ``SMALL_QUERY`` queries (decoding steps).
    """
    weights = attention_weights(q, k, attn_allowed, causal)
    return dropout(weights, dropout_p, training=True).to(v.dtype) @ v


def autocast_once(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype when autocast is on, else ``x``.

    Autocast casts a Linear's input at every use; an input that feeds several projections (the
    q, k and v of self-attention, the encoder memory of every cross-attention) is cast once here
    instead, in the forward pass and in the backward pass.
    """
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


# What a weights hook is called with: the module and the weights (B, H, Tq, Tk) of one ``attend``.
WeightsHook = Callable[["MultiHeadAttention", Tensor], None]


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention, scaled by 1/sqrt(Dh); self- or cross-attention.

    Self-attention may also carry positions (``rotary`` or ``relative``, see mtkit.model.positions) and a
    ``window``: each position then attends only to positions at most ``window`` away. Queries and
    keys are at absolute positions ``q_start..`` and ``k_start..``, which is what lets one cached
    decoding step see the distances that decoding the whole sequence sees.
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        dropout: float,
        rotary: Rotary | None = None,
        relative: RelativePositions | None = None,
        window: int = 0,
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
        self.heads = heads
        self.d_head = d_model // heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.out_proj = Linear(d_model, d_model)
        self.dropout = dropout
        self.rotary = rotary
        self.relative = relative
        self.window = window
        self._weights_hooks: OrderedDict[int, WeightsHook] = OrderedDict()  # a handle refers to it weakly
        self._joint: Derived[Callable[[Tensor], Tensor]] = Derived()  # joint_qkv's layer

    def train(self, mode: bool = True) -> Self:
        self._joint.clear()  # a fused optimizer's steps leave no trace that the copy could be checked against
        return super().train(mode)

    def init_weights(self) -> None:
        """Xavier-uniform projection matrices, as the Transformer initialises them; biases keep nn.Linear's."""
        for projection in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(projection.weight)

    def register_weights_hook(self, hook: WeightsHook) -> RemovableHandle:
        """Have every later ``attend`` call ``hook(self, weights)`` until the returned handle's ``remove()``.

        Fused SDPA returns no weights, so they are computed (``weights``) only while a hook is registered:
        softmax probabilities in fp32, before dropout. The output is computed as it is without hooks, so
        observing changes no result. A cached cross-attention step over a sentence's beams hands over
        (sentences, H, beams * Tq, Tk), its queries grouped as ``attend`` receives them.
        """
        handle = RemovableHandle(self._weights_hooks)
        self._weights_hooks[handle.id] = hook
        return handle

    def rotate(self, x: Tensor, start: int | Tensor) -> Tensor:
        """Queries or keys (B, H, L, Dh) at positions start.. (one for all rows, or each row's), rotated when
        positions are rotary."""
        return self.rotary(x, start) if self.rotary is not None else x

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, L, D) -> (B, H, L, Dh)."""
        b, length, _ = x.shape
        return x.view(b, length, self.heads, self.d_head).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def joint_qkv(self) -> Callable[[Tensor], Tensor]:
        """The query, key and value projections as one layer, outputs side by side (.., 3 * D).

        Why: a decoding step projects a position or a few per row, where each operation's fixed cost outweighs
        its arithmetic: one product of thrice the width replaces three, and rotary positions then turn the
        queries and keys in one call. Made once (a copy of the three weights) and again only when one of
        them changes (their adapters' too, where they carry LoRA adapters); a search looks it up at its first step
        (``LayerCache.qkv``), as this check costs about what it saves.
        """
        projections = (self.q_proj, self.k_proj, self.v_proj)
        sources = [t for p in projections for t in (*p.parameters(), *p.buffers())]
        return self._joint.get(sources, lambda: type(self.q_proj).joined(projections))

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of the encoder memory that a decoding cache keeps, each (B, H, Tk, Dh) and contiguous:
        every later step multiplies by them in place rather than copying the strided view of the heads first."""
        k, v = self.project_kv(memory)
        return k.contiguous(), v.contiguous()

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_allowed: Tensor | None,
        causal: bool,
        q_start: int = 0,
        k_start: int = 0,
    ) -> Tensor:
        """q (B, H, Tq, Dh), k/v (B, H, Tk, Dh) -> (B, Tq, D)."""
        if self._weights_hooks:
            weights = self.weights(q, k, attn_allowed, causal, q_start, k_start)
            for hook in list(self._weights_hooks.values()):
                hook(self, weights)
        dropout_p = self.dropout if self.training else 0.0
        tq, tk = q.size(2), k.size(2)
        if self.relative is None and not self.window:
            if q.is_cuda or (q.dtype == torch.float32 and tq > SMALL_QUERY):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_allowed, dropout_p=dropout_p, is_causal=causal
                )
            else:
                out = _explicit_attention(q, k, v, attn_allowed, causal, dropout_p)
        elif self.window and tq == tk > 3 * self.window and q_start == k_start and _per_key(attn_allowed):
            out = self._local(q, k, v, attn_allowed, causal, dropout_p)
        else:
            allowed, index = self._layout(attn_allowed, causal, tq, tk, q_start, k_start, q.device)
            out = self._mix(q, k, v, allowed, index, dropout_p)
        b = out.size(0)
        return self.out_proj(out.transpose(1, 2).reshape(b, tq, self.heads * self.d_head))

    def weights(
        self, q: Tensor, k: Tensor, attn_allowed: Tensor | None, causal: bool, q_start: int = 0, k_start: int = 0
    ) -> Tensor:
        """The attention weights (B, H, Tq, Tk) that ``attend`` applies: what weights hooks observe."""
        if self.relative is None and not self.window:
            return attention_weights(q, k, attn_allowed, causal)
        allowed, index = self._layout(attn_allowed, causal, q.size(2), k.size(2), q_start, k_start, q.device)
        return self._weights(q, k, allowed, index)

    def _layout(
        self, attn_allowed: Tensor | None, causal: bool, tq: int, tk: int, q_start: int, k_start: int, device
    ) -> tuple[Tensor | None, Tensor | None]:
        """The mask (causal and window by absolute position, with ``attn_allowed``) and relative indices."""
        q_pos = torch.arange(q_start, q_start + tq, device=device)
        k_pos = torch.arange(k_start, k_start + tk, device=device)
        distance = k_pos[None, :] - q_pos[:, None]  # (Tq, Tk)
        band = None
        if causal:
            band = distance <= 0
        if self.window:
            near = distance.abs() <= self.window
            band = near if band is None else band & near
        allowed = attn_allowed if band is None else (band if attn_allowed is None else attn_allowed & band)
        index = self.relative.index(q_pos, k_pos) if self.relative is not None else None
        return allowed, index

    def _weights(self, q: Tensor, k: Tensor, allowed: Tensor | None, index: Tensor | None) -> Tensor:
        """The weights under ``allowed`` (causal and window included), with the relative key term."""
        bias = self.relative.score(q, index) if index is not None else None
        return attention_weights(q, k, allowed, False, bias)

    def _mix(
        self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, index: Tensor | None, dropout_p: float
    ) -> Tensor:
        """Attention written out, for relative positions and windows: weights, then values (+ relative term)."""
        weights = dropout(self._weights(q, k, allowed, index), dropout_p, training=True).to(v.dtype)
        out = weights @ v
        return out + self.relative.mix(weights, index) if index is not None else out

    def _local(
        self, q: Tensor, k: Tensor, v: Tensor, attn_allowed: Tensor | None, causal: bool, dropout_p: float
    ) -> Tensor:
        """Windowed self-attention over a long sequence in blocks: memory grows with N * window, not N^2.

        The N queries are cut into blocks of ``window``; each block meets only the 3 * window keys
        around it (window before, its own, window after), which hold all its queries may see.
        """
        w, n = self.window, q.size(2)
        blocks = -(-n // w)
        tail = blocks * w - n  # padding that fills the last block

        def around(x: Tensor) -> Tensor:  # (..., N, X) -> (..., blocks, 3w, X): each block's keys
            return F.pad(x, (0, 0, w, w + tail)).unfold(-2, 3 * w, w).transpose(-1, -2)

        key_ok = attn_allowed[:, :, 0, :] if attn_allowed is not None else q.new_ones(1, 1, n, dtype=torch.bool)
        key_ok = F.pad(key_ok, (w, w + tail)).unfold(-1, 3 * w, w)[:, :, :, None, :]  # (B, 1, blocks, 1, 3w)
        # Query t of a block against key u of its 3w: distance u - w - t, the same in every block.
        distance = torch.arange(3 * w, device=q.device)[None, :] - w - torch.arange(w, device=q.device)[:, None]
        band = distance.abs() <= w  # (w, 3w)
        if causal:
            band &= distance <= 0
        index = None
        if self.relative is not None:
            index = distance.clamp(-self.relative.clip, self.relative.clip) + self.relative.clip
        out = self._mix(
            F.pad(q, (0, 0, 0, tail)).unflatten(2, (blocks, w)), around(k), around(v), key_ok & band, index, dropout_p
        )
        return out.flatten(2, 3)[:, :, :n]

    def forward(
        self,
        query: Tensor,
        key_value: Tensor,
        attn_allowed: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        """Full-sequence attention. ``attn_allowed`` broadcasts to (B, H, Tq, Tk)."""
        self_attention = query is key_value
        key_value = autocast_once(key_value)
        query = key_value if self_attention else autocast_once(query)
        k, v = self.project_kv(key_value)
        q = self.split_heads(self.q_proj(query))
        return self.attend(self.rotate(q, 0), self.rotate(k, 0), v, attn_allowed, causal)

    def self_attend_step(
        self, x: Tensor, cache: LayerCache, allowed: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Causal self-attention of a decoding step's new positions x (B, L, D) over every position so far, their
        keys/values appended to ``cache``; ``allowed`` (B, 1, 1, slots) may say which cache slots each row sees and
        ``positions`` (B,) the position of each row's new token (rows of a continuous search began at different
        slots)."""
        # The slot of x's first position. Relative positions and windows need only distances, which slots
        # keep; rotary ones rotate each row by its own position, stored rotated with its key.
        start = cache.self_len
        rotation = start if positions is None else positions
        if cache.qkv is None:
            cache.qkv = self.joint_qkv()
        b, length, _ = x.shape
        qkv = cache.qkv(x).view(b, length, 3 * self.heads, self.d_head).transpose(1, 2)  # (B, 3H, L, Dh)
        q, k = self.rotate(qkv[:, : 2 * self.heads], rotation).chunk(2, dim=1)  # the same positions: one call
        k, v = cache.append_self(k, qkv[:, 2 * self.heads :])
        # New positions see every cached position and, among themselves, only earlier ones.
        causal = x.size(1) > 1
        if causal and k.size(2) != x.size(1):
            raise ValueError("a cached decoder step takes one new position at a time")
        k_start = 0
        if self.window and not causal:  # one new position: only the last window + 1 keys can matter
            k_start = max(0, k.size(2) - self.window - 1)
            k, v = k[:, :, k_start:], v[:, :, k_start:]
            allowed = allowed[..., k_start:] if allowed is not None else None
        return self.attend(q, k, v, allowed, causal, start, k_start)

    def cross_attend_step(self, x: Tensor, memory: Tensor | None, allowed: Tensor, cache: LayerCache) -> Tensor:
        """Cross-attention of a decoding step's new positions x (rows, L, D) over the encoder ``memory``, whose
        keys/values ``cache`` keeps from the first step on (``memory`` may be None once it does)."""
        if cache.cross_k is None:
            cache.cross_k, cache.cross_v = self.project_memory(memory)
        # Beam search keeps one memory row per sentence for its ``group`` consecutive rows of x
        # (its beams): their queries attend together, each sentence's keys read once.
        rows, length, _ = x.shape
        group = rows // cache.cross_k.size(0)
        q = self.split_heads(self.q_proj(x))  # (rows, H, length, Dh)
        if group > 1:
            q = q.unflatten(0, (-1, group)).transpose(1, 2).flatten(2, 3)  # (sentences, H, group * length, Dh)
        out = self.attend(q, cache.cross_k, cache.cross_v, allowed, False)
        return out.view(rows, length, -1)


def _per_key(attn_allowed: Tensor | None) -> bool:
    """Whether a mask says only which keys may be seen (B, 1, 1, Tk), as padding masks do."""
    return attn_allowed is None or (attn_allowed.dim() == 4 and attn_allowed.shape[1:3] == (1, 1))


def self_attention(cfg: ModelConfig) -> MultiHeadAttention:
    """A layer's self-attention, with the positions and window the config asks for."""
    d_head = cfg.d_model // cfg.heads
    rotary = Rotary(d_head, cfg.max_positions) if cfg.positions == "rotary" else None
    relative = RelativePositions(d_head, cfg.relative_clip) if cfg.positions == "relative" else None
    return MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, rotary, relative, cfg.attention_window)
