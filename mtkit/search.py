"""Greedy and batched beam search over ``model.encode`` / ``model.decode`` with a KV cache.

Beam search keeps ``beam`` live hypotheses per sentence. Each step scores every extension, takes
the best 2 x beam candidates (so hypotheses that end do not starve the beam, as in fairseq), files
candidates that end with eos as finished, and keeps the best ``beam`` that do not. A sentence is
done when it has ``beam`` finished hypotheses or reaches its length limit; done sentences leave the
batch, so work shrinks as decoding goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mtkit.model import DecoderCache, Transformer
from mtkit.tokenizer import BOS_ID, EOS_ID, PAD_ID


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


def _step_log_probs(model: Transformer, tokens: Tensor, memory: Tensor, mask: Tensor, cache: DecoderCache) -> Tensor:
    """Log-probabilities (N, V) of the next token given the last one; never pad or bos."""
    logits = model.decode(tokens[:, -1:], memory, mask, cache)[:, -1]
    lprobs = F.log_softmax(logits.float(), dim=-1)
    lprobs[:, PAD_ID] = float("-inf")
    lprobs[:, BOS_ID] = float("-inf")
    return lprobs


@torch.inference_mode()
def greedy_search(
    model: Transformer,
    src: Tensor,
    src_pad_mask: Tensor,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    min_len: int = 0,
) -> list[list[int]]:
    """Most probable next token at every step; returns ids without bos/eos."""
    limit = model.decoder.embed.max_positions
    max_lens = max_lengths(src_pad_mask, max_len_a, max_len_b, limit)
    memory = model.encode(src, src_pad_mask)
    cache = DecoderCache()
    tokens = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)
    ended = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for step in range(int(max_lens.max())):
        lprobs = _step_log_probs(model, tokens, memory, src_pad_mask, cache)
        if step < min_len:
            lprobs[:, EOS_ID] = float("-inf")
        next_tok = lprobs.argmax(dim=-1)
        next_tok[step + 1 >= max_lens] = EOS_ID
        next_tok[ended] = PAD_ID
        tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
        ended |= next_tok == EOS_ID
        if ended.all():
            break
    return [[t for t in row[1:] if t not in (EOS_ID, PAD_ID)] for row in tokens.tolist()]


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    src_pad_mask: Tensor,
    beam: int = 5,
    lenpen: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    nbest: int = 1,
    min_len: int = 0,
) -> list[list[Hypothesis]]:
    """The ``nbest`` best finished hypotheses per sentence, best first.

    ``min_len`` forbids eos before that many tokens, except where the length cap forces an end.
    """
    k = beam
    n_sent = src.size(0)
    device = src.device
    limit = model.decoder.embed.max_positions
    max_lens = max_lengths(src_pad_mask, max_len_a, max_len_b, limit)

    memory = model.encode(src, src_pad_mask).repeat_interleave(k, dim=0)  # (n*k, S, D)
    mask = src_pad_mask.repeat_interleave(k, dim=0)
    cache = DecoderCache()
    tokens = torch.full((n_sent * k, 1), BOS_ID, dtype=torch.long, device=device)
    scores = torch.full((n_sent, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    active = torch.arange(n_sent, device=device)  # sentence id of each active group of k rows
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    beam_offsets = torch.arange(k, device=device)

    for step in range(int(max_lens.max())):
        n = active.numel()
        lprobs = _step_log_probs(model, tokens, memory, mask, cache)  # (n*k, V)
        vocab = lprobs.size(1)
        must_end = step + 1 >= max_lens[active]  # (n,)
        eos = lprobs[:, EOS_ID].clone()
        if step < min_len:
            lprobs[:, EOS_ID] = float("-inf")
        if must_end.any():  # the length cap outranks min_len: these rows can only end
            rows = must_end.repeat_interleave(k)
            lprobs[rows] = float("-inf")
            lprobs[rows, EOS_ID] = eos[rows]

        cand = (scores[:, :, None] + lprobs.view(n, k, vocab)).view(n, k * vocab)
        cand_scores, cand_idx = cand.topk(2 * k, dim=1)  # (n, 2k), best first
        cand_beam = cand_idx // vocab
        cand_tok = cand_idx % vocab
        cand_eos = cand_tok == EOS_ID

        # File eos candidates that rank among the best k as finished hypotheses.
        ending = cand_eos[:, :k] & torch.isfinite(cand_scores[:, :k])
        if ending.any():
            for r, c in ending.nonzero().tolist():
                sentence = int(active[r])
                if len(finished[sentence]) < k:
                    history = tokens[r * k + int(cand_beam[r, c]), 1:].tolist()
                    logprob = float(cand_scores[r, c])
                    length = len(history) + 1
                    finished[sentence].append(Hypothesis(history, logprob / length_penalty(length, lenpen), logprob))

        # Continue with the best k candidates that did not end.
        scores, pick = cand_scores.masked_fill(cand_eos, float("-inf")).topk(k, dim=1)
        rows = (torch.arange(n, device=device)[:, None] * k + cand_beam.gather(1, pick)).view(-1)
        next_tok = cand_tok.gather(1, pick).view(-1, 1)

        done = must_end | torch.tensor([len(finished[s]) >= k for s in active.tolist()], device=device)
        if done.all():
            break
        if done.any():
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep[:, None] * k + beam_offsets).view(-1)
            rows = rows[keep_rows]
            next_tok = next_tok[keep_rows]
            scores = scores[keep]
            active = active[keep]
            memory = memory[keep_rows]
            mask = mask[keep_rows]
        tokens = torch.cat([tokens[rows], next_tok], dim=1)
        cache.select(rows)

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]
