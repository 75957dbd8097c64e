"""Properties of the Transformer that a real bug would break."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model

from mtkit import runtime
from mtkit.config import from_dict
from mtkit.data.tokenizer import PAD_ID
from mtkit.model import linear
from mtkit.model.attention import DecoderCache, MultiHeadAttention, _explicit_attention, dropout
from mtkit.model.positions import RelativePositions
from mtkit.model.transformer import build_model, count_parameters

VOCAB = 40


def random_batch(batch: int, src_len: int, tgt_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (batch, src_len), generator=g)
    tgt = torch.randint(4, VOCAB, (batch, tgt_len), generator=g)
    return src, src == PAD_ID, tgt


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_is_causal(norm):
    """Changing target tokens after position t changes no output at positions <= t."""
    model = tiny_model(VOCAB, norm=norm)
    src, mask, tgt = random_batch(3, 7, 9)
    t = 4
    changed = tgt.clone()
    changed[:, t + 1 :] = torch.randint(4, VOCAB, changed[:, t + 1 :].shape)
    out, out_changed = model(src, mask, tgt), model(src, mask, changed)
    torch.testing.assert_close(out[:, : t + 1], out_changed[:, : t + 1])
    assert not torch.allclose(out[:, t + 1 :], out_changed[:, t + 1 :])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_changes_no_real_output(norm):
    """A sentence decoded alone equals the same sentence padded inside a batch (source and target)."""
    model = tiny_model(VOCAB, norm=norm)
    src, _, tgt = random_batch(1, 5, 6)
    long_src, _, long_tgt = random_batch(1, 9, 11, seed=2)
    alone = model(src, src == PAD_ID, tgt)

    pad_src = torch.full((2, 9), PAD_ID)
    pad_src[0, :5], pad_src[1] = src[0], long_src[0]
    pad_tgt = torch.full((2, 11), PAD_ID)
    pad_tgt[0, :6], pad_tgt[1] = tgt[0], long_tgt[0]
    batched = model(pad_src, pad_src == PAD_ID, pad_tgt)
    torch.testing.assert_close(batched[0, :6], alone[0], atol=1e-5, rtol=1e-5)


def test_source_padding_is_masked_not_just_ignored():
    """Without the mask the padded keys would change the output: the test above has teeth."""
    model = tiny_model(VOCAB)
    src, _, tgt = random_batch(1, 5, 6)
    padded = torch.cat([src, torch.full((1, 4), PAD_ID)], dim=1)
    unmasked = torch.zeros_like(padded, dtype=torch.bool)
    assert not torch.allclose(model(padded, unmasked, tgt), model(src, src == PAD_ID, tgt), atol=1e-4)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_cached_decoding_matches_full_decoding(norm):
    """Feeding one token at a time through the KV cache gives the full-sequence log-probabilities."""
    model = tiny_model(VOCAB, norm=norm)
    src, _, tgt = random_batch(2, 6, 8)
    src[1, 4:] = PAD_ID
    mask = src == PAD_ID
    full = F.log_softmax(model(src, mask, tgt), dim=-1)
    memory = model.encode(src, mask)
    cache = DecoderCache()
    steps = [F.log_softmax(model.decode(tgt[:, i : i + 1], memory, mask, cache), dim=-1) for i in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_decoding_between_fused_optimizer_updates_uses_the_updated_weights(vendor, dtype, monkeypatch):
    """Training steps its parameters with fused Adam, which changes them in place without counting the change, and
    validates between updates by cached decoding through derived weights (the joined query, key and value
    projections; packed products on CPUs not made by Intel). Each validation must decode with the weights of its
    update, as the full forward pass computes them: a stale copy once held validation BLEU at the first
    validation's weights."""
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", 0)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2 alone
        monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset())
    model = tiny_model(VOCAB).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    src, mask, tgt = random_batch(2, 6, 5)
    for _ in range(3):
        model.eval()
        with torch.no_grad():
            full = model(src, mask, tgt)
            memory, cache = model.encode(src, mask), DecoderCache()
            steps = [model.decode(tgt[:, i : i + 1], memory, mask, cache) for i in range(tgt.size(1))]
        tolerance = {"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(torch.cat(steps, dim=1), full, **tolerance)
        model.train()
        model(src, mask, tgt).float().logsumexp(dim=-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_cache_select_follows_reordered_rows():
    model = tiny_model(VOCAB)
    src, mask, tgt = random_batch(3, 5, 4)
    memory = model.encode(src, mask)
    cache = DecoderCache()
    for i in range(3):
        model.decode(tgt[:, i : i + 1], memory, mask, cache)
    order = torch.tensor([2, 0])
    cache.select(order, cross_index=order)  # other sentences: their cross-attention keys move too
    step = model.decode(tgt[order, 3:4], memory[order], mask[order], cache)
    torch.testing.assert_close(step[:, 0], model(src[order], mask[order], tgt[order])[:, 3], atol=1e-5, rtol=1e-5)


def test_beams_share_one_memory_row_per_sentence():
    """Cached decoding of k rows per sentence against one memory row each equals a repeated memory."""
    model = tiny_model(VOCAB)
    src, _, _ = random_batch(3, 6, 1)
    src[1, 4:] = PAD_ID
    mask = src == PAD_ID
    k = 4
    beams = torch.randint(4, VOCAB, (3 * k, 5), generator=torch.Generator().manual_seed(2))
    memory = model.encode(src, mask)
    shared, repeated = DecoderCache(), DecoderCache()
    for i in range(beams.size(1)):
        one_row = model.decode(beams[:, i : i + 1], memory, mask, shared)
        k_rows = model.decode(
            beams[:, i : i + 1], memory.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), repeated
        )
        torch.testing.assert_close(one_row, k_rows, atol=1e-5, rtol=1e-5)


def reference_attention(attn: MultiHeadAttention, query, key_value, allowed):
    """Plain multi-head attention from the paper, scaled by 1/sqrt(d_head)."""
    h, dh = attn.heads, attn.d_head
    q = attn.q_proj(query).view(*query.shape[:2], h, dh).transpose(1, 2)
    k = attn.k_proj(key_value).view(*key_value.shape[:2], h, dh).transpose(1, 2)
    v = attn.v_proj(key_value).view(*key_value.shape[:2], h, dh).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return attn.out_proj(out.transpose(1, 2).reshape(*query.shape[:2], h * dh))


def attention_case():
    """A seeded 4-head attention with queries, keys/values, and a mask hiding the second row's last two keys."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, dropout=0.0).eval()
    query, key_value = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    allowed = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    allowed[1, ..., 5:] = False
    return attn, query, key_value, allowed


def test_attention_matches_plain_computation():
    attn, query, key_value, allowed = attention_case()
    torch.testing.assert_close(attn(query, key_value, allowed), reference_attention(attn, query, key_value, allowed))


def test_explicit_attention_path_matches_sdpa():
    """The path used for bf16 on CPU computes what SDPA computes (checked here in fp32)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    allowed = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    allowed[0, ..., 4:] = False
    for causal, mask in ((False, allowed), (True, None)):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        torch.testing.assert_close(_explicit_attention(q, k, v, mask, causal, 0.0), expected, atol=1e-5, rtol=1e-5)


def test_joint_qkv_is_the_three_projections_after_their_weights_change():
    """A decoding step's one product for q, k and v keeps up with the weights: changed in place (an optimizer step
    between validations), replaced, cast."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 0.0)
    x = torch.randn(3, 2, 16)

    def separate() -> torch.Tensor:
        return torch.cat([p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)

    with torch.no_grad():
        torch.testing.assert_close(attn.joint_qkv()(x), separate())
        assert attn.joint_qkv() is attn.joint_qkv()  # made once
        attn.k_proj.weight.mul_(2.0)
        torch.testing.assert_close(attn.joint_qkv()(x), separate())
        attn.v_proj.bias = torch.nn.Parameter(torch.ones(16))
        torch.testing.assert_close(attn.joint_qkv()(x), separate())
        attn.to(torch.float64)
        x = x.double()
        torch.testing.assert_close(attn.joint_qkv()(x), separate())


@pytest.mark.parametrize("bias", [False, True])
def test_output_layer_is_the_output_projection_after_its_weights_change(bias, monkeypatch):
    """Decoding's output projection through oneDNN (fp32 on a CPU not made by Intel, no gradients) gives the layer's
    logits and keeps up with its weights: changed in place (an optimizer step between validations), replaced;
    with gradients on, int8, another dtype or on an Intel CPU it is the layer itself."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", 0)  # a tiny vocabulary takes it too
    model = tiny_model(VOCAB, output_bias=bias)
    x = torch.randn(3, 2, model.output.in_features)
    with torch.no_grad():
        layer = model.output_layer()
        assert layer is not model.output and layer is model.output_layer()  # the packed copy, made once
        torch.testing.assert_close(layer(x), model.output(x))
        torch.testing.assert_close(layer(x[:1, :1]), model.output(x[:1, :1]))  # one row: a decoding step
        model.output.weight.mul_(2.0)  # the tied embeddings too
        torch.testing.assert_close(model.output_layer()(x), model.output(x))
        model.output.weight = torch.nn.Parameter(torch.randn_like(model.output.weight))
        torch.testing.assert_close(model.output_layer()(x), model.output(x))
        if bias:
            model.output.bias.add_(1.0)
            torch.testing.assert_close(model.output_layer()(x), model.output(x))
        int8 = tiny_model(VOCAB, int8=True)
        assert int8.output_layer() is int8.output
        monkeypatch.setattr(runtime, "cpu_vendor", lambda: "GenuineIntel")
        assert model.output_layer() is model.output
        monkeypatch.setattr(runtime, "cpu_vendor", lambda: "AuthenticAMD")
        monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", model.output.weight.numel() + 1)
        assert model.output_layer() is model.output  # a call's fixed cost would outweigh what it saves
        monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", 0)
        assert model.to(torch.float64).output_layer() is model.output
    assert model.float().output_layer() is model.output  # gradients on: training's layer


