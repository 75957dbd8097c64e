"""Search: scripted probabilities explain why beam picks what it picks; tiny models check batching."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import random_sources, tiny_model

from mtkit import runtime
from mtkit.config import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    BackTranslationConfig,
    ConfigError,
    DecodeConfig,
    SamplingConfig,
)
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtkit.decoding.search import (
    Extensions,
    Hypothesis,
    ban_pad_and_bos,
    beam_search,
    beam_step,
    best_first,
    draw,
    greedy_search,
    group_rows,
    length_penalty,
    max_length,
    max_lengths,
    nucleus,
    row_argmax,
    row_topk,
    sample_search,
    settle,
)
from mtkit.model.attention import DecoderCache

A, B, C = 4, 5, 6
VOCAB = 7


class ScriptedModel:
    """Next-token probabilities chosen by the test: script(step, last_token) -> {token: prob}."""

    def __init__(self, script, max_positions: int = 64) -> None:
        self.script = script
        self.max_target_positions = max_positions

    def encode(self, src, src_pad_mask):
        return torch.zeros(src.size(0), src.size(1), 1)

    def decode(self, tgt_in, memory, src_pad_mask, cache: DecoderCache, candidates=None):
        assert candidates is None  # scripted over the whole vocabulary
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
    best = beam_search(model, src, mask, DecodeConfig(beam=2, lenpen=0.0))[0][0]
    assert best.tokens == [B]
    assert math.isclose(best.logprob, math.log(0.36), rel_tol=1e-4)


def test_length_penalty_decides_between_short_and_long():
    # [] scores log 0.51 = -0.673; [A] scores log(0.49 * 0.95) = -0.765, which length normalisation lifts to -0.655.
    def script(step, last):
        if step == 0:
            return {EOS_ID: 0.51, A: 0.49}
        return {EOS_ID: 0.95, A: 0.05}

    model = ScriptedModel(script)
    src, mask = one_source()
    assert beam_search(model, src, mask, DecodeConfig(beam=2, lenpen=0.0, early_stop=False))[0][0].tokens == []
    best = beam_search(model, src, mask, DecodeConfig(beam=2, lenpen=1.0, early_stop=False))[0][0]
    assert best.tokens == [A]
    assert math.isclose(best.score, math.log(0.49 * 0.95) / length_penalty(2, 1.0), rel_tol=1e-4)
    # Early stopping ends the search when the best-ranked candidate ([] at step 0) ends: [A] never finishes.
    assert beam_search(model, src, mask, DecodeConfig(beam=2, lenpen=1.0))[0][0].tokens == []


def test_the_power_length_penalty_divides_by_the_length_as_transformers_does():
    """[] scores log 0.6 = -0.511 under either penalty. [A A A] has log-probability log 0.324 = -1.127 over 4 tokens
    (eos counted): GNMT divides it by (5 + 4) / 6 = 1.5, to -0.751, and keeps []; power divides it by 4, to -0.282,
    as transformers, CTranslate2, fairseq and Marian rank it, and takes it. Greedy search scores alike."""

    def script(step, last):
        return [{EOS_ID: 0.6, A: 0.4}, {A: 0.9, B: 0.1}, {A: 0.9, B: 0.1}, {EOS_ID: 1.0}][min(step, 3)]

    model = ScriptedModel(script)
    src, mask = one_source()
    gnmt = DecodeConfig(beam=2, lenpen=1.0, early_stop=False)
    power = DecodeConfig(beam=2, lenpen=1.0, length_penalty="power", early_stop=False)
    assert beam_search(model, src, mask, gnmt)[0][0].tokens == []
    best = beam_search(model, src, mask, power)[0][0]
    assert best.tokens == [A, A, A]
    assert math.isclose(best.score, math.log(0.324) / 4, rel_tol=1e-4)
    assert math.isclose(best.score, best.logprob / length_penalty(4, 1.0, "power"), rel_tol=1e-6)
    greedy = sample_search(model, src, mask, None, DecodeConfig(lenpen=2.0, length_penalty="power"))[0]
    assert greedy.tokens == [] and math.isclose(greedy.score, math.log(0.6), rel_tol=1e-4)  # 1 ** 2: unchanged
    with pytest.raises(ConfigError, match="decode.length_penalty must be one of gnmt, power, got 'avg'"):
        DecodeConfig(length_penalty="avg")


def test_output_length_is_capped_and_nbest_sorted_distinct():
    def script(step, last):  # never wants to stop
        return {A: 0.5, B: 0.3, C: 0.2}

    model = ScriptedModel(script)
    src, mask = one_source(length=4)
    hyps = beam_search(model, src, mask, DecodeConfig(beam=3, lenpen=1.0, max_len_a=1.0, max_len_b=2), nbest=3)[0]
    assert all(len(h.tokens) == 4 + 2 - 1 for h in hyps)  # a * 4 + b tokens, the last being the forced eos
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert len({tuple(h.tokens) for h in hyps}) == 3


def test_one_sentences_cap_is_the_batched_caps():
    """``max_length`` (no torch, for CTranslate2) computes what ``max_lengths`` does, float32 rounding included."""
    lengths = list(range(0, 300, 7))
    _, mask = source_tensor([[A] * n for n in lengths])
    for a, b, limit in [(1.5, 10, 1024), (1.1, 3, 1024), (1.2, 0, 64), (0.3, 1, 1024), (0.0, 5, 1024), (2.7, 2, 200)]:
        batched = max_lengths(mask, a, b, limit).tolist()
        assert [max_length(n, a, b, limit) for n in lengths] == batched


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize(
    "bounds",
    [{}, {"lenpen": 0.6, "min_len": 3}, {"max_len_a": 0.0, "max_len_b": 4}, {"lenpen": 0.0, "min_len": 50}],
    ids=["plain", "lenpen-min_len", "cap", "min_len-beyond-cap"],
)
def test_greedy_finds_what_beam_one_finds_scores_included(int8, bounds):
    """Translation decodes beam 1 with the greedy loop: its outputs and scores must be beam search's to the bit,
    under every bound, with forced prefixes, while sentences of the batch end at different steps."""
    model = tiny_model(30, seed=3, int8=int8)
    src, mask = source_tensor(random_sources(12, 30, seed=5))
    decode = DecodeConfig(beam=1, **bounds)
    for prefixes in (None, [[7, 8], [], [9], [10, 11, 12]] * 3):
        greedy = sample_search(model, src, mask, None, decode, prefixes)
        beam = [h[0] for h in beam_search(model, src, mask, decode, prefixes=prefixes)]
        assert greedy == beam
        if not bounds:  # and sentences left the batch at different steps
            assert len({len(h.tokens) for h in greedy}) > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])  # products in ATen or oneDNN
def test_batched_search_equals_one_sentence_at_a_time(vendor, dtype, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", 0)
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2 alone: no oneDNN bf16
        monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx512_bf16"}))
    model = tiny_model(30, seed=4).to(dtype)
    sources = random_sources(7, 30, seed=1)
    src, mask = source_tensor(sources)
    batched = beam_search(model, src, mask, DecodeConfig(beam=4, lenpen=1.0), nbest=2)
    for sentence, hyps in zip(sources, batched):
        alone = beam_search(model, *source_tensor([sentence]), DecodeConfig(beam=4, lenpen=1.0), nbest=2)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        for h, a in zip(hyps, alone):
            assert math.isclose(h.score, a.score, rel_tol=1e-4, abs_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_search_finds_the_same_through_either_library_of_the_products(dtype, monkeypatch):
    """oneDNN's products (x86 CPUs not made by Intel: the vocabulary's in fp32, every layer's in bf16 with native bf16)
    change no output and no score beyond rounding: greedy and beam 4, nbest 2, against ATen's."""
    monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", 0)
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2 alone: no oneDNN bf16
        monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx512_bf16"}))
    model = tiny_model(30, seed=5).to(dtype)
    src, mask = source_tensor(random_sources(9, 30, seed=3))
    found = {}
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(runtime, "cpu_vendor", lambda vendor=vendor: vendor)
        beams = beam_search(model, src, mask, DecodeConfig(beam=4, lenpen=1.0), nbest=2)
        found[vendor] = sample_search(model, src, mask) + [h for hyps in beams for h in hyps]
    for a, b in zip(*found.values(), strict=True):
        assert a.tokens == b.tokens
        assert math.isclose(a.logprob, b.logprob, rel_tol=1e-5, abs_tol=1e-5)
    assert len({len(h.tokens) for h in found["GenuineIntel"]}) > 2  # several lengths: eos decisions compared too


