"""The fused output projection + label-smoothed loss against PyTorch's own cross-entropy and the decoded model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_sources, tiny_model

from mtkit.data.parallel import collate
from mtkit.data.tokenizer import PAD_ID
from mtkit.interop.marian import NOT_A_TOKEN
from mtkit.model import loss as loss_module
from mtkit.model.loss import TrainingObjective, linear_cross_entropy


def reference(features, weight, target, eps, bias=None):
    """Summed smoothed loss and NLL the plain way: full logits, autograd through F.cross_entropy."""
    logits = F.linear(features, weight, bias)
    smoothed = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
    return smoothed, F.cross_entropy(logits, target, reduction="sum")


def inputs(rows: int, dim: int = 16, vocab: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, dim, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    return features, weight, target


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def a_bias(vocab: int = 50, seed: int = 1):
    """A large output bias, as an imported Marian model's final_logits_bias can be."""
    return (3.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))).requires_grad_(True)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_and_gradients_equal_cross_entropy_over_several_chunks(monkeypatch, eps, with_bias):
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 7)  # 30 rows: four full chunks and a short one
    features, weight, target = inputs(30)
    bias = a_bias() if with_bias else None
    leaves = (features, weight, bias) if with_bias else (features, weight)
    fused, fused_nll = linear_cross_entropy(features, weight, target, eps, bias=bias)
    plain, plain_nll = reference(features, weight, target, eps, bias)
    assert torch.allclose(fused, plain, rtol=1e-5)
    assert torch.allclose(fused_nll, plain_nll, rtol=1e-5)
    for mine, theirs in zip(grads(fused * 0.5, *leaves), grads(plain * 0.5, *leaves)):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_gradients_of_features_weights_and_bias_pass_gradcheck_in_float64(monkeypatch, eps):
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 3)  # 7 rows: two full chunks and a short one
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    target = torch.randint(0, 6, (7,), generator=gen)

    def loss(f, w, b):
        return linear_cross_entropy(f, w, target, eps, torch.float64, b)[0]

    assert torch.autograd.gradcheck(loss, (features, weight, bias))


def test_bf16_matmuls_stay_close_to_fp32():
    features, weight, target = inputs(40, dim=64, vocab=300)
    bias = a_bias(300)
    fused, _ = linear_cross_entropy(features, weight, target, 0.1, torch.bfloat16, bias)
    plain, _ = reference(features, weight, target, 0.1, bias)
    assert torch.allclose(fused, plain, rtol=1e-2)
    for mine, theirs in zip(grads(fused, features, weight, bias), grads(plain, features, weight, bias)):
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


def a_marian_like_model():
    """A tiny model with a large output bias whose pad entry is NOT_A_TOKEN, as an imported Marian model has."""
    model = tiny_model(vocab=40, output_bias=True)
    with torch.no_grad():
        model.output.bias.copy_(a_bias(40))
        model.output.bias[PAD_ID] = NOT_A_TOKEN
    return model


def a_batch():
    return collate(random_sources(6, 40, seed=3), random_sources(6, 40, seed=4))


def fields(batch):
    return batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_out


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_objective_is_the_loss_of_the_logits_the_model_decodes_with(eps):
    """Training and validation measure the model that translates: its output projection with the bias."""
    model, batch = a_marian_like_model(), a_batch()
    with torch.no_grad():
        loss, nll = TrainingObjective(model, eps, torch.float32)(*fields(batch))
        memory = model.encode(batch.src, batch.src_pad_mask)
        logits = model.decode(batch.tgt_in, memory, batch.src_pad_mask)
    keep = batch.tgt_out != PAD_ID
    decoded_nll = F.cross_entropy(logits[keep], batch.tgt_out[keep], reduction="sum")
    decoded_loss = F.cross_entropy(logits[keep], batch.tgt_out[keep], label_smoothing=eps, reduction="sum")
    assert torch.allclose(nll, decoded_nll, rtol=1e-5)
    assert torch.allclose(loss, decoded_loss, rtol=1e-5)


def test_every_parameter_the_logits_use_gets_autograds_gradient_the_bias_too():
    model, batch = a_marian_like_model(), a_batch()
    model.train()
    loss, _ = TrainingObjective(model, 0.1, torch.float32)(*fields(batch))
    mine = grads(loss, *model.parameters())
    keep = batch.tgt_out != PAD_ID
    logits = model(batch.src, batch.src_pad_mask, batch.tgt_in)
    plain = F.cross_entropy(logits[keep], batch.tgt_out[keep], label_smoothing=0.1, reduction="sum")
    theirs = grads(plain, *model.parameters())
    for (name, _), a, b in zip(model.named_parameters(), mine, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), name
    assert mine[[name for name, _ in model.named_parameters()].index("output.bias")].abs().sum() > 0