def test_bf16_layers_decode_through_packed_weights_and_keep_up_with_them(monkeypatch):
    """In bf16 without gradients, on a CPU with native bf16 not made by Intel, every linear layer multiplies by a copy
    of its weights packed once (here a stand-in for oneDNN's packing, which runs on any CPU: a copy of the weights),
    made again when a weight changes in place or is replaced; with gradients, in fp32 and on Intel's CPUs, none."""
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx512_bf16"}))
    made = []

    def pack(weight, bias):
        made.append(weight)
        weight, bias = weight.clone(), None if bias is None else bias.clone()  # a stale copy gives stale results
        return lambda x: F.linear(x, weight, bias)

    monkeypatch.setattr(linear, "onednn_linear", pack)
    model = tiny_model(VOCAB).to(torch.bfloat16)
    layer = model.decoder.layers[0].ffn.up
    x = torch.randn(5, 3, layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(made) == 1
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.bias = torch.nn.Parameter(torch.randn_like(layer.bias))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(made) == 3
        src, mask, tgt = random_batch(2, 6, 5)
        model(src, mask, tgt)  # every layer: attention, joined q/k/v, feed-forward, output
        packed = len(made)
        assert packed > 4 * len(model.decoder.layers)
        monkeypatch.setattr(runtime, "cpu_vendor", lambda: "GenuineIntel")
        model(src, mask, tgt)
        model.float()(src, mask, tgt)
    model.to(torch.bfloat16)(src, mask, tgt)  # gradients on: training's layers
    assert len(made) == packed


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN computes no bf16 product on this CPU",  # AVX2 alone: it has no native bf16 either
)
def test_bf16_products_over_weights_packed_for_onednn_are_the_layers_own(monkeypatch):
    """oneDNN's bf16 product over the packed weights gives the layer's results, a row's the same alone as among
    others (a decoding step as in a batch), and the model's as ATen computes them."""
    model = tiny_model(VOCAB).to(torch.bfloat16)
    layer = model.decoder.layers[0].ffn.up
    x = torch.randn(5, 3, layer.in_features, dtype=torch.bfloat16)
    src, mask, tgt = random_batch(2, 6, 5)
    with torch.no_grad():
        monkeypatch.setattr(runtime, "cpu_vendor", lambda: "GenuineIntel")
        aten = model(src, mask, tgt)
        monkeypatch.setattr(runtime, "cpu_vendor", lambda: "AuthenticAMD")
        monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx512_bf16"}))
        assert linear.onednn_pays(layer.weight)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x)[2:3, 1:2], layer(x[2:3, 1:2]))
        torch.testing.assert_close(model(src, mask, tgt), aten, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("how", ["autocast", "cast weights"])
def test_bf16_output_close_to_fp32(how):
    """Training runs bf16 under autocast; decoding casts the weights once (mtkit translate --precision bf16)."""
    model = tiny_model(VOCAB)
    src, mask, tgt = random_batch(2, 6, 5)
    full = model(src, mask, tgt)
    if how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(src, mask, tgt).float()
    else:
        low = copy.deepcopy(model).to(torch.bfloat16)(src, mask, tgt).float()
    assert (low.softmax(-1) - full.softmax(-1)).abs().max() < 0.05


def test_transformer_base_has_about_63m_parameters():
    """Vaswani et al. report 65M for base on a 37k joint vocabulary with tied embeddings."""
    cfg = from_dict({"model": {"preset": "transformer-base"}})
    with torch.device("meta"):  # shapes only: no memory, no initialisation time
        n = count_parameters(build_model(cfg.model, 37_000, 37_000, PAD_ID))
    assert 62e6 < n < 64e6


def test_tied_embeddings_share_one_tensor():
    model = tiny_model(VOCAB)
    weight = model.encoder.embed.tokens.weight
    assert model.decoder.embed.tokens.weight is weight and model.output.weight is weight
    untied = tiny_model(VOCAB, tie_embeddings=False)
    assert untied.output.weight is not untied.decoder.embed.tokens.weight
    assert untied.encoder.embed.tokens.weight is not untied.decoder.embed.tokens.weight


def test_learned_positions_and_position_limit():
    model = tiny_model(VOCAB, positions="learned", max_positions=8)
    assert model.max_source_positions == model.max_target_positions == 8
    src, mask, tgt = random_batch(1, 8, 8)
    assert model(src, mask, tgt).shape == (1, 8, VOCAB)
    with pytest.raises(ValueError, match="max_positions"):
        model(src, mask, torch.cat([tgt, tgt], dim=1))


@pytest.mark.parametrize("positions", ["sinusoidal", "relative"])
def test_matrices_start_xavier_uniform_and_embeddings_normal_with_a_zero_pad_row(positions):
    model = tiny_model(VOCAB, positions=positions, tie_embeddings=False)
    projections = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.output]
    tables = [t for m in model.modules() if isinstance(m, RelativePositions) for t in (m.keys, m.values)]
    assert len(tables) == (8 if positions == "relative" else 0)  # 4 self-attentions
    for weight in projections + tables:
        bound = math.sqrt(6 / sum(weight.shape))
        assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
    for embedding in (model.encoder.embed.tokens, model.decoder.embed.tokens):
        assert not embedding.weight[PAD_ID].any()
        assert embedding.weight[PAD_ID + 1 :].std().item() == pytest.approx(32**-0.5, rel=0.1)