# --- exhaustive search on a 7-id vocabulary -------------------------------------------------------

CAP = 4  # max_len_a=0, max_len_b=CAP: at most CAP - 1 tokens, then the forced eos
WORDS = [t for t in range(VOCAB) if t not in (PAD_ID, BOS_ID, EOS_ID)]  # unk, A, B, C


@torch.no_grad()
def exhaustive(model, source: list[int]) -> dict[tuple[int, ...], float]:
    """log p(tokens + eos | source) for every hypothesis under the cap, from full-prefix decodes (no cache)."""
    src, mask = source_tensor([source])
    memory = model.encode(src, mask)
    logprobs = {}
    for length in range(CAP):
        hyps = list(itertools.product(WORDS, repeat=length))
        tgt_in = torch.tensor([[BOS_ID, *h] for h in hyps], dtype=torch.long).view(len(hyps), length + 1)
        n = len(hyps)
        logits = model.decode(tgt_in, memory.expand(n, -1, -1), mask.expand(n, -1))
        lprobs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor([[*h, EOS_ID] for h in hyps], dtype=torch.long).view(n, length + 1)
        per_token = lprobs.gather(2, target[:, :, None]).squeeze(2).double().sum(dim=1)
        logprobs.update(zip(hyps, per_token.tolist()))
    return logprobs


