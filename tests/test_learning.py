"""A tiny Transformer must actually learn: reversing random sequences to >= 95% exact match."""

from __future__ import annotations

import torch
from conftest import tiny_model

from mtkit.data import collate, source_tensor
from mtkit.loss import linear_cross_entropy
from mtkit.search import beam_search, greedy_search
from mtkit.tokenizer import PAD_ID
from mtkit.train import lr_at

VOCAB = 16  # 4 special ids + 12 symbols


def sequences(n: int, generator: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(2, 8, (n,), generator=generator).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def test_tiny_transformer_learns_to_reverse():
    g = torch.Generator().manual_seed(0)
    model = tiny_model(VOCAB, seed=0, d_model=64, ffn=128).train()
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.9, 0.98), eps=1e-9)
    for step in range(1, 601):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, 3e-3, 100)
        src = sequences(64, g)
        batch = collate(src, [s[::-1] for s in src])
        features = model.features(batch.src, batch.src_pad_mask, batch.tgt_in)
        keep = batch.tgt_out != PAD_ID
        loss, _ = linear_cross_entropy(features[keep], model.output.weight, batch.tgt_out[keep], 0.0)
        (loss / keep.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.eval()
    test = sequences(200, torch.Generator().manual_seed(123))
    src, mask = source_tensor(test)
    expected = [s[::-1] for s in test]
    greedy = greedy_search(model, src, mask)
    beam = [h[0].tokens for h in beam_search(model, src, mask, beam=4)]
    assert sum(g == e for g, e in zip(greedy, expected)) / len(test) >= 0.95
    assert sum(b == e for b, e in zip(beam, expected)) / len(test) >= 0.95
