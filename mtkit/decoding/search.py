"""Greedy and batched beam search over ``model.encode`` / ``model.decode`` with a KV cache.

Beam search keeps ``beam`` live hypotheses per sentence. Each step scores every extension, takes
the best 2 x beam candidates (so hypotheses that end do not starve the beam, as in fairseq), files
candidates that end with eos as finished, and keeps the best ``beam`` that do not. A sentence is
done at its length limit or once ``beam`` hypotheses have ended (fairseq's rule), and with
``early_stop`` (OpenNMT-py's and CTranslate2's) as soon as its best-ranked candidate has ended.
Done sentences leave the batch, so work shrinks as decoding goes on.

The bookkeeping after each step (``settle``) is written for any layout of a sentence's rows, so the
continuous search (mtkit.decoding.continuous), which sentences join and leave at every step, shares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mtkit.config import DecodeConfig, LengthPenalty, SamplingConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtkit.model.attention import DecoderCache
from mtkit.model.transformer import Candidates, Transformer

DEFAULT_DECODE = DecodeConfig()  # DecodeConfig's defaults, for a search called without settings

TOPK_BLOCK = 64  # columns per block in row_topk and row_argmax
ARGMAX_MIN_SIZE = 2**18  # fewer elements than this: row_argmax calls argmax, whose fixed cost is lower
DRAW_BLOCK = 64  # entries per block in draw's two-level cumulative sums
NUCLEUS_FIRST = 64  # most probable columns a top-p nucleus is first looked for among


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # generated ids, without bos and eos
    score: float  # length-normalised log-probability: what the beam ranks by
    logprob: float  # sum of token log-probabilities, eos included


def length_penalty(length: int, alpha: float, form: LengthPenalty = "gnmt") -> float:
    """What a hypothesis's log-probability is divided by at ``length`` tokens (eos included, bos not): GNMT's
    ((5 + length) / 6) ** alpha (Wu et al., 2016), or ``power``'s length ** alpha, the form transformers,
    CTranslate2, fairseq and Marian use, so that a model imported from them ranks its hypotheses as there."""
    if form == "power":
        return float(length) ** alpha
    return ((5.0 + length) / 6.0) ** alpha


def normalised(logprob: float, tokens: int, decode: DecodeConfig) -> float:
    """The score a hypothesis of ``tokens`` output tokens (eos not counted) ranks by: its log-probability over
    ``decode``'s length penalty at tokens + 1."""
    return logprob / length_penalty(tokens + 1, decode.lenpen, decode.length_penalty)


def max_lengths(src_pad_mask: Tensor, a: float, b: int, limit: int) -> Tensor:
    """Per-sentence cap on generated tokens (eos included): a * source_length + b, at most ``limit``."""
    src_lens = (~src_pad_mask).sum(dim=1) - 1  # without the source eos
    return (a * src_lens.float() + b).long().clamp(min=1, max=limit)


def max_length(source_length: int, a: float, b: int, limit: int) -> int:
    """``max_lengths`` of one sentence of ``source_length`` tokens (eos not counted), in float32 as there,
    without torch: engines that are not torch's call it (see mtkit.interop.ct2_translator.CTranslate2Translator)."""
    cap = np.float32(a) * np.float32(source_length) + np.float32(b)
    return min(max(int(cap), 1), limit)


def ban_pad_and_bos(lprobs: Tensor) -> None:
    """Make pad and bos impossible next tokens in ``lprobs`` (N, V), in place: no output may hold them.
    Over a shortlist's columns too, where the special ids are their own columns."""
    lprobs[:, [PAD_ID, BOS_ID]] = float("-inf")


def _step_log_probs(
    model: Transformer,
    tokens: Tensor,
    memory: Tensor | None,
    mask: Tensor,
    cache: DecoderCache,
    candidates: Candidates | None,
) -> Tensor:
    """Log-probabilities (N, V) of the next token given the last one (over the shortlist's candidates, if any);
    never pad or bos."""
    logits = model.decode(tokens[:, -1:], memory, mask, cache, candidates)[:, -1]
    lprobs = F.log_softmax(logits.float(), dim=-1)
    ban_pad_and_bos(lprobs)
    return lprobs


