"""Continuous batching: sentences that join a running search at any step get beam_search's hypotheses."""

from __future__ import annotations

import math
import random

import pytest
from helpers import random_sources, tiny_model

from mtkit.config import DecodeConfig
from mtkit.data.parallel import source_tensor
from mtkit.decoding.continuous import ContinuousBeamSearch, supports
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.search import beam_search

SETTINGS = [
    (DecodeConfig(beam=4, lenpen=1.0), 2),
    (DecodeConfig(beam=3, lenpen=0.0, early_stop=False, min_len=2), 1),
    (DecodeConfig(beam=1, lenpen=0.6, max_len_a=0.5, max_len_b=3), 1),
]


def streamed(search: ContinuousBeamSearch, sources: list[list[int]], seed: int) -> tuple[dict, int]:
    """Each source joins after a random number of steps (0-3) past the one before; the hypotheses by
    sentence, and the most cache slots the search held."""
    rng = random.Random(seed)
    results, waits, most_slots = {}, [rng.randint(0, 3) for _ in sources], 0
    next_up, steps = 0, 0
    # Every sentence ends by its output cap; a search that runs past all of them in a row has lost one.
    bound = sum(4 + len(s) + search.decode.max_len_b + int(search.decode.max_len_a * len(s)) for s in sources)
    while len(results) < len(sources):
        steps += 1
        assert steps <= bound, f"{len(sources) - len(results)} sentences still running after {bound} steps"
        while next_up < len(sources) and waits[next_up] == 0:
            search.add(next_up, sources[next_up])
            next_up += 1
        if next_up < len(sources):
            waits[next_up] -= 1
        results.update(search.step())
        most_slots = max(most_slots, search.cache.length)
    return results, most_slots


# Every kind of position, and a window short enough that long outputs slide past it.
POSITIONS = [
    {"positions": "sinusoidal"},
    {"positions": "learned"},
    {"positions": "rotary"},
    {"positions": "relative", "relative_clip": 3},
    {"positions": "sinusoidal", "attention_window": 3},
    {"positions": "rotary", "attention_window": 3},
]


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("positions", POSITIONS, ids=lambda p: "-".join(map(str, p.values())))
@pytest.mark.parametrize("decode, nbest", SETTINGS)
def test_sentences_that_join_at_any_step_get_the_hypotheses_of_beam_search(positions, decode, nbest, int8):
    model = tiny_model(30, seed=4, int8=int8, **positions)
    sources = random_sources(24, 30, seed=2)
    results, _ = streamed(ContinuousBeamSearch(model, decode, nbest), sources, seed=1)
    for i, source in enumerate(sources):
        alone = beam_search(model, *source_tensor([source]), decode, nbest)[0]
        assert [h.tokens for h in results[i]] == [h.tokens for h in alone], f"sentence {i}"
        for got, want in zip(results[i], alone):
            assert math.isclose(got.score, want.score, rel_tol=1e-4, abs_tol=1e-5)
            assert math.isclose(got.logprob, want.logprob, rel_tol=1e-4, abs_tol=1e-5)


def test_the_cache_keeps_only_slots_a_live_sentence_can_see():
    """Sentences keep coming for far longer than any one lasts: the cache's slots stay within the longest
    sentence's lifetime (its output cap and bos), rather than growing with every step the search has run."""
    model = tiny_model(30, seed=5)
    decode = DecodeConfig(beam=2, max_len_a=1.0, max_len_b=2)
    sources = random_sources(120, 30, seed=3)  # up to 8 tokens: outputs of at most 10, eos included
    search = ContinuousBeamSearch(model, decode)
    results, most_slots = streamed(search, sources, seed=2)
    assert len(results) == len(sources)
    assert most_slots <= 11
    assert len(search) == 0 and search.cache.length == 0  # run dry: nothing held


def test_a_search_that_ran_dry_starts_afresh():
    model = tiny_model(30, seed=6)
    decode = DecodeConfig(beam=3)
    sources = random_sources(6, 30, seed=4)
    search = ContinuousBeamSearch(model, decode)
    first, _ = streamed(search, sources, seed=0)
    again, _ = streamed(search, sources[::-1], seed=5)
    assert [h.tokens for h in again[0]] == [h.tokens for h in first[len(sources) - 1]]
    assert search.step() == []  # nothing live, nothing waiting


def test_withdrawn_sentences_leave_without_results_and_the_others_are_unchanged():
    """Sentences withdrawn while waiting or mid-search give nothing back, the search ends with none of them
    live, and the sentences that stayed get beam_search's hypotheses as if the others had never been there."""
    model = tiny_model(30, seed=4, positions="rotary")
    decode = DecodeConfig(beam=3)
    sources = random_sources(12, 30, seed=7)
    search = ContinuousBeamSearch(model, decode)
    for i, source in enumerate(sources[:8]):
        search.add(i, source)
    results = dict(search.step())
    search.drop({1, 2, 5})  # live
    for i, source in enumerate(sources[8:], start=8):
        search.add(i, source)
    search.drop({9})  # still waiting
    for _ in range(200):
        if not len(search):
            break
        results.update(search.step())
    assert not len(search) and search.cache.length == 0
    assert sorted(results) == [i for i in range(12) if i not in {1, 2, 5, 9}]
    for i, hyps in results.items():
        alone = beam_search(model, *source_tensor([sources[i]]), decode)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone], f"sentence {i}"


def test_a_single_model_of_any_positions_is_searched_continuously_and_an_ensemble_is_not():
    for overrides in ({}, {"positions": "learned"}, {"positions": "rotary"}, {"positions": "relative"}):
        assert supports(tiny_model(30, **overrides))
    assert supports(tiny_model(30, attention_window=4))
    assert not supports(Ensemble([tiny_model(30, seed=1), tiny_model(30, seed=2)]))
    with pytest.raises(ValueError, match="ensemble"):
        ContinuousBeamSearch(Ensemble([tiny_model(30, seed=1), tiny_model(30, seed=2)]), DecodeConfig())