def test_weights_hooks_see_what_attend_applies_until_removed():
    attn, query, key_value, allowed = attention_case()
    plain = attn(query, key_value, allowed)
    seen = []
    handle = attn.register_weights_hook(lambda module, weights: seen.append((module, weights)))
    observed = attn(query, key_value, allowed)
    handle.remove()
    attn(query, key_value, allowed)
    assert torch.equal(observed, plain) and len(seen) == 1
    module, weights = seen[0]
    assert module is attn and weights.shape == (2, 4, 5, 7)
    assert not weights[1, ..., 5:].any()
    values = attn.project_kv(key_value)[1]
    torch.testing.assert_close(attn.out_proj((weights @ values).transpose(1, 2).flatten(2)), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_drops_at_its_rate_and_keeps_the_expectation(dtype):
    torch.manual_seed(0)
    x = torch.ones(512, 4099, dtype=dtype)  # an odd size: the last 64-bit word is only partly used
    out = dropout(x, 0.1, training=True)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.002
    assert torch.allclose(out.float().mean(), torch.tensor(1.0), atol=0.003)
    # Each of the four 16-bit slices of a random word is a fair draw (a dead bit would bias one).
    lanes = kept.flatten()[: 4 * (kept.numel() // 4)].view(-1, 4).float().mean(dim=0)
    assert torch.all((lanes - 0.9).abs() < 0.004), lanes
    assert torch.equal(dropout(x, 0.1, training=False), x)
    assert torch.equal(dropout(x, 0.0, training=True), x)


def test_dropout_is_reproducible_and_its_gradient_is_its_mask():
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(3)
    out = dropout(x, 0.3, training=True)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.3, training=True), out)
    out.sum().backward()
    scale = 65536 / (65536 - round(0.3 * 65536))
    assert torch.equal(x.grad, (out != 0).float() * scale)
