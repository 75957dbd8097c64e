"""Greedy and batched beam search over ``model.encode`` / ``model.decode`` with a KV cache.

Beam search keeps ``beam`` live hypotheses per sentence. Each step scores every extension, takes
the best 2 x beam candidates (so hypotheses that end do not starve the beam, as in fairseq), files
candidates that end with eos as finished, and keeps the best ``beam`` that do not. A sentence is
done at its length limit or once ``beam`` hypotheses have ended (fairseq's rule), and with
``early_stop`` (OpenNMT-py's and CTranslate2's) as soon as its best-ranked candidate has ended.
Done sentences leave the batch, so work shrinks as decoding goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mtkit.config import DecodeConfig, SamplingConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtkit.model.attention import DecoderCache
from mtkit.model.transformer import Candidates, Transformer

DEFAULT_DECODE = DecodeConfig()  # DecodeConfig's defaults, for a search called without settings

TOPK_BLOCK = 64  # columns per block in row_topk: the fastest of 50-400 on an 8k vocabulary


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # generated ids, without bos and eos
    score: float  # length-normalised log-probability: what the beam ranks by
    logprob: float  # sum of token log-probabilities, eos included


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty (Wu et al., 2016): ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src_pad_mask: Tensor, a: float, b: int, limit: int) -> Tensor:
    """Per-sentence cap on generated tokens (eos included): a * source_length + b, at most ``limit``."""
    src_lens = (~src_pad_mask).sum(dim=1) - 1  # without the source eos
    return (a * src_lens.float() + b).long().clamp(min=1, max=limit)


def max_length(source_length: int, a: float, b: int, limit: int) -> int:
    """``max_lengths`` of one sentence of ``source_length`` tokens (eos not counted), in float32 as there,
    without torch: engines that are not torch's call it (see mtkit.interop.ct2_export.CTranslate2Translator)."""
    cap = np.float32(a) * np.float32(source_length) + np.float32(b)
    return min(max(int(cap), 1), limit)


def _step_log_probs(model: Transformer, tokens: Tensor, memory: Tensor, mask: Tensor, cache: DecoderCache) -> Tensor:
    """Log-probabilities (N, V) of the next token given the last one; never pad or bos."""
    logits = model.decode(tokens[:, -1:], memory, mask, cache)[:, -1]
    lprobs = F.log_softmax(logits.float(), dim=-1)
    lprobs[:, PAD_ID] = float("-inf")
    lprobs[:, BOS_ID] = float("-inf")
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


def _force(lprobs: Tensor, forced: Tensor) -> None:
    """Rows whose ``forced`` id is >= 0 may only continue with that token (forced target prefixes)."""
    rows = (forced >= 0).nonzero().squeeze(1)
    if rows.numel():
        token = forced[rows]
        kept = lprobs[rows, token]
        lprobs[rows] = float("-inf")
        lprobs[rows, token] = kept


def row_topk(x: Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=1)`` for rows far longer than ``k``, in about 60% of its time on CPU.

    Why: CPU topk scans every element of every row, and over a vocabulary it was 8% of beam
    search. A row's k largest values lie in the k blocks (of ``block`` columns) with the largest
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


def best_extensions(
    logits: Tensor, count: int, eos_allowed: bool | Tensor, forced: Tensor | None, must_end: Tensor
) -> tuple[Tensor, Tensor]:
    """Each row's ``count`` best next tokens and their log-probabilities, best first: (N, count) twice.

    Beam search needs no more: a sentence's best 2k extensions are among its rows' best 2k each,
    and a top-k per row is cheaper than one over all of a sentence's k x V extensions. The
    constraints only mask: never pad or bos, no eos before ``min_len`` (``eos_allowed``, for all rows or
    for each), a forced prefix token, and eos alone on rows at their length cap (``must_end``, which
    outranks the others).
    """
    lprobs = F.log_softmax(logits, dim=1)
    lprobs[:, PAD_ID] = float("-inf")
    lprobs[:, BOS_ID] = float("-inf")
    eos = lprobs[:, EOS_ID].clone()
    if isinstance(eos_allowed, Tensor):
        lprobs[:, EOS_ID].masked_fill_(~eos_allowed, float("-inf"))
    elif not eos_allowed:
        lprobs[:, EOS_ID] = float("-inf")
    if forced is not None:
        _force(lprobs, forced)
    if must_end.any():
        lprobs[must_end] = float("-inf")
        lprobs[must_end, EOS_ID] = eos[must_end]
    return row_topk(lprobs, min(count, lprobs.size(1)))


