"""Continuous batching: one beam search that sentences join and leave at every step.

A batch-at-a-time search runs until its longest sentence is done, its steps thinning as the others
end, and a sentence that arrives meanwhile waits for the next batch. Here the search goes on as long
as there is work: each ``step`` first admits the sentences added since (their encoder pass, their
rows appended to the batch), then extends every live sentence's beams by one token, and a sentence
that is done leaves at once with its hypotheses. Fed by a server's stream of requests, the batch
stays full and no request waits for another's long sentence.

The search is ``mtkit.decoding.search.beam_search``'s, step for step: both take their candidates from
``beam_step`` and leave the filing of finished hypotheses, the choice of those that go on and the rules
for when a sentence is done to ``settle``, so a sentence gets the same translation whichever sentences
share its steps. What differs is the layout: sentences that joined
at different steps share the self-attention cache, each row seeing only the slots from its own start
on. Each row embeds (absolute positions) or rotates (rotary ones) its token at its own position;
relative positions and attention windows need only the distance between two slots, which is the
distance between their positions. Any single model can be searched so (``supports``); an ensemble
averages models step by step in a layout of its own, and searches in whole batches.

A sentence whose request is withdrawn (``drop``) leaves at the next step, without hypotheses.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from mtkit.config import DecodeConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, PAD_ID
from mtkit.decoding.alignment import align_batch
from mtkit.decoding.line_translator import EMPTY, LineTranslator, Translation, Translator, source_ids
from mtkit.decoding.search import (
    Hypothesis,
    Settled,
    beam_step,
    best_extensions,
    best_first,
    group_rows,
    max_lengths,
    settle,
)
from mtkit.model.attention import DecoderCache
from mtkit.model.transformer import Transformer

log = logging.getLogger("mtkit")


def supports(model: object) -> bool:
    """Whether ``model`` can be searched continuously: one Transformer, with positions of any kind."""
    return isinstance(model, Transformer)


class ContinuousBeamSearch:
    """Beam search over the sentences ``add`` gives, ``step`` by ``step``, with ``decode``'s settings
    (beam, lenpen, length_penalty, max_len_a, max_len_b, min_len, early_stop) and ``nbest`` hypotheses per sentence.

    State, for the n live sentences and their beam-sized groups of rows (one group per sentence, in order):
    ``tokens`` (rows, slots + 1) holds each row's inputs by cache slot (pad before its start, bos at it),
    ``start`` (n,) the slot each sentence began at, ``scores`` (n, beam) its live hypotheses'
    log-probabilities and ``mask`` (n, S) its source padding.
    """

    def __init__(self, model: Transformer, decode: DecodeConfig, nbest: int = 1, lead: tuple[int, ...] = ()) -> None:
        """``lead``: the tokens every output starts with, certain (a target language's token; search.py's
        ``_force``), kept in the hypotheses."""
        if not supports(model):
            raise ValueError("continuous batching searches one model, not an ensemble")
        self.model, self.decode, self.nbest, self.beam = model, decode, nbest, decode.beam
        self.device = next(model.parameters()).device
        self.lead = torch.tensor(lead, dtype=torch.long, device=self.device)
        self.waiting: list[tuple[Hashable, list[int]]] = []
        self.withdrawn: set[Hashable] = set()  # live sentences that leave, unanswered, at the next step
        self._reset()

    def _reset(self) -> None:
        device, k = self.device, self.beam
        self.cache = DecoderCache()
        self.tokens = torch.empty(0, 1, dtype=torch.long, device=device)
        self.start = torch.empty(0, dtype=torch.long, device=device)
        self.scores = torch.empty(0, k, device=device)
        self.mask = torch.empty(0, 1, dtype=torch.bool, device=device)
        self.max_lens = torch.empty(0, dtype=torch.long, device=device)
        self.top_ended = torch.empty(0, dtype=torch.bool, device=device)  # best candidate has ended once
        self.keys: list[Hashable] = []
        self.finished: list[list[Hypothesis]] = []
        # The last step's reordering of the cache (rows, sentences kept, slots dropped), done at the next
        # step's start in one copy with room for the sentences that join then.
        self.pending: tuple[Tensor, Tensor | None, int] | None = None

    def add(self, key: Hashable, ids: list[int]) -> None:
        """Queue a sentence (source ids without eos, at least one) to join at the next step; ``step`` hands
        back its hypotheses with ``key``."""
        self.waiting.append((key, ids))

    def drop(self, keys: set[Hashable]) -> None:
        """Withdraw the sentences of ``keys``: those waiting at once, live ones at the next step, whose results
        leave them out."""
        self.waiting = [(key, ids) for key, ids in self.waiting if key not in keys]
        self.withdrawn |= keys & set(self.keys)

    def __len__(self) -> int:
        """Sentences live (withdrawn ones until they leave) or waiting to join."""
        return len(self.keys) + len(self.waiting)

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """Admit the waiting sentences, extend every live one by a token; the sentences done, with their
        ``nbest`` best finished hypotheses, best first."""
        joining, self.waiting = self.waiting, []
        if self.pending is not None:
            rows, cross_index, front = self.pending
            self.cache.select(rows, cross_index, front, new_rows=len(joining) * self.beam)
            self.pending = None
        if joining:
            self._admit(joining)
        if not self.keys:
            return []
        k, decode, cache = self.beam, self.decode, self.cache
        slots = cache.length + 1
        steps = cache.length - self.start  # tokens each sentence has generated: its input's position
        cache.positions = steps.repeat_interleave(k)
        seen = torch.arange(slots, device=self.device)[None, :] >= self.start[:, None]
        cache.self_allowed = seen.repeat_interleave(k, dim=0)[:, None, None, :]
        logits = self.model.decode(self.tokens[:, -1:], None, self.mask, cache)[:, -1].float()
        must_end = steps + 1 >= self.max_lens
        forced = None
        if len(self.lead) and bool((steps < len(self.lead)).any()):
            leading = torch.where(steps < len(self.lead), self.lead[steps.clamp(max=len(self.lead) - 1)], -1)
            forced = leading.repeat_interleave(k)
        row_lprobs, row_tok = best_extensions(
            logits,
            2 * k,
            eos_allowed=(steps >= decode.min_len).repeat_interleave(k),
            forced=forced,
            must_end=must_end.repeat_interleave(k),
            certain=True,
        )
        extensions = beam_step(self.scores, row_lprobs, row_tok, k)
        filed = [len(hyps) for hyps in self.finished]
        settled = settle(extensions, self.tokens, k, filed, must_end, self.top_ended, decode, self.nbest, self.start)
        for hyps, ended in zip(self.finished, settled.ended):
            hyps += ended
        self.top_ended, done = settled.top_ended, settled.done
        withdrawn, self.withdrawn = self.withdrawn, set()
        if withdrawn:
            done = done | torch.tensor([key in withdrawn for key in self.keys], device=self.device)
        leaving = done.tolist()
        results = [
            (key, best_first(hyps, self.nbest))
            for key, hyps, gone in zip(self.keys, self.finished, leaving)
            if gone and key not in withdrawn
        ]
        if all(leaving):
            self._reset()
        else:
            self._go_on(settled, done, leaving)
        return results

    def _go_on(self, settled: Settled, done: Tensor, leaving: list[bool]) -> None:
        """Extend the hypotheses that go on by their tokens. The sentences ``done`` leave, and with them their rows,
        the slots that no sentence left can see and the source padding that no source left needs."""
        k, rows, next_tok, scores = self.beam, settled.rows, settled.next_tok, settled.scores
        if not any(leaving):
            self.tokens = torch.cat([self.tokens[rows], next_tok], dim=1)
            self.scores = scores
            self.pending = (rows, None, 0)
            return
        keep = (~done).nonzero().squeeze(1)
        kept = [not gone for gone in leaving]
        self.keys = [key for key, live in zip(self.keys, kept) if live]
        self.finished = [hyps for hyps, live in zip(self.finished, kept) if live]
        keep_rows = group_rows(keep, k)
        self.start, self.scores, self.max_lens = self.start[keep], scores[keep], self.max_lens[keep]
        self.top_ended = self.top_ended[keep]
        front = int(self.start.min())  # slots before every kept sentence's start: nobody sees them now
        self.start -= front
        self.tokens = torch.cat([self.tokens[rows[keep_rows], front:], next_tok[keep_rows]], dim=1)
        self.pending = (rows[keep_rows], keep, front)
        self.mask = self.mask[keep]
        sources = int((~self.mask).sum(dim=1).max())
        if sources < self.mask.size(1):  # the longest source has left: its padding goes too
            self.mask = self.mask[:, :sources].contiguous()
            self.cache.narrow_sources(sources)

    def _admit(self, joining: list[tuple[Hashable, list[int]]]) -> None:
        """Sentences join: their encoder pass, cross-attention keys/values and rows (the cache's select made
        room for them), starting at the next slot. Their first step extends one hypothesis (the others
        start at -inf), as beam_search's does."""
        keys, ids = zip(*joining)
        k, device, cache = self.beam, self.device, self.cache
        src, pad_mask = (t.to(device) for t in source_tensor(list(ids)))
        limit = self.model.max_target_positions
        max_lens = max_lengths(pad_mask, self.decode.max_len_a, self.decode.max_len_b, limit)
        max_lens = max_lens.clamp(min=len(self.lead) + 1)  # the lead and an eos always fit
        joined = self.model.decoder.cross_cache(self.model.encode(src, pad_mask))
        m, slot = len(keys), cache.length
        scores = torch.full((m, k), float("-inf"), device=device)
        scores[:, 0] = 0.0
        tokens = torch.full((m * k, slot + 1), PAD_ID, dtype=torch.long, device=device)
        tokens[:, -1] = BOS_ID
        if self.keys:
            cache.join_sources(joined)
            width = max(self.mask.size(1), pad_mask.size(1))
            self.mask = torch.cat(
                [
                    F.pad(self.mask, (0, width - self.mask.size(1)), value=True),
                    F.pad(pad_mask, (0, width - pad_mask.size(1)), value=True),
                ]
            )
        else:
            self.cache, self.mask = joined, pad_mask
        self.tokens = torch.cat([self.tokens, tokens])
        self.start = torch.cat([self.start, torch.full((m,), slot, dtype=torch.long, device=device)])
        self.scores = torch.cat([self.scores, scores])
        self.max_lens = torch.cat([self.max_lens, max_lens])
        self.top_ended = torch.cat([self.top_ended, torch.zeros(m, dtype=torch.bool, device=device)])
        self.keys += keys
        self.finished += [[] for _ in keys]


