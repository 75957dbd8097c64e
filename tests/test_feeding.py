"""How training feeds the device: batches made ahead by a thread, one read of the device per update, and batch
shapes from a small set for a compiled step. None of it may change what is trained on or what is learnt."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import multilingual_raw, small_config
from torch.overrides import TorchFunctionMode

from mtkit.config import from_dict
from mtkit.data.parallel import NO_BUCKETS, ShapeBuckets
from mtkit.data.tokenizer import PAD_ID
from mtkit.model import loss as loss_module
from mtkit.training.feeding import POLL_S, Feed, Group
from mtkit.training.reporting import TrainingReport
from mtkit.training.schedule import lr_at
from mtkit.training.trainer import Trainer


def train_recording(cfg, out: Path, monkeypatch) -> list[list[tuple[torch.Tensor, ...]]]:
    """Train ``cfg`` into ``out``; the tensors of each update's batches, in the order they were trained on."""
    seen, real_step = [], Trainer.train_step

    def recording(self, batches, tokens):
        seen.append([tuple(t.clone() for t in batch.tensors()) for batch in batches])
        return real_step(self, batches, tokens)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", recording)
        Trainer(cfg, out).run()
    return seen


def without_dropout(cfg):
    return replace(cfg, model=replace(cfg.model, dropout=0.0))


def train_lines(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == "train"]


def same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(s, t) for bx, by in zip(x, y) for s, t in zip(bx, by))
        for x, y in zip(a, b)
    )


def test_batches_and_losses_are_the_same_made_ahead_or_in_the_loop_across_epochs_and_a_resume(
    tmp_path, corpus_files, spm_model, monkeypatch
):
    def config(prefetch: int, steps: int):
        return small_config(corpus_files, spm_model, max_steps=steps, accum=2, prefetch=prefetch, save_every=5)

    in_loop = train_recording(config(0, 50), tmp_path / "in_loop", monkeypatch)
    ahead = train_recording(config(3, 23), tmp_path / "ahead", monkeypatch)  # stopped after update 23 ...
    ahead += train_recording(config(3, 50), tmp_path / "ahead", monkeypatch)  # ... and resumed from it
    assert same_batches(in_loop, ahead)
    straight, resumed = train_lines(tmp_path / "in_loop"), train_lines(tmp_path / "ahead")
    assert straight[-1]["epoch"] >= 3  # the walk crossed epoch boundaries
    assert [(a["step"], a["loss"], a["nll"], a["grad_norm"]) for a in straight] == [
        (b["step"], b["loss"], b["nll"], b["grad_norm"]) for b in resumed
    ]


def test_batches_of_several_corpora_are_the_same_made_ahead_or_in_the_loop(tmp_path, trilingual_files, monkeypatch):
    def config(prefetch: int):
        return from_dict(multilingual_raw(trilingual_files, train={"max_steps": 30, "prefetch": prefetch}))

    in_loop = train_recording(config(0), tmp_path / "a", monkeypatch)
    ahead = train_recording(config(2), tmp_path / "b", monkeypatch)
    assert len(in_loop) == 30 and same_batches(in_loop, ahead)
    assert [line["loss"] for line in train_lines(tmp_path / "a")] == [
        line["loss"] for line in train_lines(tmp_path / "b")
    ]


def test_the_update_is_the_textbook_one(tmp_path, corpus_files, spm_model, monkeypatch):
    """50 fp32 updates of the trainer against the plainest loop over the same batches: forward, backward of the
    loss over the group's tokens, clipping, Adam; every logged loss and gradient norm bit for bit."""
    cfg = small_config(corpus_files, spm_model, max_steps=50, accum=2, clip_norm=0.5)
    seen = train_recording(cfg, tmp_path / "trainer", monkeypatch)
    logged = train_lines(tmp_path / "trainer")
    monkeypatch.undo()
    reference = Trainer(cfg, tmp_path / "reference")  # the same seed: the same initial weights and dropout draws
    model, objective, optimizer = reference.model, reference.objective, reference.optimizer
    model.train()
    for step, (tensors, line) in enumerate(zip(seen, logged, strict=True), start=1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.train)
        tokens = sum(int((batch[3] != PAD_ID).sum()) for batch in tensors)
        loss_sum = nll_sum = 0.0
        for batch in tensors:
            loss, nll = objective(*batch)
            (loss / tokens).backward()
            loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm).item()
        optimizer.step()
        optimizer.zero_grad()
        assert (line["loss"], line["nll"], line["grad_norm"]) == (loss_sum / tokens, nll_sum / tokens, norm), step


class CountReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's values to the host: on a GPU each waits for the queued work."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__array__"}

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_an_update_reads_the_device_at_most_once(tmp_path, corpus_files, spm_model, monkeypatch):
    """100 updates logging every 100: at most 100 reads in the updates and their reports, the loss computed as
    on a GPU (where asking whether a row underflowed would be a read too)."""
    monkeypatch.setattr(loss_module, "reads_wait_for", lambda device: True)
    counter = CountReads()
    for cls, name in ((Trainer, "train_step"), (TrainingReport, "update"), (Feed, "next")):
        real = getattr(cls, name)

        def counted(*args, real=real, **kwargs):
            with counter:
                return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    cfg = small_config(corpus_files, spm_model, max_steps=100, log_every=100, save_every=0, accum=2)
    Trainer(cfg, tmp_path).run()
    assert len(train_lines(tmp_path)) == 1
    assert 0 < counter.reads <= 100


