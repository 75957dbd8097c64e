"""The encoder-decoder Transformer (Vaswani et al., 2017), read top-down from parts to the whole.

Shape legend: B batch, S source length, T target length, D d_model, H heads, Dh = D // H, V vocab.
Mask polarity: ``src_pad_mask`` is True at padding; attention masks handed to SDPA are True where a
query may attend (``attn_allowed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtkit.config import ModelConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID
from mtkit.model.attention import DecoderCache, Dropout, LayerCache, MultiHeadAttention, autocast_once, self_attention
from mtkit.model.linear import DecodingLinear, Linear
from mtkit.model.positions import RelativePositions, building_skeleton


@dataclass
class Candidates:
    """One batch's target ids (sorted; the special ids, the lowest, keep their own positions) and the
    output weights cut down to them, cut (and packed for oneDNN where that pays) once per batch and output layer
    rather than at every step."""

    ids: Tensor
    _cut: dict[int, Callable[[Tensor], Tensor]] = field(default_factory=dict, repr=False)

    def project(self, features: Tensor, output: DecodingLinear) -> Tensor:
        """``output(features)`` over the candidates only: (..., len(ids))."""
        cut = self._cut.get(id(output))
        if cut is None:
            cut = self._cut[id(output)] = output.rows(self.ids)
        return cut(features)

    def columns(self, ids: Tensor) -> Tensor:
        """The positions of target ``ids`` (each one of the candidates, or -1, kept) among the candidates."""
        return torch.where(ids >= 0, torch.searchsorted(self.ids, ids.clamp(min=0)), ids)


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}  # model.activation's choices


class FeedForward(nn.Module):
    """Position-wise FFN: Linear -> activation (ReLU by default) -> dropout -> Linear."""

    def __init__(self, d_model: int, ffn: int, dropout: float, activation: str = "relu") -> None:
        super().__init__()
        self.up = Linear(d_model, ffn)
        self.down = Linear(ffn, d_model)
        self.dropout = Dropout(dropout)
        self.activation = activation
        self.activate = ACTIVATIONS[activation]

    def init_weights(self) -> None:
        """Xavier-uniform matrices, as the Transformer initialises them; biases keep nn.Linear's."""
        nn.init.xavier_uniform_(self.up.weight)
        nn.init.xavier_uniform_(self.down.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.activate(self.up(x))))


class Residual(nn.Module):
    """Residual connection with LayerNorm: post-norm LN(x + f(x)) or pre-norm x + f(LN(x))."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = self_attention(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn, cfg.activation_dropout, cfg.activation)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, pre)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, x: Tensor, attn_allowed: Tensor) -> Tensor:
        x = self.res_attn(x, lambda h: self.self_attn(h, h, attn_allowed))
        return self.res_ffn(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = self_attention(cfg)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn, cfg.activation_dropout, cfg.activation)
        self.res_self = Residual(cfg.d_model, cfg.dropout, pre)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, pre)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        src_allowed: Tensor,
        cache: LayerCache | None,
        self_allowed: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, D); with a cache, x holds only the new positions and keys/values accumulate, and
        ``self_allowed`` (B, 1, 1, slots) may say which cache slots each row sees and ``positions`` (B,) the
        position of each row's new token (rows of a continuous search began at different slots)."""
        if cache is None:
            x = self.res_self(x, lambda h: self.self_attn(h, h, causal=True))
            x = self.res_cross(x, lambda h: self.cross_attn(h, memory, src_allowed))
        else:
            x = self.res_self(x, lambda h: self.self_attn.self_attend_step(h, cache, self_allowed, positions))
            x = self.res_cross(x, lambda h: self.cross_attn.cross_attend_step(h, memory, src_allowed, cache))
        return self.res_ffn(x, self.ffn)