def prefix_tensor(prefixes: list[list[int]] | None, n: int, device: torch.device) -> Tensor:
    """(n, longest prefix) ids that the first outputs must be, padded with -1 (free choice)."""
    width = max((len(p) for p in prefixes or []), default=0)
    out = torch.full((n, width), -1, dtype=torch.long)
    for i, prefix in enumerate(prefixes or []):
        out[i, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    return out.to(device)


def output_caps(src_pad_mask: Tensor, forced: Tensor, a: float, b: int, limit: int) -> Tensor:
    """``max_lengths``, raised where a forced prefix is longer: the prefix and an eos always fit."""
    return torch.maximum(max_lengths(src_pad_mask, a, b, limit), (forced >= 0).sum(dim=1) + 1)


def _force(lprobs: Tensor, forced: Tensor, certain: bool = False) -> None:
    """Rows whose ``forced`` id is >= 0 may only continue with that token (forced target prefixes), at its
    log-probability, or at 0 where it is ``certain`` (a target language's token, given as transformers' forced
    first token is)."""
    rows = (forced >= 0).nonzero().squeeze(1)
    if rows.numel():
        token = forced[rows]
        kept = 0.0 if certain else lprobs[rows, token]
        lprobs[rows] = float("-inf")
        lprobs[rows, token] = kept


def row_topk(x: Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=1)`` for rows far longer than ``k``, faster on CPU.

    Why: CPU topk scans every element of every row, and over a vocabulary that is a visible share
    of beam search. A row's k largest values lie in the k blocks (of ``block`` columns) with the largest
    maxima, since any other block's maximum is beaten by those k maxima; so topk runs over the
    block maxima, then over the k chosen blocks and the columns left over after the last whole
    block. The values are torch.topk's; among exactly equal values the indices may differ.
    """
    rows, width = x.shape
    blocks = width // block
    if x.is_cuda or blocks < 4 * k:
        return x.topk(k, dim=1)
    whole = blocks * block
    grid = x[:, :whole].unflatten(1, (blocks, block))  # (rows, blocks, block), a view
    chosen = grid.amax(dim=2).topk(k, dim=1).indices  # (rows, k)
    candidates = grid.gather(1, chosen[:, :, None].expand(-1, -1, block)).flatten(1)
    candidates = torch.cat([candidates, x[:, whole:]], dim=1)
    values, at = candidates.topk(k, dim=1)
    in_block = at < k * block
    from_block = chosen.gather(1, (at // block).clamp(max=k - 1)) * block + at % block
    return values, torch.where(in_block, from_block, at - k * block + whole)


def row_argmax(x: Tensor, block: int = TOPK_BLOCK) -> Tensor:
    """``x.argmax(dim=1)``, the same index (the first of equal maxima), faster on CPU for many rows.

    Why: CPU argmax walks a row one element at a time, while amax is vectorised. So the maximum's block is
    found through block maxima (the first block holding it), then the first maximum inside that block; the
    columns after the last whole block are compared on their own. Small inputs keep argmax: this costs a few
    operations more, which only some hundred thousand elements repay.
    """
    rows, width = x.shape
    blocks = width // block
    if x.is_cuda or x.numel() < ARGMAX_MIN_SIZE or blocks < 2:
        return x.argmax(dim=1)
    whole = blocks * block
    grid = x[:, :whole].unflatten(1, (blocks, block))  # (rows, blocks, block), a view
    chosen = grid.amax(dim=2).argmax(dim=1)  # (rows,)
    inside = grid.gather(1, chosen[:, None, None].expand(-1, 1, block)).squeeze(1).argmax(dim=1)
    best = chosen * block + inside
    if whole < width:  # a later column wins only if strictly larger
        tail = x[:, whole:].max(dim=1)
        best = torch.where(tail.values > x.gather(1, best[:, None]).squeeze(1), tail.indices + whole, best)
    return best


def best_extensions(
    logits: Tensor,
    count: int,
    eos_allowed: bool | Tensor,
    forced: Tensor | None,
    must_end: Tensor,
    certain: bool = False,
) -> tuple[Tensor, Tensor]:
    """Each row's ``count`` best next tokens and their log-probabilities, best first: (N, count) twice.

    Beam search needs no more: a sentence's best 2k extensions are among its rows' best 2k each,
    and a top-k per row is cheaper than one over all of a sentence's k x V extensions. The
    constraints only mask: never pad or bos, no eos before ``min_len`` (``eos_allowed``, for all rows or
    for each), a forced prefix token (``certain``: at log-probability 0, see ``_force``), and eos alone on rows at
    their length cap (``must_end``, which outranks the others).
    """
    lprobs = F.log_softmax(logits, dim=1)
    ban_pad_and_bos(lprobs)
    eos = lprobs[:, EOS_ID].clone()
    if isinstance(eos_allowed, Tensor):
        lprobs[:, EOS_ID].masked_fill_(~eos_allowed, float("-inf"))
    elif not eos_allowed:
        lprobs[:, EOS_ID] = float("-inf")
    if forced is not None:
        _force(lprobs, forced, certain)
    if must_end.any():
        lprobs[must_end] = float("-inf")
        lprobs[must_end, EOS_ID] = eos[must_end]
    return row_topk(lprobs, min(count, lprobs.size(1)))


class Extensions(NamedTuple):
    """Each sentence's best 2k extensions of its live hypotheses, best first: (n, 2k) each."""

    scores: Tensor  # log-probability of the extended hypothesis; -inf where there is none
    beam: Tensor  # which of the sentence's live hypotheses it extends
    tokens: Tensor  # the token it adds


def beam_step(scores: Tensor, row_lprobs: Tensor, row_tok: Tensor, k: int) -> Extensions:
    """The best 2k extensions of each sentence's live hypotheses: (score, beam, token), each (n, 2k), best first.

    ``scores`` (n, width) is the log-probability of each of a sentence's ``width`` live hypotheses;
    ``row_lprobs`` and ``row_tok`` (n * width, m) are each hypothesis's m best next tokens. Twice the
    beam, as fairseq takes: candidates that end with eos still leave k that go on. ``beam`` is the
    index of the extended hypothesis among its sentence's; with fewer than 2k candidates (a tiny
    vocabulary) the rest score -inf.
    """
    n, width = scores.shape
    per_row = row_tok.size(1)
    cand = (scores[:, :, None] + row_lprobs.view(n, width, per_row)).view(n, width * per_row)
    tokens = row_tok.reshape(n, width * per_row)
    if cand.size(1) < 2 * k:
        cand = F.pad(cand, (0, 2 * k - cand.size(1)), value=float("-inf"))
        tokens = F.pad(tokens, (0, 2 * k - tokens.size(1)), value=PAD_ID)
    cand_scores, cand_idx = cand.topk(2 * k, dim=1)
    return Extensions(cand_scores, (cand_idx // per_row).clamp(max=width - 1), tokens.gather(1, cand_idx))


# -- beam-search bookkeeping: what a step's extensions decide ------------------------------------------------
#
# Both beam searches (beam_search and the continuous one) call ``settle`` after ``beam_step``. Their rows
# share one layout: each live sentence's ``width`` rows in turn, and ``tokens`` (rows, T) holding each row's
# inputs, a sentence's output following its bos.


@dataclass(frozen=True)
class Settled:
    """What one beam step settles for the n sentences it extended (k = beam)."""

    ended: list[list[Hypothesis]]  # per sentence, its hypotheses that ended now, to be filed as finished
    scores: Tensor  # (n, k) log-probabilities of the hypotheses that go on
    rows: Tensor  # (n * k,) the row each of them extends
    next_tok: Tensor  # (n * k, 1) the token it adds
    top_ended: Tensor  # (n,) whether a sentence's best-ranked candidate has ended, now or at an earlier step
    done: Tensor  # (n,) sentences whose search is over


def settle(
    ext: Extensions,
    tokens: Tensor,
    width: int,
    filed: list[int],
    must_end: Tensor,
    top_ended: Tensor,
    decode: DecodeConfig,
    nbest: int,
    starts: Tensor | None = None,
) -> Settled:
    """File the hypotheses that ended, choose the k that go on, decide which sentences are done.

    ``ext`` extends the ``width`` live rows of each of n sentences, which have ``filed`` finished hypotheses
    so far; ``must_end`` (n,) marks those at their length cap and ``top_ended`` those whose best-ranked
    candidate ended at an earlier step. A sentence's bos is at slot ``starts`` (n,) of ``tokens``, or 0.
    """
    k = decode.beam
    ending = (ext.tokens[:, :k] == EOS_ID) & torch.isfinite(ext.scores[:, :k])  # (n, k)
    ended = ended_hypotheses(ext, ending, tokens, width, [k - count for count in filed], decode, starts)
    scores, rows, next_tok = survivors(ext, k, width)
    counts = torch.tensor([count + len(new) for count, new in zip(filed, ended)], device=must_end.device)
    top_ended = top_ended | ending[:, 0]
    done = done_sentences(must_end, counts, top_ended, k, nbest, decode.early_stop)
    return Settled(ended, scores, rows, next_tok, top_ended, done)


def ended_hypotheses(
    ext: Extensions,
    ending: Tensor,
    tokens: Tensor,
    width: int,
    room: list[int],
    decode: DecodeConfig,
    starts: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """The hypotheses each sentence finishes now: its ``ending`` candidates (n, k: eos among its best k), best
    first, at most ``room`` of them, so that no sentence files more than k.

    An eos candidate ranked below the best k is not filed (fairseq's rule): k others beat it.
    """
    ended: list[list[Hypothesis]] = [[] for _ in room]
    if not ending.any():
        return ended
    beam_of, score_of = ext.beam.tolist(), ext.scores.tolist()
    first = [1] * len(room) if starts is None else (starts + 1).tolist()  # each sentence's first output slot
    for r, c in ending.nonzero().tolist():
        if len(ended[r]) < room[r]:
            history = tokens[r * width + beam_of[r][c], first[r] :].tolist()
            logprob = score_of[r][c]
            ended[r].append(Hypothesis(history, normalised(logprob, len(history), decode), logprob))
    return ended


def survivors(ext: Extensions, k: int, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each sentence's best k candidates that do not end, which go on: their log-probabilities (n, k), the rows
    they extend (n * k,) and the tokens they add (n * k, 1). A hypothesis ends in one way only, eos, so at most k
    of the 2k candidates end."""
    scores, pick = ext.scores.masked_fill(ext.tokens == EOS_ID, float("-inf")).topk(k, dim=1)
    groups = torch.arange(scores.size(0), device=scores.device)[:, None]
    rows = (groups * width + ext.beam.gather(1, pick)).view(-1)
    return scores, rows, ext.tokens.gather(1, pick).view(-1, 1)


def done_sentences(must_end: Tensor, counts: Tensor, top_ended: Tensor, k: int, nbest: int, early_stop: bool) -> Tensor:
    """(n,) whether each sentence's search is over: at its length cap, with k finished hypotheses (fairseq's
    rule), or with ``early_stop`` once its best-ranked candidate has ended and ``nbest`` have finished."""
    done = must_end | (counts >= k)
    if early_stop:
        done |= top_ended & (counts >= nbest)
    return done


def group_rows(groups: Tensor, width: int) -> Tensor:
    """The rows of the sentences ``groups`` (indices), each sentence's ``width`` rows in turn."""
    return (groups[:, None] * width + torch.arange(width, device=groups.device)).view(-1)


def best_first(hyps: list[Hypothesis], nbest: int) -> list[Hypothesis]:
    """A sentence's ``nbest`` best finished hypotheses, best first (equal scores in the order they ended)."""
    return sorted(hyps, key=lambda h: -h.score)[:nbest]


def draw_tokens(lprobs: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """One next token per row, drawn from ``lprobs`` as ``sampling`` says (temperature, top-k, top-p)."""
    scores, columns = lprobs, None  # columns: the column of lprobs each column of scores stands for, once cut
    if sampling.top_k and sampling.top_k < lprobs.size(1):
        scores, columns = lprobs.topk(sampling.top_k, dim=1)
    # Shifted so the best is 0 before dividing: a temperature near 0 then tends to greedy, not to NaN. The
    # weights are proportional to the probabilities, which is all that draw needs.
    weights = ((scores - scores.amax(dim=1, keepdim=True)) / sampling.temperature).exp()
    if sampling.top_p < 1.0:
        weights, kept = nucleus(weights / weights.sum(dim=1, keepdim=True), sampling.top_p)
        columns = kept if columns is None else columns.gather(1, kept)
    drawn = draw(weights, generator)
    return drawn if columns is None else columns.gather(1, drawn[:, None]).squeeze(1)


def nucleus(probs: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """Each row's nucleus (Holtzman et al., 2020): its most probable columns as long as the mass before them is
    below ``top_p``. Returns (N, m) probabilities, most probable first and 0 past a row's nucleus, and their columns.

    Why not sort whole rows: on CPU a sort of an 8k vocabulary costs 15x a top 64, and a nucleus is mostly a
    few dozen columns. So each row's NUCLEUS_FIRST most probable are taken, then four times as many for the
    rows whose nucleus reaches further, and so on.
    """
    width = probs.size(1)
    m = min(NUCLEUS_FIRST, width)
    values, columns = probs.topk(m, dim=1)
    further = values.cumsum(dim=1)[:, -1] < top_p
    while m < width and further.any():
        m = min(4 * m, width)
        rows = further.nonzero().squeeze(1)
        wider, wider_columns = probs[rows].topk(m, dim=1)
        values, columns = F.pad(values, (0, m - values.size(1))), F.pad(columns, (0, m - columns.size(1)))
        values[rows], columns[rows] = wider, wider_columns
        further[rows] = wider.cumsum(dim=1)[:, -1] < top_p
    before = values.cumsum(dim=1) - values
    return values.masked_fill(before >= top_p, 0.0), columns


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One column per row of ``probs`` (N, V; non-negative, each row's sum positive), drawn with probability
    proportional to its entry: the inverse of the cumulative sums at one uniform number per row.

    Why not torch.multinomial: on CPU it races an exponential number drawn for every entry, a vocabulary's
    worth of logarithms per token, which was half of sampled decoding. The sums are taken in float64 and in two
    levels, over blocks of DRAW_BLOCK entries and then inside the chosen block, so that an entry keeps its
    share however small it is beside the others; an entry of probability 0 is never drawn.
    """
    rows, width = probs.shape
    blocks = -(-width // DRAW_BLOCK)
    short = blocks * DRAW_BLOCK - width
    grid = (F.pad(probs, (0, short)) if short else probs).view(rows, blocks, DRAW_BLOCK)
    block_ends = grid.sum(dim=2, dtype=torch.float64).cumsum(dim=1)  # (N, blocks)
    total = block_ends[:, -1:]
    u = torch.rand(rows, 1, dtype=torch.float64, generator=generator, device=probs.device) * total
    u = torch.minimum(u, below(total))
    block = torch.searchsorted(block_ends, u, right=True)  # the first block whose end passes u: never an empty one
    u = u - torch.where(block > 0, block_ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = grid.gather(1, block[:, :, None].expand(-1, -1, DRAW_BLOCK)).squeeze(1).double().cumsum(dim=1)
    column = torch.searchsorted(inside, torch.minimum(u, below(inside[:, -1:])), right=True)
    return (block * DRAW_BLOCK + column).squeeze(1)


def below(x: Tensor) -> Tensor:
    """The largest float below each element of ``x``: where a draw must stay strictly under a cumulative sum."""
    return torch.nextafter(x, torch.zeros_like(x))


@torch.inference_mode()
def sample_search(
    model: Transformer,
    src: Tensor,
    src_pad_mask: Tensor,
    sampling: SamplingConfig | None = None,
    decode: DecodeConfig = DEFAULT_DECODE,
    prefixes: list[list[int]] | None = None,
    generator: torch.Generator | None = None,
    candidates: Candidates | None = None,
    lead: int = 0,
) -> list[Hypothesis]:
    """One output per sentence, token by token: the most probable (``sampling`` None: greedy, which finds what
    beam search with beam 1 finds, with less bookkeeping per step) or drawn; ``decode`` gives the length bounds
    (max_len_a, max_len_b, min_len) and the length penalty of the score; with a shortlist's ``candidates``, over
    those target ids only (they hold the special ids and every prefix token). The first ``lead`` tokens of each
    prefix are certain (a target language's token: ``_force``).

    Each Hypothesis carries the model's own log-probability of the output (not the sampling
    distribution's), so sampled back-translations can be filtered by it. A sentence leaves the batch
    once it has ended, so work shrinks as decoding goes on.
    """
    n, device = src.size(0), src.device
    forced = prefix_tensor(prefixes, n, device)
    max_lens = output_caps(src_pad_mask, forced, decode.max_len_a, decode.max_len_b, model.max_target_positions)
    if candidates is not None:
        forced = candidates.columns(forced)
    memory, mask = model.encode(src, src_pad_mask), src_pad_mask
    cache = DecoderCache()
    tokens = torch.full((n, 1), BOS_ID, dtype=torch.long, device=device)
    logprob = torch.zeros(n, device=device)
    active = torch.arange(n, device=device)  # the sentence of each row
    results: list[Hypothesis | None] = [None] * n
    for step in range(int(max_lens.max())):
        lprobs = _step_log_probs(model, tokens, memory, mask, cache, candidates)
        memory = None  # the cache holds the memory's keys and values now
        eos = lprobs[:, EOS_ID].clone()
        if step < decode.min_len:
            lprobs[:, EOS_ID] = float("-inf")
        if step < forced.size(1):
            _force(lprobs, forced[active, step], step < lead)
        next_tok = row_argmax(lprobs) if sampling is None else draw_tokens(lprobs, sampling, generator)
        chosen = lprobs.gather(1, next_tok[:, None]).squeeze(1)
        at_cap = step + 1 >= max_lens[active]
        next_tok[at_cap], chosen[at_cap] = EOS_ID, eos[at_cap]
        logprob += chosen
        if candidates is not None:  # columns to target ids; the special ids are their own columns
            next_tok = candidates.ids[next_tok]
        tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
        ended = next_tok == EOS_ID
        if not ended.any():
            continue
        rows = ended.nonzero().squeeze(1)
        outputs = tokens[rows, 1:-1].tolist()  # without bos and eos
        for sentence, output, lp in zip(active[rows].tolist(), outputs, logprob[rows].tolist()):
            results[sentence] = Hypothesis(output, normalised(lp, len(output), decode), lp)
        if ended.all():
            break
        keep = (~ended).nonzero().squeeze(1)
        tokens, logprob, active, mask = tokens[keep], logprob[keep], active[keep], mask[keep]
        cache.select(keep, cross_index=keep)
    return results


def greedy_search(
    model: Transformer,
    src: Tensor,
    src_pad_mask: Tensor,
    decode: DecodeConfig = DEFAULT_DECODE,
    prefixes: list[list[int]] | None = None,
) -> list[list[int]]:
    """Most probable next token at every step; returns ids without bos/eos."""
    hyps = sample_search(model, src, src_pad_mask, None, decode, prefixes)
    return [h.tokens for h in hyps]


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    src_pad_mask: Tensor,
    decode: DecodeConfig = DEFAULT_DECODE,
    nbest: int = 1,
    prefixes: list[list[int]] | None = None,
    candidates: Candidates | None = None,
    lead: int = 0,
) -> list[list[Hypothesis]]:
    """The ``nbest`` best finished hypotheses per sentence, best first, searched as ``decode`` says (beam,
    lenpen, length_penalty, max_len_a, max_len_b, min_len, early_stop); with a shortlist's ``candidates``, over
    those target ids only (they hold the special ids and every prefix token).

    ``early_stop`` also ends a sentence's search once its best-ranked candidate has ended and
    ``nbest`` hypotheses have. That saves steps; without a length penalty it loses nothing (scores
    only fall as hypotheses grow), with one a longer hypothesis might have overtaken.

    ``min_len`` forbids eos before that many tokens, except where the length cap forces an end.
    ``prefixes`` (one id list per sentence, possibly empty) fixes the first output tokens, of which the first
    ``lead`` are certain (a target language's token: ``_force``).
    """
    k = decode.beam
    n_sent = src.size(0)
    device = src.device
    limit = model.max_target_positions
    forced = prefix_tensor(prefixes, n_sent, device)
    max_lens = output_caps(src_pad_mask, forced, decode.max_len_a, decode.max_len_b, limit)

    # A sentence's beams share its encoder output: the cache keeps its keys and values (made at the first
    # step) and the mask one row per sentence, and the decoder's cross-attention serves all of a sentence's
    # rows from it.
    memory, mask = model.encode(src, src_pad_mask), src_pad_mask
    cache = DecoderCache()
    width = 1  # rows per sentence; every beam starts as the same bos, so the first step runs one
    tokens = torch.full((n_sent, 1), BOS_ID, dtype=torch.long, device=device)
    scores = torch.zeros(n_sent, 1, device=device)
    active = torch.arange(n_sent, device=device)  # sentence id of each active group of rows
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    top_ended = torch.zeros(n_sent, dtype=torch.bool, device=device)  # best candidate has ended once

    for step in range(int(max_lens.max())):
        logits = model.decode(tokens[:, -1:], memory, mask, cache, candidates)[:, -1].float()  # (n * width, V)
        memory = None  # the cache holds the memory's keys and values now
        must_end = step + 1 >= max_lens[active]  # (n,)
        forced_now = forced[active, step].repeat_interleave(width) if step < forced.size(1) else None
        if forced_now is not None and candidates is not None:
            forced_now = candidates.columns(forced_now)
        row_lprobs, row_tok = best_extensions(
            logits,
            2 * k,
            eos_allowed=step >= decode.min_len,
            forced=forced_now,
            must_end=must_end.repeat_interleave(width),
            certain=step < lead,
        )
        if candidates is not None:  # columns to target ids; the special ids are their own columns
            row_tok = candidates.ids[row_tok]
        extensions = beam_step(scores, row_lprobs, row_tok, k)
        sentences = active.tolist()
        filed = [len(finished[s]) for s in sentences]
        settled = settle(extensions, tokens, width, filed, must_end, top_ended, decode, nbest)
        for sentence, ended in zip(sentences, settled.ended):
            finished[sentence] += ended
        if settled.done.all():
            break
        scores, rows, next_tok, top_ended = settled.scores, settled.rows, settled.next_tok, settled.top_ended
        width, keep = k, None
        if settled.done.any():
            keep = (~settled.done).nonzero().squeeze(1)
            keep_rows = group_rows(keep, k)
            rows = rows[keep_rows]
            next_tok = next_tok[keep_rows]
            scores = scores[keep]
            active = active[keep]
            top_ended = top_ended[keep]
            mask = mask[keep]
        tokens = torch.cat([tokens[rows], next_tok], dim=1)
        cache.select(rows, cross_index=keep)

    return [best_first(hyps, nbest) for hyps in finished]
