"""What only a CUDA device can check: GPU kernels agree with the CPU, and mixed precision trains.

Skipped without a GPU (CI has none); benchmarks/gpu_check.sh runs them on a lent one.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import replace

import pytest
import torch
from helpers import small_config, tiny_model

from mtkit.config import DecodeConfig
from mtkit.data.parallel import source_tensor
from mtkit.decoding.search import beam_search, row_topk
from mtkit.model.attention import dropout
from mtkit.model.loss import linear_cross_entropy
from mtkit.training.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """TF32 would make GPU fp32 differ from the CPU by more than rounding."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def sources(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=gen).tolist()
    return [torch.randint(4, vocab, (length,), generator=gen).tolist() for length in lengths]


def test_beam_search_on_the_gpu_equals_the_cpu():
    model = tiny_model(60, seed=5)
    with torch.no_grad():
        model.output.weight.mul_(3.0)  # sharper choices: no near-ties for rounding to flip
    src, mask = source_tensor(sources(16, 60))
    on_cpu = beam_search(model, src, mask, DecodeConfig(beam=5), nbest=2)
    on_gpu = beam_search(copy.deepcopy(model).to(GPU), src.to(GPU), mask.to(GPU), DecodeConfig(beam=5), nbest=2)
    for cpu_hyps, gpu_hyps in zip(on_cpu, on_gpu):
        assert [h.tokens for h in cpu_hyps] == [h.tokens for h in gpu_hyps]
        for a, b in zip(cpu_hyps, gpu_hyps):
            assert abs(a.score - b.score) < 1e-4


def test_fused_loss_and_its_gradients_on_the_gpu_equal_the_cpu():
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(3000, 64, generator=gen)  # several chunks
    weight = torch.randn(500, 64, generator=gen)
    target = torch.randint(0, 500, (3000,), generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        # copies: on the CPU .to() returns the tensor itself, which must stay a plain leaf
        h = features.to(device, copy=True).requires_grad_()
        w = weight.to(device, copy=True).requires_grad_()
        loss, nll = linear_cross_entropy(h, w, target.to(device), 0.1)
        loss.backward()
        results.append([t.detach().cpu() for t in (loss, nll, h.grad, w.grad)])
    for cpu, gpu in zip(*results):
        torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-5)


def test_dropout_and_row_topk_on_the_gpu():
    x = torch.ones(1000, 1000, device=GPU)
    kept = (dropout(x, 0.1, training=True) != 0).float().mean().item()
    assert abs(kept - 0.9) < 0.005
    scores = torch.randn(64, 8000, device=GPU)
    values, index = row_topk(scores, 10)
    assert torch.equal(values, scores.topk(10, dim=1).values)
    assert torch.equal(scores.gather(1, index), values)


def losses_of_training(tmp_path, corpus_files, spm_model, precision: str, rounds: int = 8) -> list[float]:
    """Per-update losses of ``rounds`` passes over the same 4 batches on the GPU (same seed, same order)."""
    cfg = small_config(corpus_files, spm_model, device="cuda", precision=precision)
    trainer = Trainer(cfg, tmp_path / precision)
    assert next(trainer.model.parameters()).is_cuda
    batches = trainer.corpus.batches(cfg.train.batch_tokens, seed=0)[:4]
    losses = []
    for _ in range(rounds):
        for batch in batches:
            stats = trainer.train_step([batch], batch.target_tokens)
            assert stats["skipped"] in (None, "overflow")  # fp16 may skip while its loss scale settles
            losses.append(stats["loss"])
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_on_the_gpu_follows_fp32(tmp_path, corpus_files, spm_model, precision):
    """bf16 (autocast) and fp16 (autocast + loss scaling) lower the loss as fp32 does, update for update."""
    reference = losses_of_training(tmp_path, corpus_files, spm_model, "fp32")
    mixed = losses_of_training(tmp_path, corpus_files, spm_model, precision)
    learned = sum(reference[:4]) / 4 - sum(reference[-4:]) / 4
    assert learned > 0.3
    assert abs(sum(mixed[-4:]) / 4 - sum(reference[-4:]) / 4) < 0.1 * learned


def test_batches_made_ahead_reach_the_gpu_from_pinned_memory_and_train_as_those_made_in_the_loop(
    tmp_path, corpus_files, spm_model
):
    losses = {}
    for prefetch in (0, 2):
        cfg = small_config(corpus_files, spm_model, device="cuda", max_steps=12, prefetch=prefetch)
        trainer = Trainer(replace(cfg, model=replace(cfg.model, dropout=0.0)), tmp_path / str(prefetch))
        pinned, real_step = [], trainer.train_step

        def step(batches, tokens, pinned=pinned, real_step=real_step):
            pinned.extend(t.is_pinned() for batch in batches for t in batch.tensors())
            return real_step(batches, tokens)

        trainer.train_step = step
        trainer.run()
        assert pinned and all(pinned)
        lines = [json.loads(line) for line in (tmp_path / str(prefetch) / "metrics.jsonl").read_text().splitlines()]
        losses[prefetch] = [line["loss"] for line in lines if line["event"] == "train"]
    assert len(losses[2]) == 12
    assert losses[2] == pytest.approx(losses[0], rel=1e-4)  # attention's backward may sum in another order


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_training_update_on_the_gpu_waits_for_it_once(tmp_path, corpus_files, spm_model, precision):
    """The update's one read (losses and gradient norm together) is its only synchronisation with the host:
    batch copies, the loss's target positions, clipping and Adam are queued without waiting."""
    cfg = small_config(corpus_files, spm_model, device="cuda", precision=precision, accum=2)
    trainer = Trainer(cfg, tmp_path)
    groups = trainer.update_groups()
    for _ in range(2):  # warm-up: lazily made state (loss scale, Adam's moments) is made once
        group = next(groups)
        trainer.train_step(group.batches, group.tokens)
    group = next(groups)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = trainer.train_step(group.batches, group.tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.cleanup()
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert stats["skipped"] in (None, "overflow")
    assert len(syncs) == 1, [str(w.message) for w in syncs]