def sinusoidal_table(max_positions: int, d_model: int) -> Tensor:
    """(max_positions, D) float32 table: sin on even dimensions, cos on odd ones.

    Computed in float64 and rounded once, so every entry is the float32 nearest the true value, as
    in Marian's and fairseq's tables (a float32 angle at position 1,000 is off by about 1e-4).
    """
    if building_skeleton():
        return torch.empty(max_positions, d_model)
    position = torch.arange(max_positions, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(max_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table.float()


def fairseq_table(max_positions: int, d_model: int) -> Tensor:
    """(max_positions, D) float32 table of the sinusoids fairseq adds (tensor2tensor's): frequencies
    10000^(-i / (D/2 - 1)), sin on the first half of the dimensions and cos on the second, from position 2 (fairseq
    numbers positions after its padding id, 1).

    Computed in float32 as fairseq and transformers compute it, so an imported NLLB-200 or M2M100 model adds the very
    values it was trained with.
    """
    if building_skeleton():
        return torch.empty(max_positions, d_model)
    half = d_model // 2
    inv_freq = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(max_positions + 2).float()[:, None] * inv_freq[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)[2:]


class Embedder(nn.Module):
    """Token embedding scaled by sqrt(D), plus sinusoidal or learned positions (if absolute), then dropout."""

    def __init__(self, tokens: nn.Embedding, cfg: ModelConfig) -> None:
        super().__init__()
        self.tokens = tokens
        self.scale = math.sqrt(cfg.d_model)
        self.max_positions = cfg.max_positions
        self.learned = None
        if cfg.positions == "learned":
            self.learned = nn.Embedding(cfg.max_positions, cfg.d_model)
            nn.init.normal_(self.learned.weight, std=cfg.d_model**-0.5)
        # None for rotary and relative positions, which live in self-attention instead
        tables = {"sinusoidal": sinusoidal_table, "fairseq": fairseq_table}
        table = tables[cfg.positions](cfg.max_positions, cfg.d_model) if cfg.positions in tables else None
        self.register_buffer("table", table, persistent=False)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, ids: Tensor, offset: int | Tensor = 0) -> Tensor:
        """ids (B, L) at positions offset..offset+L-1 -> (B, L, D); ``offset`` is one for all rows, or (B,)."""
        length = ids.size(1)
        last = int(offset.max()) if isinstance(offset, Tensor) else offset
        if last + length > self.max_positions:
            raise ValueError(f"sequence of {last + length} positions exceeds model.max_positions {self.max_positions}")
        x = self.tokens(ids) * self.scale
        table = self.learned.weight if self.learned is not None else self.table
        if table is None:
            return self.dropout(x)
        if isinstance(offset, Tensor):
            return self.dropout(x + table[offset[:, None] + torch.arange(length, device=ids.device)])
        return self.dropout(x + table[offset : offset + length])


class Encoder(nn.Module):
    def __init__(self, embed: Embedder, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()

    def forward(self, src: Tensor, src_pad_mask: Tensor) -> Tensor:
        """src (B, S) -> memory (B, S, D)."""
        allowed = ~src_pad_mask[:, None, None, :]  # (B, 1, 1, S)
        x = self.embed(src)
        for layer in self.layers:
            x = layer(x, allowed)
        return self.final_norm(x)


class Decoder(nn.Module):
    def __init__(self, embed: Embedder, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = embed
        self.start_reads_eos = cfg.decoder_start == "eos"  # the search starts from bos, the model reads eos there
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()

    def forward(
        self, tgt_in: Tensor, memory: Tensor | None, src_pad_mask: Tensor, cache: DecoderCache | None = None
    ) -> Tensor:
        """tgt_in (B, T) -> features (B, T, D). With a cache, tgt_in holds only the new positions, and
        memory may hold one row per group of B / len(memory) consecutive rows (a sentence's beams), or be
        None once the cache holds its keys and values (``cross_cache``)."""
        allowed = ~src_pad_mask[:, None, None, :]
        offset: int | Tensor = 0
        self_allowed = positions = None
        if cache is not None:
            offset = cache.length if cache.positions is None else cache.positions
            self_allowed, positions = cache.self_allowed, cache.positions
            if not cache.layers:
                cache.layers = [LayerCache() for _ in self.layers]
            cache.length += tgt_in.size(1)
        if self.start_reads_eos:
            tgt_in = tgt_in.masked_fill(tgt_in == BOS_ID, EOS_ID)
        x = self.embed(tgt_in, offset)
        memory = autocast_once(memory) if memory is not None else None  # one cast for every cross-attention
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, allowed, cache.layers[i] if cache is not None else None, self_allowed, positions)
        return self.final_norm(x)

    def cross_cache(self, memory: Tensor) -> DecoderCache:
        """A cache holding each layer's cross-attention keys/values of ``memory`` and nothing decoded yet."""
        memory = autocast_once(memory)
        layers = []
        for layer in self.layers:
            k, v = layer.cross_attn.project_memory(memory)
            layers.append(LayerCache(cross_k=k, cross_v=v))
        return DecoderCache(layers)


class Transformer(nn.Module):
    """Encoder-decoder with ``encode`` and ``decode`` exposed separately for search."""

    def __init__(self, encoder: Encoder, decoder: Decoder, output: Linear | DecodingLinear) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.output = output  # features (.., D) -> logits (.., V)

    @property
    def max_source_positions(self) -> int:
        """The most source positions the encoder reads, the source eos included."""
        return self.encoder.embed.max_positions

    @property
    def max_target_positions(self) -> int:
        """The most target positions the decoder reads, bos included: what bounds every output's length."""
        return self.decoder.embed.max_positions

    def init_weights(self) -> None:
        """Have each part that initialises its own matrices (``init_weights``) do so, in module order.

        This runs once the whole model is built, after the draws of every constructor, so the random
        draws keep one order and a seed always gives the same weights. Token embeddings, learned
        positions and the output projection are initialised where they are built.
        """
        for module in self.modules():
            if isinstance(module, (MultiHeadAttention, RelativePositions, FeedForward)):
                module.init_weights()

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Tensor:
        return self.encoder(src, src_pad_mask)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor | None,
        src_pad_mask: Tensor,
        cache: DecoderCache | None = None,
        candidates: Candidates | None = None,
    ) -> Tensor:
        """Logits (B, T, V) for tgt_in (B, T) given the encoder memory; with a shortlist's ``candidates``,
        (B, T, len(candidates.ids)) over those target ids only."""
        features = self.decoder(tgt_in, memory, src_pad_mask, cache)
        return self.output_layer()(features) if candidates is None else candidates.project(features, self.output)

    def output_layer(self) -> Callable[[Tensor], Tensor]:
        """The output projection as decoding applies it: ``self.output``, or where oneDNN pays
        (``mtkit.model.linear.onednn_pays``: without gradients, in bf16 or in fp32 for a vocabulary large enough, on a
        CPU whose products go there), the same layer over a copy of its weights packed for oneDNN.

        Why: the product with the vocabulary is the largest of a decoding step, and at the few rows of one
        sentence's beams, ATen's product there took up to 5.9x as long (docs/benchmarks.md). The copy costs the
        output weights' size again, and is made again when they change (validation between training updates).
        """
        return self.output.decoding()

    def features(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Decoder features (B, T, D); training projects only the non-pad positions to the vocabulary."""
        return self.decoder(tgt_in, self.encode(src, src_pad_mask), src_pad_mask)

    def forward(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor) -> Tensor:
        return self.output(self.features(src, src_pad_mask, tgt_in))


def build_model(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, pad_id: int) -> Transformer:
    """The one place that maps a ModelConfig to modules, including embedding tying and the output bias."""
    if cfg.tie_embeddings and src_vocab != tgt_vocab:
        raise ValueError("model.tie_embeddings needs one vocabulary for both languages (tokenizer.joint: true)")
    d = cfg.d_model

    def embedding(vocab: int) -> nn.Embedding:
        emb = nn.Embedding(vocab, d, padding_idx=pad_id)
        nn.init.normal_(emb.weight, std=d**-0.5)
        with torch.no_grad():
            emb.weight[pad_id].zero_()
        return emb

    src_tokens = embedding(src_vocab)
    tgt_tokens = src_tokens if cfg.tie_embeddings else embedding(tgt_vocab)
    output = Linear(d, tgt_vocab, bias=cfg.output_bias, vocabulary=True)
    if cfg.tie_embeddings or cfg.tie_output:
        output.weight = tgt_tokens.weight
    else:
        nn.init.normal_(output.weight, std=d**-0.5)
    if cfg.output_bias:
        nn.init.zeros_(output.bias)
    encoder = Encoder(Embedder(src_tokens, cfg), cfg)
    decoder = Decoder(Embedder(tgt_tokens, cfg), cfg)
    model = Transformer(encoder, decoder, output)
    model.init_weights()
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