def beam_step(scores: Tensor, row_lprobs: Tensor, row_tok: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
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
    return cand_scores, (cand_idx // per_row).clamp(max=width - 1), tokens.gather(1, cand_idx)


def draw_tokens(lprobs: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """One next token per row, drawn from ``lprobs`` as ``sampling`` says (temperature, top-k, top-p)."""
    # Shifted so the best is 0 before dividing: a temperature near 0 then tends to greedy, not to NaN.
    logits = (lprobs - lprobs.amax(dim=1, keepdim=True)) / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.size(1)), dim=1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(dim=1, descending=True)
        probs = ordered.softmax(dim=1)
        outside = probs.cumsum(dim=1) - probs >= sampling.top_p  # the mass before them already reaches p
        logits = logits.scatter(1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)


@torch.inference_mode()
def sample_search(
    model: Transformer,
    src: Tensor,
    src_pad_mask: Tensor,
    sampling: SamplingConfig | None = None,
    decode: DecodeConfig = DEFAULT_DECODE,
    prefixes: list[list[int]] | None = None,
    generator: torch.Generator | None = None,
) -> list[Hypothesis]:
    """One output per sentence, token by token: the most probable (``sampling`` None, greedy) or drawn;
    ``decode`` gives the length bounds (max_len_a, max_len_b, min_len).

    Each Hypothesis carries the model's own log-probability of the output (not the sampling
    distribution's), so sampled back-translations can be filtered by it.
    """
    n, device = src.size(0), src.device
    forced = prefix_tensor(prefixes, n, device)
    max_lens = output_caps(src_pad_mask, forced, decode.max_len_a, decode.max_len_b, model.decoder.embed.max_positions)
    memory = model.encode(src, src_pad_mask)
    cache = DecoderCache()
    tokens = torch.full((n, 1), BOS_ID, dtype=torch.long, device=device)
    logprob = torch.zeros(n, device=device)
    ended = torch.zeros(n, dtype=torch.bool, device=device)
    for step in range(int(max_lens.max())):
        lprobs = _step_log_probs(model, tokens, memory, src_pad_mask, cache)
        eos = lprobs[:, EOS_ID].clone()
        if step < decode.min_len:
            lprobs[:, EOS_ID] = float("-inf")
        if step < forced.size(1):
            _force(lprobs, forced[:, step])
        next_tok = lprobs.argmax(dim=1) if sampling is None else draw_tokens(lprobs, sampling, generator)
        chosen = lprobs.gather(1, next_tok[:, None]).squeeze(1)
        at_cap = step + 1 >= max_lens
        next_tok[at_cap], chosen[at_cap] = EOS_ID, eos[at_cap]
        next_tok[ended], chosen[ended] = PAD_ID, 0.0
        logprob += chosen
        tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
        ended |= next_tok == EOS_ID
        if ended.all():
            break
    outputs = [[t for t in row[1:] if t not in (EOS_ID, PAD_ID)] for row in tokens.tolist()]
    return [Hypothesis(out, lp / length_penalty(len(out) + 1, 1.0), lp) for out, lp in zip(outputs, logprob.tolist())]


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
) -> list[list[Hypothesis]]:
    """The ``nbest`` best finished hypotheses per sentence, best first, searched as ``decode`` says (beam,
    lenpen, max_len_a, max_len_b, min_len, early_stop); with a shortlist's ``candidates``, over those target
    ids only (they hold the special ids and every prefix token).

    ``early_stop`` also ends a sentence's search once its best-ranked candidate has ended and
    ``nbest`` hypotheses have. That saves steps; without a length penalty it loses nothing (scores
    only fall as hypotheses grow), with one a longer hypothesis might have overtaken.

    ``min_len`` forbids eos before that many tokens, except where the length cap forces an end.
    ``prefixes`` (one id list per sentence, possibly empty) fixes the first output tokens.
    """
    k = decode.beam
    n_sent = src.size(0)
    device = src.device
    limit = model.decoder.embed.max_positions
    forced = prefix_tensor(prefixes, n_sent, device)
    max_lens = output_caps(src_pad_mask, forced, decode.max_len_a, decode.max_len_b, limit)

    # A sentence's beams share its encoder output: memory and mask keep one row per sentence, and
    # the decoder's cross-attention serves all of a sentence's rows from it.
    memory, mask = model.encode(src, src_pad_mask), src_pad_mask
    cache = DecoderCache()
    width = 1  # rows per sentence; every beam starts as the same bos, so the first step runs one
    tokens = torch.full((n_sent, 1), BOS_ID, dtype=torch.long, device=device)
    scores = torch.zeros(n_sent, 1, device=device)
    active = torch.arange(n_sent, device=device)  # sentence id of each active group of rows
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    beam_offsets = torch.arange(k, device=device)
    top_ended = torch.zeros(n_sent, dtype=torch.bool, device=device)  # best candidate has ended once

    for step in range(int(max_lens.max())):
        n = active.numel()
        logits = model.decode(tokens[:, -1:], memory, mask, cache, candidates)[:, -1].float()  # (n * width, V)
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
        )
        if candidates is not None:  # columns to target ids; the special ids are their own columns
            row_tok = candidates.ids[row_tok]
        cand_scores, cand_beam, cand_tok = beam_step(scores, row_lprobs, row_tok, k)
        cand_eos = cand_tok == EOS_ID

        # File eos candidates that rank among the best k as finished hypotheses.
        ending = cand_eos[:, :k] & torch.isfinite(cand_scores[:, :k])
        if ending.any():
            sentences, beam_of, score_of = active.tolist(), cand_beam.tolist(), cand_scores.tolist()
            for r, c in ending.nonzero().tolist():
                sentence = sentences[r]
                if len(finished[sentence]) < k:
                    history = tokens[r * width + beam_of[r][c], 1:].tolist()
                    logprob = score_of[r][c]
                    length = len(history) + 1
                    finished[sentence].append(
                        Hypothesis(history, logprob / length_penalty(length, decode.lenpen), logprob)
                    )

        # Continue with the best k candidates that did not end.
        scores, pick = cand_scores.masked_fill(cand_eos, float("-inf")).topk(k, dim=1)
        rows = (torch.arange(n, device=device)[:, None] * width + cand_beam.gather(1, pick)).view(-1)
        next_tok = cand_tok.gather(1, pick).view(-1, 1)
        width = k

        counts = torch.tensor([len(finished[s]) for s in active.tolist()], device=device)
        done = must_end | (counts >= k)
        if decode.early_stop:
            top_ended |= cand_eos[:, 0] & torch.isfinite(cand_scores[:, 0])
            done |= top_ended & (counts >= nbest)
        if done.all():
            break
        keep = None
        if done.any():
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep[:, None] * k + beam_offsets).view(-1)
            rows = rows[keep_rows]
            next_tok = next_tok[keep_rows]
            scores = scores[keep]
            active = active[keep]
            top_ended = top_ended[keep]
            memory = memory[keep]
            mask = mask[keep]
        tokens = torch.cat([tokens[rows], next_tok], dim=1)
        cache.select(rows, cross_index=keep)

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]
