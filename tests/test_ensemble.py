"""Ensembles: the search sees the members' averaged log-probabilities, cache and all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_sources, tiny_model

from mtkit.config import DecodeConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.search import beam_search, greedy_search


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_an_ensemble_of_copies_decodes_like_the_model(int8):
    model = tiny_model(30, seed=7, int8=int8)
    src, mask = source_tensor(random_sources(6, 30, seed=4))
    alone = beam_search(model, src, mask, DecodeConfig(beam=3), nbest=2)
    for members in ([model], [model, model]):
        together = beam_search(Ensemble(members), src, mask, DecodeConfig(beam=3), nbest=2)
        assert [[h.tokens for h in s] for s in together] == [[h.tokens for h in s] for s in alone]
        for s, t in zip(alone, together):
            # The same log-probabilities reach the search by another route (a mean of copies, a renormalisation),
            # which may round differently in the last bits of each step: 1e-5 is a thousand times that, summed
            # over the steps, and a hundred times below any real difference in a hypothesis's score.
            assert [h.score for h in t] == pytest.approx([h.score for h in s], abs=1e-5)


def reference_greedy(members, source: list[int], max_len: int) -> list[int]:
    """Uncached greedy decoding on the renormalised mean of the members' log-probabilities."""
    src, mask = source_tensor([source])
    memories = [m.encode(src, mask) for m in members]
    out = [BOS_ID]
    with torch.no_grad():
        for step in range(max_len):
            tgt = torch.tensor([out])
            mean = torch.stack(
                [F.log_softmax(m.decode(tgt, mem, mask)[0, -1], dim=-1) for m, mem in zip(members, memories)]
            ).mean(dim=0)
            mean[PAD_ID] = mean[BOS_ID] = float("-inf")
            token = EOS_ID if step == max_len - 1 else int(mean.argmax())
            out.append(token)
            if token == EOS_ID:
                break
    return [t for t in out[1:] if t != EOS_ID]


def test_an_ensemble_of_different_models_follows_their_mean_log_probabilities():
    members = [tiny_model(30, seed=8), tiny_model(30, seed=9, d_model=48, heads=4, encoder_layers=1)]
    sources = random_sources(5, 30, seed=5)
    src, mask = source_tensor(sources)
    ensemble = Ensemble(members)
    cached = greedy_search(ensemble, src, mask, DecodeConfig(max_len_a=0, max_len_b=6))
    assert cached == [reference_greedy(members, s, 6) for s in sources]
    bos = torch.full((len(sources), 1), BOS_ID)
    mixed = ensemble.decode(bos, ensemble.encode(src, mask), mask)
    first, second = (F.log_softmax(m.decode(bos, m.encode(src, mask), mask), dim=-1) for m in members)
    assert torch.allclose(mixed, (first + second) / 2, atol=1e-5)
    assert not torch.allclose(mixed, first, atol=1e-2)  # the second model counts
    batched = beam_search(ensemble, src, mask, DecodeConfig(beam=4))
    for sentence, hyps in zip(sources, batched):  # reordering the shared cache follows every member
        assert hyps[0].tokens == beam_search(ensemble, *source_tensor([sentence]), DecodeConfig(beam=4))[0][0].tokens