def close(a: float, b: float) -> bool:
    """Equal up to float32 rounding: cached vs full-prefix decoding, summed step by step vs at once."""
    return math.isclose(a, b, rel_tol=2e-6, abs_tol=1e-5)


def normalised(logprob: float, tokens, lenpen: float, form: str = "gnmt") -> float:
    return logprob / length_penalty(len(tokens) + 1, lenpen, form)


EXHAUSTIVE_SOURCES = [[4, 5], [6, 6, 4, 5, 1], [5]]
EXHAUSTIVE_SEEDS = [0, 2, 3]


def sharp_tiny_model(seed: int):
    """A 7-id tiny model with sharpened logits (x4), so that hypotheses of every length compete for the top:
    at the plain init the empty hypothesis nearly always wins."""
    model = tiny_model(VOCAB, seed=seed)
    with torch.no_grad():
        model.output.weight.mul_(4.0)
    return model


def test_exhaustive_cases_are_not_trivial():
    # Guards the choice of seeds and sources below: optima of several lengths, and narrow beams that miss them.
    optimum_lengths, misses = set(), 0
    for seed in EXHAUSTIVE_SEEDS:
        model = sharp_tiny_model(seed)
        for source in EXHAUSTIVE_SOURCES:
            logprobs = exhaustive(model, source)
            for lenpen in (0.0, 1.0):
                best = max(logprobs, key=lambda t: normalised(logprobs[t], t, lenpen))
                optimum_lengths.add(len(best))
                found = beam_search(
                    model, *source_tensor([source]), DecodeConfig(beam=2, lenpen=lenpen, max_len_a=0, max_len_b=CAP)
                )
                misses += tuple(found[0][0].tokens) != best
    assert {0, CAP - 1} <= optimum_lengths and len(optimum_lengths) >= 3
    assert misses > 0


