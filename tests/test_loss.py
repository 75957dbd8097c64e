"""The fused output projection + label-smoothed loss against PyTorch's own cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtkit.model import loss as loss_module
from mtkit.model.loss import linear_cross_entropy


def reference(features, weight, target, eps):
    """Summed smoothed loss and NLL the plain way: full logits, autograd through F.cross_entropy."""
    logits = features @ weight.t()
    smoothed = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
    return smoothed, F.cross_entropy(logits, target, reduction="sum")


def inputs(rows: int, dim: int = 16, vocab: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, dim, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    return features, weight, target


def grads(loss, features, weight):
    return torch.autograd.grad(loss, (features, weight))


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_and_gradients_equal_cross_entropy_over_several_chunks(monkeypatch, eps):
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 7)  # 30 rows: four full chunks and a short one
    features, weight, target = inputs(30)
    fused, fused_nll = linear_cross_entropy(features, weight, target, eps)
    plain, plain_nll = reference(features, weight, target, eps)
    assert torch.allclose(fused, plain, rtol=1e-5)
    assert torch.allclose(fused_nll, plain_nll, rtol=1e-5)
    for mine, theirs in zip(grads(fused * 0.5, features, weight), grads(plain * 0.5, features, weight)):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)


def test_bf16_matmuls_stay_close_to_fp32():
    features, weight, target = inputs(40, dim=64, vocab=300)
    fused, _ = linear_cross_entropy(features, weight, target, 0.1, torch.bfloat16)
    plain, _ = reference(features, weight, target, 0.1)
    assert torch.allclose(fused, plain, rtol=1e-2)
    for mine, theirs in zip(grads(fused, features, weight), grads(plain, features, weight)):
        assert (mine - theirs).norm() < 0.02 * theirs.norm()


def test_a_gold_token_far_below_the_rest_keeps_an_exact_loss():
    """Its softmax probability underflows fp32 (e^-200), so the NLL cannot come from -log p."""
    features, weight, target = inputs(3)
    weight = weight.detach().clone()
    row = features[1].detach()
    weight[target[1]] = -200.0 * row / row.norm() ** 2  # its logit in row 1 is -200
    weight.requires_grad_(True)
    fused, fused_nll = linear_cross_entropy(features, weight, target, 0.1)
    plain, plain_nll = reference(features, weight, target, 0.1)
    assert torch.isfinite(fused_nll) and fused_nll > 200
    assert torch.allclose(fused_nll, plain_nll, rtol=1e-5)
    assert torch.allclose(fused, plain, rtol=1e-5)


def test_without_gradients_the_loss_is_the_same():
    features, weight, target = inputs(12)
    with torch.no_grad():
        frozen, frozen_nll = linear_cross_entropy(features, weight, target, 0.1)
    live, live_nll = linear_cross_entropy(features, weight, target, 0.1)
    assert torch.equal(frozen, live.detach()) and torch.equal(frozen_nll, live_nll)