class LineSearch:
    """Texts in, translations out, over a ``ContinuousBeamSearch`` with ``translator``'s model and settings:
    each text is tokenized as it joins and its ``nbest`` translations detokenized as it is done, the best with
    its word alignment when the translator has an aligner. An empty text (or one of no tokens) is done at the
    next step without the model, and one longer than the model's positions is truncated to fit, as
    ``mtkit translate`` does."""

    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        t = translator
        self.search = ContinuousBeamSearch(t.model, t.decode, t.nbest, t.target_lead)
        self.empty: list[Hashable] = []  # keys of texts that need no search
        self.sources: dict[Hashable, list[int]] = {}  # each live text's ids, which its alignment needs

    @staticmethod
    def accepts(translator: LineTranslator) -> bool:
        """Whether ``translator`` can be searched this way: mtkit's beam search over the whole vocabulary, on a
        model ``supports`` allows."""
        return (
            isinstance(translator, Translator)
            and translator.sampling is None
            and translator.shortlist is None
            and supports(translator.model)
        )

    def add(self, key: Hashable, line: str) -> None:
        t = self.translator
        ids = source_ids(t.src_tok, [line], t.model.max_source_positions, None, t.source_prefix, t.source_lead).get(0)
        if ids is None:
            self.empty.append(key)
            return
        self.search.add(key, ids)
        if self.translator.aligner is not None:
            self.sources[key] = ids

    def drop(self, keys: set[Hashable]) -> None:
        """Withdraw the texts of ``keys``: no result comes back for them."""
        self.empty = [key for key in self.empty if key not in keys]
        self.search.drop(keys)
        for key in keys:
            self.sources.pop(key, None)

    def step(self) -> list[tuple[Hashable, list[Translation]]]:
        done: list[tuple[Hashable, list[Translation]]] = [(key, [EMPTY]) for key in self.empty]
        self.empty = []
        t = self.translator
        finished = self.search.step()
        if t.target_lead:  # the language's token is no part of the translation
            skip = len(t.target_lead)
            finished = [(key, [replace(h, tokens=h.tokens[skip:]) for h in hyps]) for key, hyps in finished]
        alignments = [""] * len(finished)
        if t.aligner is not None and finished:
            pairs = [(self.sources.pop(key), hyps[0].tokens) for key, hyps in finished]
            leads = (t.source_lead, t.target_lead)
            alignments = align_batch(t.aligner, t.src_tok, t.tgt_tok, pairs, leads=leads)
        for (key, hyps), alignment in zip(finished, alignments):
            texts = self.translator.tgt_tok.decode([h.tokens for h in hyps])
            translations = [Translation(text, h.score, h.logprob) for text, h in zip(texts, hyps)]
            translations[0] = replace(translations[0], alignment=alignment)
            done.append((key, translations))
        return done

    def __len__(self) -> int:
        return len(self.search) + len(self.empty)