@pytest.mark.parametrize("lenpen, form", [(0.0, "gnmt"), (1.0, "gnmt"), (1.0, "power")])
@pytest.mark.parametrize("seed", EXHAUSTIVE_SEEDS)
def test_beam_search_against_exhaustive_enumeration(seed, lenpen, form):
    model = sharp_tiny_model(seed)
    src, mask = source_tensor(EXHAUSTIVE_SOURCES)
    space = [exhaustive(model, source) for source in EXHAUSTIVE_SOURCES]
    n_prefixes = sum(len(WORDS) ** m for m in range(CAP))  # one live prefix per hypothesis: 1 + 4 + 16 + 64
    assert all(len(s) == n_prefixes for s in space)
    bounds = {"lenpen": lenpen, "length_penalty": form, "max_len_a": 0.0, "max_len_b": CAP}

    # Narrow beams: what beam search returns is real, scored exactly, sorted, and never beats the optimum.
    for beam in (1, 2, 3):
        results = beam_search(model, src, mask, DecodeConfig(beam=beam, **bounds), nbest=beam)
        for hyps, logprobs in zip(results, space):
            assert 1 <= len(hyps) <= beam
            assert len({tuple(h.tokens) for h in hyps}) == len(hyps)
            scores = [h.score for h in hyps]
            assert scores == sorted(scores, reverse=True)
            assert hyps[0].score == max(scores)  # the best of its own finished set
            for h in hyps:
                assert tuple(h.tokens) in logprobs  # under the cap, no pad/bos/eos inside
                assert close(h.logprob, logprobs[tuple(h.tokens)])
                assert math.isclose(h.score, normalised(h.logprob, h.tokens, lenpen, form), rel_tol=1e-6, abs_tol=1e-6)
            best = max(normalised(lp, t, lenpen, form) for t, lp in logprobs.items())
            assert hyps[0].score <= best + 1e-5

    # A beam as wide as the space of prefixes keeps every prefix alive: beam search becomes exhaustive.
    results = beam_search(model, src, mask, DecodeConfig(beam=n_prefixes, **bounds), nbest=n_prefixes)
    for hyps, logprobs in zip(results, space):
        ranked = sorted(logprobs, key=lambda t: -normalised(logprobs[t], t, lenpen, form))
        top, runner_up = (normalised(logprobs[t], t, lenpen, form) for t in ranked[:2])
        assert top - runner_up > 1e-4  # no near tie, so the argmax is well defined
        assert len(hyps) == n_prefixes  # every hypothesis finished
        assert tuple(hyps[0].tokens) == ranked[0]
        assert close(hyps[0].score, top)
        assert close(hyps[0].logprob, logprobs[ranked[0]])
        for h in hyps:
            assert close(h.logprob, logprobs[tuple(h.tokens)])


def test_early_stop_loses_nothing_without_a_length_penalty():
    """Without length normalisation a score only falls as a hypothesis grows, so once the best-ranked
    candidate has ended nothing still live can beat it: early stopping returns what the full search
    returns, in fewer decoder steps."""
    src, mask = source_tensor(EXHAUSTIVE_SOURCES)
    for seed in EXHAUSTIVE_SEEDS:
        model = sharp_tiny_model(seed)
        for beam in (2, 3):
            steps = {}
            for early in (True, False):
                calls = []
                decode = model.decode
                model.decode = lambda *a, calls=calls, decode=decode: calls.append(1) or decode(*a)
                found = beam_search(
                    model, src, mask, DecodeConfig(beam=beam, lenpen=0.0, max_len_a=0, max_len_b=CAP, early_stop=early)
                )
                del model.decode
                steps[early] = (len(calls), [h[0].tokens for h in found])
            assert steps[True][1] == steps[False][1]
            assert steps[True][0] <= steps[False][0]


# --- min_len --------------------------------------------------------------------------------------


def eager_to_stop(step, last):
    return {EOS_ID: 0.9, A: 0.06, B: 0.04}


@pytest.mark.parametrize("min_len", [1, 3])
def test_min_len_delays_eos(min_len):
    model = ScriptedModel(eager_to_stop)
    src, mask = one_source()
    assert (
        beam_search(model, src, mask, DecodeConfig(beam=2, lenpen=0.0))[0][0].tokens == []
    )  # without it: stop at once
    assert greedy_search(model, src, mask) == [[]]
    hyps = beam_search(model, src, mask, DecodeConfig(beam=3, lenpen=0.0, min_len=min_len), nbest=3)[0]
    assert len(hyps) == 3
    assert all(len(h.tokens) >= min_len for h in hyps)
    assert hyps[0].tokens == [A] * min_len  # eos as soon as it is allowed
    assert math.isclose(hyps[0].logprob, min_len * math.log(0.06) + math.log(0.9), rel_tol=1e-4)
    assert greedy_search(model, src, mask, DecodeConfig(min_len=min_len)) == [[A] * min_len]


