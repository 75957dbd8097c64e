"""Search: scripted probabilities explain why beam picks what it picks; tiny models check batching."""

from __future__ import annotations

import math

import torch
from conftest import tiny_model

from mtkit.data import source_tensor
from mtkit.model import DecoderCache
from mtkit.search import beam_search, greedy_search, length_penalty
from mtkit.tokenizer import EOS_ID

A, B, C = 4, 5, 6
VOCAB = 7


class ScriptedModel:
    """Next-token probabilities chosen by the test: script(step, last_token) -> {token: prob}."""

    def __init__(self, script, max_positions: int = 64) -> None:
        self.script = script
        self.decoder = type("D", (), {"embed": type("E", (), {"max_positions": max_positions})()})()

    def encode(self, src, src_pad_mask):
        return torch.zeros(src.size(0), src.size(1), 1)

    def decode(self, tgt_in, memory, src_pad_mask, cache: DecoderCache):
        step = cache.length
        cache.length += 1
        logits = torch.full((tgt_in.size(0), 1, VOCAB), math.log(1e-9))
        for row, last in enumerate(tgt_in[:, -1].tolist()):
            for token, prob in self.script(step, last).items():
                logits[row, 0, token] = math.log(prob)
        return logits


def one_source(length: int = 3):
    return source_tensor([[A] * length])


def test_beam_finds_the_sequence_greedy_misses():
    # greedy takes A (0.6) then eos (0.4): p = 0.24; beam also tries B (0.4) then eos (0.9): p = 0.36.
    def script(step, last):
        if step == 0:
            return {A: 0.6, B: 0.4}
        if step == 1:
            return {EOS_ID: 0.4, A: 0.3, B: 0.3} if last == A else {EOS_ID: 0.9, A: 0.1}
        return {EOS_ID: 1.0}

    model = ScriptedModel(script)
    src, mask = one_source()
    assert greedy_search(model, src, mask) == [[A]]
    best = beam_search(model, src, mask, beam=2, lenpen=0.0)[0][0]
    assert best.tokens == [B]
    assert math.isclose(best.logprob, math.log(0.36), rel_tol=1e-4)


def test_length_penalty_decides_between_short_and_long():
    # [] scores log 0.5 = -0.693; [A] scores log(0.5 * 0.95) = -0.744, which length normalisation lifts.
    def script(step, last):
        if step == 0:
            return {EOS_ID: 0.5, A: 0.5}
        return {EOS_ID: 0.95, A: 0.05}

    model = ScriptedModel(script)
    src, mask = one_source()
    assert beam_search(model, src, mask, beam=2, lenpen=0.0)[0][0].tokens == []
    best = beam_search(model, src, mask, beam=2, lenpen=1.0)[0][0]
    assert best.tokens == [A]
    assert math.isclose(best.score, math.log(0.475) / length_penalty(2, 1.0), rel_tol=1e-4)


def test_output_length_is_capped_and_nbest_sorted_distinct():
    def script(step, last):  # never wants to stop
        return {A: 0.5, B: 0.3, C: 0.2}

    model = ScriptedModel(script)
    src, mask = one_source(length=4)
    hyps = beam_search(model, src, mask, beam=3, lenpen=1.0, max_len_a=1.0, max_len_b=2, nbest=3)[0]
    assert all(len(h.tokens) == 4 + 2 - 1 for h in hyps)  # a * 4 + b tokens, the last being the forced eos
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert len({tuple(h.tokens) for h in hyps}) == 3


def random_sources(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def test_beam_one_equals_greedy():
    model = tiny_model(30, seed=3)
    src, mask = source_tensor(random_sources(8, 30))
    greedy = greedy_search(model, src, mask)
    beam = [h[0].tokens for h in beam_search(model, src, mask, beam=1, lenpen=0.0)]
    assert beam == greedy


def test_batched_search_equals_one_sentence_at_a_time():
    model = tiny_model(30, seed=4)
    sources = random_sources(7, 30, seed=1)
    src, mask = source_tensor(sources)
    batched = beam_search(model, src, mask, beam=4, lenpen=1.0, nbest=2)
    for sentence, hyps in zip(sources, batched):
        alone = beam_search(model, *source_tensor([sentence]), beam=4, lenpen=1.0, nbest=2)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        for h, a in zip(hyps, alone):
            assert math.isclose(h.score, a.score, rel_tol=1e-4, abs_tol=1e-5)
