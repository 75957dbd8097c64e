"""Attention weights of a chosen translation, hard word alignments from them, and heatmaps.

Search keeps no attention weights: fused SDPA does not return them, and keeping them for every beam
row would cost memory for nothing. Instead, once a translation is chosen, one teacher-forced pass
over (source, translation) records them. ``recording`` registers a weights hook on attention modules
(``MultiHeadAttention.register_weights_hook``): they compute their weights with the model's own masks and
positions beside their normal output, which is left untouched, so the pass computes exactly what it
computes without recording.

Shape legend: L layers, H heads, S source positions (source eos included), T target pieces. The
decoder reads bos + T pieces, so its T + 1 query rows are the steps that predict the T pieces and
then eos: row t belongs to target piece t.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mtkit.config import ConfigError, DecodeConfig
from mtkit.data.parallel import DataError, pad, source_tensor
from mtkit.data.tokenizer import BOS_ID, Tokenizer
from mtkit.decoding.search import beam_search
from mtkit.files import atomic_write
from mtkit.model.attention import MultiHeadAttention
from mtkit.model.transformer import Transformer

WORD_START = "\u2581"  # SentencePiece marks the first piece of each word with "▁"
EOS_LABEL = "</s>"


@dataclass(frozen=True)
class AttentionMaps:
    """Attention probabilities of one sentence pair, per layer and head; every row sums to 1."""

    cross: Tensor  # (L_dec, H, T + 1, S): decoder steps over the source
    decoder: Tensor  # (L_dec, H, T + 1, T + 1): decoder self-attention, zero above the diagonal
    encoder: Tensor  # (L_enc, H, S, S): encoder self-attention


@dataclass(frozen=True)
class AttendedTranslation:
    """One translated sentence with the pieces on both sides and the attention that produced it."""

    translation: str
    src_pieces: list[str]
    tgt_pieces: list[str]
    maps: AttentionMaps


def alignment_layer(decoder_layers: int) -> int:
    """The decoder layer whose cross-attention gives alignments: the penultimate (the only one of one layer).

    Garg et al. (2019, "Jointly Learning to Align and Translate with Transformer Models") found the
    head-averaged cross-attention of the penultimate layer of a 6-layer Transformer to align words
    best, clearly better than the last layer's.
    """
    return max(decoder_layers - 2, 0)


# -- recording ------------------------------------------------------------------------------


@contextmanager
def recording(modules: Iterable[MultiHeadAttention]) -> Iterator[dict[MultiHeadAttention, Tensor]]:
    """Inside the block each of ``modules`` stores the weights (B, H, Tq, Tk) of its latest call in the yielded dict.

    The weights are softmax probabilities in fp32, before dropout. Each module's output still comes
    from its own ``attend`` (fused SDPA or not), so recording changes no result.
    """
    weights: dict[MultiHeadAttention, Tensor] = {}
    with ExitStack() as hooks:
        for module in modules:
            hooks.enter_context(module.register_weights_hook(weights.__setitem__))
        yield weights


def _attention_modules(model: Transformer) -> dict[str, list[MultiHeadAttention]]:
    """The attention modules of each kind, by layer, named as the fields of AttentionMaps."""
    return {
        "cross": [layer.cross_attn for layer in model.decoder.layers],
        "decoder": [layer.self_attn for layer in model.decoder.layers],
        "encoder": [layer.self_attn for layer in model.encoder.layers],
    }


@torch.inference_mode()
def _teacher_forced(
    model: Transformer,
    src_ids: list[list[int]],
    tgt_ids: list[list[int]],
    modules: list[MultiHeadAttention],
    target_lead: tuple[int, ...] = (),
) -> dict[MultiHeadAttention, Tensor]:
    """Weights (B, H, Tq, Tk) of ``modules`` while the model reads each source + eos and bos (+ ``target_lead``,
    a target language's token) + its target."""
    device = model.output.weight.device
    src, src_pad_mask = (t.to(device) for t in source_tensor(src_ids))
    tgt_in = pad(tgt_ids, prefix=[BOS_ID, *target_lead]).to(device)
    with recording(modules) as weights:
        model.features(src, src_pad_mask, tgt_in)
    return weights


def attention_maps(model: Transformer, src_ids: list[int], tgt_ids: list[int]) -> AttentionMaps:
    """Every attention map of ``model`` reading ``src_ids`` and producing ``tgt_ids`` (ids without bos/eos), on CPU."""
    kinds = _attention_modules(model)
    weights = _teacher_forced(model, [src_ids], [tgt_ids], [m for ms in kinds.values() for m in ms])
    return AttentionMaps(**{kind: torch.stack([weights[m][0] for m in ms]).cpu() for kind, ms in kinds.items()})


# -- alignment ------------------------------------------------------------------------------


def word_index(pieces: Sequence[str]) -> list[int]:
    """The word (from 0) of each SentencePiece piece, or -1 for a piece that is only "▁".

    These are the whitespace-separated words of the detokenized text: "▁" marks a word start, and
    a lone "▁" (as before a piece SentencePiece did not merge, or a run of them) is just space.
    """
    words, word, starts = [], -1, True
    for piece in pieces:
        text = piece.lstrip(WORD_START)
        starts = starts or text != piece
        if not text:
            words.append(-1)
            continue
        if starts or word < 0:
            word += 1
            starts = False
        words.append(word)
    return words


def _hard_alignment(src_pieces: Sequence[str], tgt_pieces: Sequence[str], weights: Tensor) -> list[tuple[int, int]]:
    """Word pairs from one head-averaged map (T + 1, S): each target piece links to its most-attended source piece.

    The source eos column and the target eos row are left out: they carry no word.
    """
    if tuple(weights.shape) != (len(tgt_pieces) + 1, len(src_pieces) + 1):
        raise ValueError(
            f"attention of shape {tuple(weights.shape)} does not fit {len(tgt_pieces)} target and "
            f"{len(src_pieces)} source pieces, each plus eos"
        )
    if not src_pieces or not tgt_pieces:
        return []
    best = weights[:-1, :-1].argmax(dim=1).tolist()
    src_words, tgt_words = word_index(src_pieces), word_index(tgt_pieces)
    return sorted({(src_words[s], tgt_words[t]) for t, s in enumerate(best) if src_words[s] >= 0 and tgt_words[t] >= 0})


def word_alignment(
    src_pieces: Sequence[str], tgt_pieces: Sequence[str], cross: Tensor, layer: int | None = None
) -> list[tuple[int, int]]:
    """Sorted unique (source word, target word) pairs from cross-attention (L, H, T + 1, S) of one sentence pair.

    The heads of ``layer`` (default: ``alignment_layer``) are averaged, each target piece links to
    the source piece it attends to most, and each piece link becomes a link between the two words.
    """
    layer = alignment_layer(cross.size(0)) if layer is None else layer
    return _hard_alignment(src_pieces, tgt_pieces, cross[layer].float().mean(dim=0))


def alignment_line(pairs: Iterable[tuple[int, int]]) -> str:
    """Pharaoh format, as fast_align and Moses write it: "0-0 1-2 2-1"."""
    return " ".join(f"{i}-{j}" for i, j in pairs)


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    """The SentencePiece pieces of ``ids``, e.g. ["▁The", "▁bi", "g"]: what the heatmaps and alignments label."""
    return tok.sp.id_to_piece(ids) if ids else []


def align_batch(
    model: Transformer,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    pairs: Sequence[tuple[list[int], list[int]]],
    layer: int | None = None,
    leads: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
) -> list[str]:
    """One Pharaoh line per (source ids, hypothesis ids) pair, both without bos/eos; "" where either is empty.
    ``leads``: the language tokens before each source (part of its ids) and before each hypothesis (read by the
    decoder, not part of it) in a model told its languages by tokens; they carry no word.

    One padded teacher-forced pass records only the alignment layer's cross-attention, so memory
    stays at B x H x T x S; padding is masked, so each line is what the pair alone would give.
    """
    lines = [""] * len(pairs)
    todo = [i for i, (src, hyp) in enumerate(pairs) if src and hyp]
    if not todo:
        return lines
    layers = model.decoder.layers
    module = layers[alignment_layer(len(layers)) if layer is None else layer].cross_attn
    sources, targets = [pairs[i][0] for i in todo], [pairs[i][1] for i in todo]
    weights = _teacher_forced(model, sources, targets, [module], leads[1])[module]
    skip_src, skip_tgt = len(leads[0]), len(leads[1])
    for row, i in enumerate(todo):
        src, hyp = pairs[i]
        averaged = weights[row, :, skip_tgt : skip_tgt + len(hyp) + 1, skip_src : len(src) + 1].mean(dim=0)
        words = _hard_alignment(pieces(src_tok, src[skip_src:]), pieces(tgt_tok, hyp), averaged)
        lines[i] = alignment_line(words)
    return lines


def translate_with_attention(
    model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, sentence: str, decode: DecodeConfig
) -> AttendedTranslation:
    """Beam-search one sentence, then record the attention that produced the best translation."""
    ids = src_tok.encode([sentence])[0]
    limit = model.max_source_positions - 1  # room for the source eos
    if not ids:
        raise DataError("the source sentence is empty")
    if len(ids) > limit:
        raise DataError(f"the source sentence has {len(ids)} tokens; this model reads at most {limit}")
    device = model.output.weight.device
    src, src_pad_mask = source_tensor([ids])
    best = beam_search(model, src.to(device), src_pad_mask.to(device), decode)[0][0]
    translation = tgt_tok.decode([best.tokens])[0]
    maps = attention_maps(model, ids, best.tokens)
    return AttendedTranslation(translation, pieces(src_tok, ids), pieces(tgt_tok, best.tokens), maps)


# -- heatmaps -------------------------------------------------------------------------------


def _chosen_layers(count: int, layer: int | None, side: str) -> list[int]:
    if layer is None:
        return list(range(count))
    if not 0 <= layer < count:
        raise ConfigError(f"layer {layer} does not exist: the {side} has layers 0 to {count - 1}")
    return [layer]


def plot_attention(
    maps: AttentionMaps,
    src_pieces: Sequence[str],
    tgt_pieces: Sequence[str],
    path: Path,
    layer: int | None = None,
    encoder: bool = False,
) -> None:
    """Write a PNG of heatmaps, atomically: one row per layer, one column per head plus their mean.

    Cross-attention rows come first (target pieces down, source pieces across); ``encoder`` adds the
    encoder self-attention rows. ``layer`` keeps only that layer (from 0) of each; None keeps all.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("drawing attention needs matplotlib: pip install matplotlib") from None
    src_labels, tgt_labels = [*src_pieces, EOS_LABEL], [*tgt_pieces, EOS_LABEL]
    panels = [
        (f"cross L{n}", maps.cross[n], src_labels, tgt_labels)
        for n in _chosen_layers(len(maps.cross), layer, "decoder")
    ]
    if encoder:
        panels += [
            (f"encoder L{n}", maps.encoder[n], src_labels, src_labels)
            for n in _chosen_layers(len(maps.encoder), layer, "encoder")
        ]
    columns = maps.cross.size(1) + 1
    width = max(2.5, 0.22 * len(src_labels) + 1.2)
    height = max(2.5, 0.22 * max(len(tgt_labels), len(src_labels) if encoder else 0) + 1.2)
    # A Figure with its own Agg canvas, not pyplot: no global state, no display backend needed.
    fig = Figure(figsize=(columns * width, len(panels) * height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), columns, squeeze=False)
    for row, (name, weights, xs, ys) in zip(axes, panels):
        for head, (ax, grid) in enumerate(zip(row, [*weights, weights.mean(dim=0)])):
            image = ax.imshow(grid.float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"{name} head {head}" if head < len(weights) else f"{name} mean", fontsize=9)
            ax.set_xticks(range(len(xs)), xs, rotation=90, fontsize=7)
            ax.set_yticks(range(len(ys)), ys, fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
