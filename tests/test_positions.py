"""Attention variants: rotary and relative positions, and windowed (local) self-attention.

The properties that would catch a real bug: scores that depend on where tokens stand rather than on
their distance, a window that lets a far token leak in, a long-input path that differs from the
short one, and cached decoding that sees other distances than full decoding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import invoke, tiny_model_config, write_config

from mtkit.model.attention import DecoderCache, MultiHeadAttention
from mtkit.model.positions import RelativePositions, Rotary
from mtkit.model.transformer import build_model

VARIANTS = ["sinusoidal", "learned", "relative", "rotary"]


def variant_model(positions: str, window: int = 0, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_model_config(
        encoder_layers=layers, decoder_layers=layers, positions=positions, attention_window=window, relative_clip=4
    )
    return build_model(cfg, 40, 40, 0).eval()


def batch(seed: int = 1, src_len: int = 21, tgt_len: int = 13):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (3, src_len), generator=generator)
    tgt = torch.randint(4, 40, (3, tgt_len), generator=generator)
    pad = torch.zeros_like(src, dtype=torch.bool)
    pad[0, src_len - 6 :] = True  # one padded sentence
    return src, pad, tgt


def test_rotary_scores_depend_on_the_distance_only():
    rotary = Rotary(d_head=8, max_positions=128)
    q, k = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    scores = rotary(q, 0) @ rotary(k, 0).transpose(-2, -1)
    shifted = rotary(q, 57) @ rotary(k, 57).transpose(-2, -1)
    torch.testing.assert_close(shifted, scores, atol=1e-5, rtol=1e-5)
    keys_moved = rotary(q, 0) @ rotary(k, 3).transpose(-2, -1)  # other distances: other scores
    assert (keys_moved - scores).abs().max() > 1e-2


def test_relative_attention_depends_on_the_distance_only():
    torch.manual_seed(0)
    attention = MultiHeadAttention(32, 4, 0.0, relative=RelativePositions(8, clip=4)).eval()
    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
    at_zero = attention.attend(q, k, v, None, causal=True)
    shifted = attention.attend(q, k, v, None, causal=True, q_start=100, k_start=100)
    torch.testing.assert_close(shifted, at_zero, atol=0, rtol=0)
    keys_moved = attention.attend(q, k, v, None, causal=False, q_start=0, k_start=2)
    assert (keys_moved - attention.attend(q, k, v, None, causal=False)).abs().max() > 1e-3


@pytest.mark.parametrize("positions", VARIANTS)
def test_a_window_as_long_as_the_input_changes_nothing(positions):
    src, pad, tgt = batch()
    full, windowed = variant_model(positions), variant_model(positions, window=src.size(1))
    windowed.load_state_dict(full.state_dict())
    with torch.no_grad():
        expected = full.decode(tgt, full.encode(src, pad), pad)
        found = windowed.decode(tgt, windowed.encode(src, pad), pad)
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", VARIANTS)
@pytest.mark.parametrize("window, src_len", [(2, 13), (3, 40)], ids=["banded-mask", "blockwise"])
def test_a_token_farther_than_window_times_layers_changes_nothing(positions, window, src_len):
    """Each layer widens what a position sees by ``window``: two layers, 2 * window."""
    model = variant_model(positions, window=window)
    src, pad, tgt = batch(src_len=src_len, tgt_len=src_len)
    pad[:] = False
    reach = window * 2
    changed_src, changed_tgt = src.clone(), tgt.clone()
    changed_src[:, 0] = 4 if src[0, 0] != 4 else 5
    changed_tgt[:, 0] = 4 if tgt[0, 0] != 4 else 5
    with torch.no_grad():
        memory, other_memory = model.encode(src, pad), model.encode(changed_src, pad)
        decoded = model.decoder(tgt, memory, pad)
        other_decoded = model.decoder(changed_tgt, memory, pad)  # the decoder alone: same memory
    differs = (memory - other_memory).abs().amax(dim=(0, 2))
    assert differs[reach + 1 :].max() == 0 and differs[reach] > 0
    differs = (decoded - other_decoded).abs().amax(dim=(0, 2))
    assert differs[reach + 1 :].max() == 0 and differs[reach] > 0


@pytest.mark.parametrize("positions", VARIANTS)
@pytest.mark.parametrize("window", [0, 3])
def test_cached_decoding_equals_full_decoding(positions, window):
    model = variant_model(positions, window=window)
    src, pad, tgt = batch()
    with torch.no_grad():
        memory = model.encode(src, pad)
        full = model.decode(tgt, memory, pad)
        cache = DecoderCache()
        steps = [model.decode(tgt[:, t : t + 1], memory, pad, cache) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_local_attention_equals_the_banded_mask(relative, causal):
    """Long inputs take the block-wise path (memory N * window); it must compute what the mask computes."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(32, 4, 0.0, relative=RelativePositions(8, 4) if relative else None, window=5)
    q, k, v = (torch.randn(2, 4, 37, 8) for _ in range(3))  # 37: the last block is partly padding
    allowed = torch.ones(2, 1, 1, 37, dtype=torch.bool)
    allowed[1, ..., 30:] = False
    blockwise = attention.attend(q, k, v, allowed, causal)
    mask, index = attention._layout(allowed, causal, 37, 37, 0, 0, q.device)
    banded = attention._mix(q, k, v, mask, index, 0.0)
    expected = attention.out_proj(banded.transpose(1, 2).reshape(2, 37, 32))
    real = allowed[:, 0, 0, :]  # a padding query sees no key; what it gets is never used
    torch.testing.assert_close(blockwise[real], expected[real])


@pytest.mark.parametrize("positions, window", [("relative", 2), ("rotary", 0)])
def test_variants_train_and_translate_through_the_cli(tmp_path, corpus_files, positions, window):
    model = {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "heads": 2, "ffn": 64}
    model.update(positions=positions, attention_window=window)
    config = write_config(tmp_path / "c.yaml", corpus_files, model=model, train={"max_steps": 4, "valid_every": 2})
    assert invoke("train", config, "--out", tmp_path / "run").exit_code == 0
    result = invoke(
        "translate", tmp_path / "run", "--beam", 2, "--device", "cpu", input="A dog runs.\n\nTwo men sit.\n"
    )
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split("\n")) == 4


def test_a_window_keeps_long_input_memory_linear():
    """benchmarks/attention_memory.py: relative attention over 2,048 tokens stores N^2 weights, a window N * W."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_memory.py"
    command = [sys.executable, script, "--lengths", "2048", "--windows", "0", "32", "--positions", "relative"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    peak = {
        int(fields["window"]): float(fields["peak_mib"])
        for line in out.splitlines()
        if line.startswith("attention_memory ")
        for fields in [dict(item.split("=") for item in line.split()[1:])]
    }
    # full: 3 layers x 4 heads x 2048^2 fp32 scores, softmax and gathered relative term, over 150 MiB
    assert peak[32] < peak[0] / 3, peak