def test_the_loss_computed_without_reads_equals_the_one_with():
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2500, 32, generator=gen) * 4  # some gold probabilities underflow
    weight = torch.randn(300, 32, generator=gen)
    bias = torch.randn(300, generator=gen)
    target = torch.randint(0, 300, (2500,), generator=gen)
    gold = torch.log_softmax(features @ weight.T + bias, dim=-1).gather(1, target[:, None])
    assert (gold.exp() < loss_module.TINY_PROBABILITY).any()  # the rows the CPU path recomputes are there
    results = []
    for reads_wait in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loss_module, "reads_wait_for", lambda device, wait=reads_wait: wait)
            h, w, b = (t.clone().requires_grad_() for t in (features, weight, bias))
            loss, nll = loss_module.linear_cross_entropy(h, w, target, 0.1, bias=b)
            loss.backward()
            results.append([loss.detach(), nll, h.grad, w.grad, b.grad])
    (loss_a, nll_a, *grads_a), (loss_b, nll_b, *grads_b) = results
    torch.testing.assert_close(torch.stack([loss_b, nll_b]), torch.stack([loss_a, nll_a]), rtol=1e-6, atol=0)
    for with_reads, without in zip(grads_a, grads_b):  # logits of 20 and more: softmax rounding differs a little
        torch.testing.assert_close(without, with_reads, rtol=1e-4, atol=1e-4 * with_reads.abs().max().item())


def test_padded_shapes_come_from_the_stated_set_and_leave_the_loss_as_it_was(tmp_path, corpus_files, spm_model):
    cfg = without_dropout(small_config(corpus_files, spm_model, max_steps=1))
    trainer = Trainer(cfg, tmp_path)
    trainer.model.eval()
    budget, multiple = cfg.train.batch_tokens, 8
    buckets = ShapeBuckets(multiple, budget)
    batches = trainer.corpus.batch_indices(budget, seed=3, multiple=multiple)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(trainer.corpus)))  # every pair, once
    shapes = set()
    for indices in batches:
        plain, padded = trainer.corpus.collate(indices, NO_BUCKETS), trainer.corpus.collate(indices, buckets)
        rows, src_width = padded.src.shape
        tgt_width = padded.tgt_in.size(1)
        assert src_width % multiple == 0 and tgt_width % multiple == 0
        assert src_width - plain.src.size(1) < multiple and tgt_width - plain.tgt_in.size(1) < multiple
        assert rows == max(len(indices), budget // max(src_width, tgt_width))
        assert rows * max(src_width, tgt_width) <= budget or len(indices) == 1
        assert padded.target_tokens == plain.target_tokens == len(padded.target_index)
        with torch.no_grad():
            expected = torch.stack(trainer.objective(*plain.tensors())).double()
            got = torch.stack(trainer.objective(*padded.tensors())).double()
            by_mask = torch.stack(trainer.objective(*padded.tensors()[:4])).double()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        assert torch.equal(got, by_mask)  # target_index picks the positions the padding mask leaves
        shapes.add((rows, src_width, tgt_width))
    longest = int(max(trainer.corpus.src_lengths.max(), trainer.corpus.tgt_lengths.max())) + 1
    assert len(shapes) <= (-(-longest // multiple)) ** 2
    near_the_end = ShapeBuckets(8, budget, max_width=20)  # a model of 20 positions
    assert [near_the_end.width(n) for n in (13, 17, 20)] == [16, 20, 20]  # rounded, but not past its positions


def test_a_walk_error_reaches_the_training_thread_and_a_closed_feed_stops_walking():
    def walk():
        yield Group([], 0, 2, 0)
        raise ValueError("bad batch")

    feed = Feed(walk(), depth=2)
    assert feed.next().epoch == 2
    with pytest.raises(ValueError, match="bad batch"):
        feed.next()
    feed.close()

    made = []

    def endless():
        while True:
            made.append(len(made))
            yield Group([], 0, len(made), 0)

    feed = Feed(endless(), depth=3)
    assert [feed.next().epoch for _ in range(5)] == [1, 2, 3, 4, 5]
    thread = feed._thread
    feed.close()
    count = len(made)
    assert count <= 5 + 3 + 1  # taken, queued, and one in the making
    assert not thread.is_alive()
    time.sleep(3 * POLL_S)
    assert len(made) == count  # nothing walks after close


@pytest.mark.slow  # about a minute on 2 cores: five shapes compiled
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_step_compiles_once_per_shape_and_learns_as_the_eager_one(tmp_path, corpus_files, spm_model):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    losses = {}
    for compiled in (False, True):
        cfg = small_config(corpus_files, spm_model, max_steps=100, compile=compiled, pad_to_multiple=32, save_every=0)
        counters.clear()
        trainer = Trainer(without_dropout(cfg), tmp_path / str(compiled))
        assert (trainer.objective._features != trainer.model.features) == compiled
        shapes, real_step = set(), trainer.train_step

        def recording(batches, tokens, shapes=shapes, real_step=real_step):
            shapes.update((b.src.shape, b.tgt_in.shape) for b in batches)
            return real_step(batches, tokens)

        trainer.train_step = recording
        trainer.run()
        losses[compiled] = [line["loss"] for line in train_lines(tmp_path / str(compiled))]
        if compiled:
            assert counters["stats"]["unique_graphs"] == len(shapes) > 1  # each shape compiled once
    assert len(losses[True]) == 100
    np.testing.assert_allclose(losses[True], losses[False], rtol=0, atol=1e-3)
    torch._dynamo.reset()