@pytest.mark.parametrize("cap", [1, 2])
def test_length_cap_outranks_min_len(cap):
    model = ScriptedModel(eager_to_stop)
    src, mask = one_source()
    bounds = {"max_len_a": 0.0, "max_len_b": cap, "min_len": 5}
    hyps = beam_search(model, src, mask, DecodeConfig(beam=2, lenpen=1.0, **bounds), nbest=2)[0]
    assert hyps, "the cap must still end a hypothesis"
    assert all(len(h.tokens) == cap - 1 for h in hyps)  # cap - 1 tokens, then the forced eos
    expected = [[A], [B]][: len(hyps)] if cap == 2 else [[]]
    assert [h.tokens for h in hyps] == expected
    assert math.isclose(hyps[0].logprob, (cap - 1) * math.log(0.06) + math.log(0.9), rel_tol=1e-4)
    assert greedy_search(model, src, mask, DecodeConfig(**bounds)) == [[A] * (cap - 1)]


# --- n-best ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("lenpen", [0.0, 0.6, 1.0])
def test_nbest_is_the_whole_beam_sorted_distinct_and_scored(lenpen):
    model = tiny_model(30, seed=5)
    src, mask = source_tensor(random_sources(6, 30, seed=2))
    beam = 4
    for hyps in beam_search(model, src, mask, DecodeConfig(beam=beam, lenpen=lenpen), nbest=beam):
        assert len(hyps) == beam
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == beam
        for h in hyps:
            assert EOS_ID not in h.tokens and PAD_ID not in h.tokens and BOS_ID not in h.tokens
            assert math.isfinite(h.logprob) and h.logprob < 0
            assert h.score == pytest.approx(h.logprob / length_penalty(len(h.tokens) + 1, lenpen), rel=1e-6)


# -- sampling and forced prefixes ------------------------------------------------------------


def test_sampling_follows_the_model_and_its_filters():
    def script(step, last):  # one token, then stop
        return {A: 0.6, B: 0.3, C: 0.1} if step == 0 else {EOS_ID: 1.0}

    model = ScriptedModel(script)
    src, mask = source_tensor([[A] * 3] * 3000)
    g = torch.Generator().manual_seed(0)

    def first_tokens(sampling):
        return [h.tokens[0] for h in sample_search(model, src, mask, sampling, generator=g)]

    drawn = first_tokens(SamplingConfig())
    assert abs(drawn.count(A) / len(drawn) - 0.6) < 0.03 and abs(drawn.count(C) / len(drawn) - 0.1) < 0.02
    assert set(first_tokens(SamplingConfig(top_k=2))) == {A, B}
    assert set(first_tokens(SamplingConfig(top_p=0.5))) == {A}  # A alone holds 0.6 >= 0.5
    assert set(first_tokens(SamplingConfig(top_p=0.7))) == {A, B}
    assert set(first_tokens(SamplingConfig(temperature=0.05))) == {A}
    hyp = sample_search(model, *one_source(), SamplingConfig(top_k=1), generator=g)[0]
    assert hyp.tokens == [A] and math.isclose(hyp.logprob, math.log(0.6), rel_tol=1e-4)  # the model's own


def test_sampling_at_the_temperature_bounds_draws_and_beyond_them_is_refused():
    """The bounds are where float32 still holds the temperature: at the lowest every draw is the greedy token, at
    the highest the draws spread over the tokens; 1e-300 (0 in float32) and 1e300 (infinity) made NaN weights and
    an index out of bounds."""

    def script(step, last):
        return {A: 0.6, B: 0.3, C: 0.1} if step == 0 else {EOS_ID: 1.0}

    src, mask = source_tensor([[A] * 3] * 300)
    g = torch.Generator().manual_seed(0)
    for bound in (MIN_TEMPERATURE, MAX_TEMPERATURE):  # CUDA divides by multiplying with the inverse, in float32
        assert torch.isfinite(torch.tensor([bound, 1 / bound], dtype=torch.float32)).all()
        assert torch.tensor(1 / bound, dtype=torch.float32) > 0
    cold, hot = (SamplingConfig(temperature=t) for t in (MIN_TEMPERATURE, MAX_TEMPERATURE))
    assert {h.tokens[0] for h in sample_search(ScriptedModel(script), src, mask, cold, generator=g)} == {A}
    drawn = {
        h.tokens[0] if h.tokens else EOS_ID for h in sample_search(ScriptedModel(script), src, mask, hot, generator=g)
    }
    assert drawn == {UNK_ID, EOS_ID, A, B, C}  # uniform over all but pad and bos, the script's 1e-9 ones too
    for value in (1e-300, 1e300):
        with pytest.raises(ConfigError, match=re.escape(f"--temperature must be in [1e-30, 1e+30], got {value:g}")):
            SamplingConfig(temperature=value)
        with pytest.raises(ConfigError, match="backtranslation.temperature must be in"):
            BackTranslationConfig(temperature=value)


