"""A tiny Transformer must actually learn: reversing random sequences to >= 95% exact match; and int8 keeps it.

The margin is sized on seeds: training is chaotic, so a CPU whose kernels round differently ends where another
seed would. 1,000 updates clear the bar on every seed tried, with room to spare; 600 did not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model, train_on_task

from mtkit.config import DecodeConfig
from mtkit.data.parallel import source_tensor
from mtkit.decoding.search import beam_search, greedy_search
from mtkit.model.quantization import quantize_int8

VOCAB = 16  # 4 special ids + 12 symbols


def sequences(n: int, generator: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(2, 8, (n,), generator=generator).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=generator).tolist() for length in lengths]


@pytest.fixture(scope="module")
def reverser():
    """A tiny model trained to reverse sequences, and test sequences it has not seen."""
    g = torch.Generator().manual_seed(0)

    def reversal():
        src = sequences(64, g)
        return src, [s[::-1] for s in src]

    model = train_on_task(tiny_model(VOCAB, seed=0, d_model=64, ffn=128), reversal, 1000, 3e-3, 100)
    return model, sequences(200, torch.Generator().manual_seed(123))


def exact_matches(outputs: list[list[int]], test: list[list[int]]) -> float:
    return sum(o == s[::-1] for o, s in zip(outputs, test)) / len(test)


def test_tiny_transformer_learns_to_reverse(reverser):
    model, test = reverser
    src, mask = source_tensor(test)
    greedy = greedy_search(model, src, mask)
    beam = [h[0].tokens for h in beam_search(model, src, mask, DecodeConfig(beam=4))]
    assert exact_matches(greedy, test) >= 0.95
    assert exact_matches(beam, test) >= 0.95


@pytest.mark.parametrize("kernel", ["dot", "pairs"])
def test_int8_keeps_what_it_learned(reverser, kernel):
    """``--precision int8``'s model against fp32's, with either kernel (the pairs kernel's weights have 7 bits):
    exact matches drop by at most 2 points (the tolerance), at least 95% of outputs are fp32's, and their
    log-probabilities differ by under 0.05 per sentence on average."""
    model, test = reverser
    src, mask = source_tensor(test)
    fp32_greedy = greedy_search(model, src, mask)
    fp32_beam = beam_search(model, src, mask, DecodeConfig(beam=4))
    quantized = quantize_int8(copy.deepcopy(model), kernel)
    int8_greedy = greedy_search(quantized, src, mask)
    int8_beam = beam_search(quantized, src, mask, DecodeConfig(beam=4))
    assert exact_matches(int8_greedy, test) >= exact_matches(fp32_greedy, test) - 0.02
    assert sum(a == b for a, b in zip(int8_greedy, fp32_greedy)) >= 0.95 * len(test)
    fp32_tokens, int8_tokens = ([h[0].tokens for h in beam] for beam in (fp32_beam, int8_beam))
    assert exact_matches(int8_tokens, test) >= exact_matches(fp32_tokens, test) - 0.02
    same = [i for i, (a, b) in enumerate(zip(fp32_tokens, int8_tokens)) if a == b]
    assert len(same) >= 0.95 * len(test)
    drift = sum(abs(fp32_beam[i][0].logprob - int8_beam[i][0].logprob) for i in same) / len(same)
    assert 0 < drift < 0.05, drift  # quantized, and close