@pytest.mark.parametrize("width", [3, 64, 200])
def test_draw_follows_each_rows_probabilities_and_never_draws_a_zero(width):
    """Draws land on each entry at its share (within 5 standard deviations over 60,000 draws per row), also
    across block boundaries and in a last, partial block; entries of probability 0 never; rows independently."""
    g = torch.Generator().manual_seed(0)
    rows = torch.zeros(3, width, dtype=torch.float32)
    rows[0, :] = torch.rand(width, generator=g) * (torch.rand(width, generator=g) > 0.3)  # some zeros
    rows[0, 0] = 1.0
    rows[1, -1], rows[1, width // 2] = 3.0, 0.001  # unnormalised, a small share beside a large one
    rows[2, 1 % width] = 2.0  # one possible entry
    draws = 60_000
    drawn = draw(rows.repeat_interleave(draws, 0), g).view(3, draws)
    for row, columns in zip(rows, drawn):
        counts = torch.bincount(columns, minlength=width).double()
        share = row.double() / row.double().sum()
        assert torch.all(counts[share == 0] == 0)
        spread = (draws * share * (1 - share)).sqrt()
        assert torch.all((counts - draws * share).abs() <= 5 * spread + 1e-9)
    assert drawn[1].eq(width // 2).any()  # the small share (about 1 in 3,000) was reached


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_is_the_sorted_rows_prefix_whatever_its_size(top_p):
    """The nucleus equals what sorting each whole row gives (the columns while the mass before them is below
    top_p), for sharp rows (a few columns) and flat ones (thousands) in one batch."""
    g = torch.Generator().manual_seed(3)
    sharpness = torch.tensor([8.0, 4.0, 1.0, 0.2, 0.05])[:, None]
    probs = (torch.randn(5, 3000, generator=g) * sharpness).softmax(dim=1)
    values, columns = nucleus(probs, top_p)
    ordered = probs.sort(dim=1, descending=True).values
    inside = ordered.cumsum(dim=1) - ordered < top_p
    sizes = []
    for row in range(5):
        kept = values[row] > 0
        assert torch.equal(values[row][kept], probs[row, columns[row][kept]])
        assert len(set(columns[row][kept].tolist())) == int(kept.sum())
        # the same probabilities (among exactly equal ones, the columns kept at the boundary may differ)
        assert torch.equal(values[row][kept].sort().values, ordered[row][inside[row]].sort().values)
        sizes.append(int(kept.sum()))
    assert min(sizes) < 64 < max(sizes)  # the rows needed different widths


def test_top_k_one_sampling_is_greedy():
    model = tiny_model(30, seed=5)
    src, mask = source_tensor(random_sources(6, 30, seed=2))
    drawn = sample_search(model, src, mask, SamplingConfig(top_k=1), generator=torch.Generator().manual_seed(1))
    assert [h.tokens for h in drawn] == greedy_search(model, src, mask)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_prefixes_start_the_output_and_leave_other_sentences_alone(int8):
    model = tiny_model(30, seed=6, int8=int8)
    sources = random_sources(4, 30, seed=3)
    prefixes = [[7, 8], [], [9], [10, 11, 12]]
    src, mask = source_tensor(sources)
    for outputs in (
        greedy_search(model, src, mask, prefixes=prefixes),
        [h[0].tokens for h in beam_search(model, src, mask, DecodeConfig(beam=3), prefixes=prefixes)],
    ):
        for out, prefix in zip(outputs, prefixes):
            assert out[: len(prefix)] == prefix
    batched = beam_search(model, src, mask, DecodeConfig(beam=3), prefixes=prefixes)
    for sentence, prefix, hyps in zip(sources, prefixes, batched):
        alone = beam_search(model, *source_tensor([sentence]), DecodeConfig(beam=3), prefixes=[prefix])[0]
        assert hyps[0].tokens == alone[0].tokens
    unforced = [h[0].tokens for h in beam_search(model, src, mask, DecodeConfig(beam=3))]
    assert [h[0].tokens for h in batched][1] == unforced[1]  # an empty prefix changes nothing


def test_row_topk_gives_torch_topk_values_on_wide_rows():
    """Winners crowded into one block, in the columns after the last whole block, masked rows, ties."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8003, generator=gen)
    x[:10, 640:660] += 8.0  # all ten best of these rows in one or two blocks
    x[10:20, -3:] += 8.0  # the best are the three columns after the last whole block
    x[20:30] = float("-inf")  # a row that may only end: one finite entry
    x[20:30, EOS_ID] = -1.0
    x[30:, :] = x[30:, :].round()  # many exact ties
    for k in (1, 10):
        values, index = row_topk(x, k, block=64)
        assert torch.equal(values, x.topk(k, dim=1).values)
        assert torch.equal(x.gather(1, index), values)
        assert all(len(set(row)) == k for row in index.tolist())  # k different columns


@pytest.mark.parametrize("width", [8000, 8003, 700])
def test_row_argmax_is_argmax_first_of_ties_included(width):
    """Through the block path (>= 2**18 elements): the best in the columns after the last whole block, ties
    across blocks and inside one (the first must win), and rows that may only end."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, width, generator=gen)
    x[:50, -1] += 8.0  # the best is the last column
    x[50:100, [3, width - 1]] += 8.0  # equal best in the first block and the last column
    x[100:150, [64 * 5 + 9, 64 * 5 + 2, 64 * 9]] = 9.0  # equal best twice in one block and once in a later one
    x[150:200] = float("-inf")
    x[150:200, EOS_ID] = -1.0
    x[200:] = x[200:].round()  # many exact ties
    assert torch.equal(row_argmax(x, block=64), x.argmax(dim=1))
    assert torch.equal(row_argmax(x[:3], block=64), x[:3].argmax(dim=1))  # few rows: argmax itself


def test_beam_step_ranks_every_extension_of_every_hypothesis():
    """Scripted: two hypotheses (log-probabilities -1 and -2) with their best next tokens; k = 2 asks for 4."""
    scores = torch.tensor([[-1.0, -2.0]])
    row_lprobs = torch.tensor([[-0.1, -3.0, -4.0, -5.0], [-0.2, -0.3, -6.0, -7.0]])
    row_tok = torch.tensor([[A, B, C, EOS_ID], [C, EOS_ID, A, B]])
    cand_scores, beams, tokens = beam_step(scores, row_lprobs, row_tok, k=2)
    assert cand_scores[0].tolist() == pytest.approx([-1.1, -2.2, -2.3, -4.0])
    assert beams.tolist() == [[0, 1, 1, 0]] and tokens.tolist() == [[A, C, EOS_ID, B]]


def test_beam_step_pads_a_tiny_vocabulary_with_impossible_candidates():
    cand_scores, beams, tokens = beam_step(torch.zeros(1, 1), torch.tensor([[-0.5, -1.0]]), torch.tensor([[A, B]]), k=2)
    assert cand_scores[0, :2].tolist() == [-0.5, -1.0] and torch.isinf(cand_scores[0, 2:]).all()
    assert tokens.tolist() == [[A, B, PAD_ID, PAD_ID]] and beams.tolist() == [[0, 0, 0, 0]]


# -- bookkeeping after a step (shared with the continuous search) --------------------------------------------


def two_hypotheses_ranked():
    """One sentence, beam 2, live hypotheses [C] (row 0) and [A] (row 1); its 2k = 4 candidates, best first:
    [C] ends (-1.0), [A] goes on with A (-1.5), [C] with B (-2.0), [A] ends (-3.0, below the best k)."""
    ext = Extensions(
        scores=torch.tensor([[-1.0, -1.5, -2.0, -3.0]]),
        beam=torch.tensor([[0, 1, 0, 1]]),
        tokens=torch.tensor([[EOS_ID, A, B, EOS_ID]]),
    )
    tokens = torch.tensor([[BOS_ID, C], [BOS_ID, A]])
    return ext, tokens


@pytest.mark.parametrize("early_stop", [True, False])
def test_settle_files_eos_among_the_best_k_and_keeps_the_best_k_that_go_on(early_stop):
    ext, tokens = two_hypotheses_ranked()
    decode = DecodeConfig(beam=2, lenpen=1.0, early_stop=early_stop)
    settled = settle(ext, tokens, 2, [0], torch.tensor([False]), torch.tensor([False]), decode, nbest=1)
    assert settled.ended == [[Hypothesis([C], -1.0 / length_penalty(2, 1.0), -1.0)]]  # not [A]: ranked 4th
    assert settled.scores.tolist() == [[-1.5, -2.0]]
    assert settled.rows.tolist() == [1, 0] and settled.next_tok.tolist() == [[A], [B]]
    assert settled.top_ended.tolist() == [True]
    # One of k = 2 finished: only early stopping (the best-ranked candidate ended, nbest = 1 filed) ends it.
    assert settled.done.tolist() == [early_stop]


def test_settle_files_no_more_than_k_and_then_the_sentence_is_done():
    ext, tokens = two_hypotheses_ranked()
    ext = ext._replace(tokens=torch.tensor([[EOS_ID, EOS_ID, B, A]]))  # both of the best k end
    decode = DecodeConfig(beam=2, early_stop=False)
    settled = settle(ext, tokens, 2, [1], torch.tensor([False]), torch.tensor([False]), decode, nbest=1)
    assert [h.tokens for h in settled.ended[0]] == [[C]]  # room for one more only
    assert settled.done.tolist() == [True]  # k finished
    assert settled.next_tok.tolist() == [[B], [A]]


def test_settle_reads_each_output_from_its_sentences_start_and_never_files_an_impossible_end():
    """The continuous layout: rows hold pad before their sentence's bos. An eos candidate at -inf (forbidden
    by min_len, yet among the best of a tiny vocabulary) neither finishes nor counts as the best ending."""
    ext = Extensions(
        scores=torch.tensor([[float("-inf"), -1.0], [-0.5, -2.0]]),
        beam=torch.tensor([[0, 0], [0, 0]]),
        tokens=torch.tensor([[EOS_ID, A], [EOS_ID, B]]),
    )
    tokens = torch.tensor([[BOS_ID, A, A], [PAD_ID, BOS_ID, B]])
    starts, neither = torch.tensor([0, 1]), torch.tensor([False, False])
    settled = settle(ext, tokens, 1, [0, 0], neither, neither, DecodeConfig(beam=1), 1, starts)
    assert settled.ended[0] == [] and [h.tokens for h in settled.ended[1]] == [[B]]
    assert settled.top_ended.tolist() == [False, True] and settled.done.tolist() == [False, True]


def test_a_sentence_at_its_length_cap_is_done():
    ext, tokens = two_hypotheses_ranked()
    settled = settle(ext, tokens, 2, [0], torch.tensor([True]), torch.tensor([False]), DecodeConfig(beam=2), 2)
    assert settled.done.tolist() == [True]


def test_pad_and_bos_are_banned_and_nothing_else():
    lprobs = torch.zeros(2, VOCAB)
    ban_pad_and_bos(lprobs)
    assert torch.isinf(lprobs[:, [PAD_ID, BOS_ID]]).all()
    assert (lprobs[:, [t for t in range(VOCAB) if t not in (PAD_ID, BOS_ID)]] == 0).all()


def test_rows_of_groups_and_best_first():
    assert group_rows(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]
    hyps = [Hypothesis([A], -2.0, -2.0), Hypothesis([B], -1.0, -1.0), Hypothesis([C], -2.0, -3.0)]
    assert best_first(hyps, 2) == [hyps[1], hyps[0]] and best_first(hyps, 5) == [hyps[1], hyps[0], hyps[2]]
