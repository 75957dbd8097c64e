"""int8 decoding (``--precision int8``): the quantized layer, the model it makes, and the command line and API
that offer it. The search's exactness tests (shortlists, ensembles, prefixes, n-best lists, continuous batching)
run in int8 beside fp32 in their own modules; test_learning checks int8's quality on a trained model, test_serve
the server in int8."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import invoke, tiny_model

import mtkit
from mtkit import runtime
from mtkit.model.quantization import Int8Linear, quantize_int8, quantize_rows
from mtkit.runtime import RuntimeSetupError, choose_precision, int8_kernel


def test_a_row_quantizes_to_its_own_scale_and_back():
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [100.0, 3.0, -7.0]])
    quantized, scale = quantize_rows(x)
    assert quantized.dtype == torch.int8 and quantized.abs().max() == 127
    assert quantized[0].tolist() == [64, -127, 32] and quantized[1].tolist() == [0, 0, 0]
    assert torch.allclose(quantized * scale, x, atol=float(scale.max()) / 2)


@pytest.mark.parametrize("kernel", ["dot", "pairs"])
def test_the_int8_layer_is_the_float_one_within_2_percent_and_each_row_is_computed_alone(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    # rows of very different sizes: a scale per row keeps each one's precision
    x = torch.randn(3, 7, 64) * torch.logspace(-3, 3, 7)[:, None]
    layer = Int8Linear.from_linear(linear, kernel)
    want, got = linear(x).detach(), layer(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    error = (got - want).norm(dim=-1) / (want - linear.bias.detach()).norm(dim=-1)
    assert error.max() < 0.02, error.max()
    for i in range(3):  # batch-mates never change a row: int8 products are summed exactly
        for j in range(7):
            assert torch.equal(layer(x[i, j][None])[0], got[i, j])
    ids = torch.tensor([0, 5, 6, 40])  # a shortlist's cut is those outputs of the whole layer, exactly
    assert torch.equal(layer.rows(ids)(x), got[..., ids])
    assert torch.equal(copy.deepcopy(layer)(x), got)  # an ensemble's copies compute as the original
    other = Int8Linear.from_linear(torch.nn.Linear(64, 16), kernel)  # joined, as a decoding step's q, k and v
    assert torch.equal(Int8Linear.joined((layer, other))(x), torch.cat([got, other(x)], dim=-1))
    unbiased = Int8Linear.from_linear(torch.nn.Linear(64, 48, bias=False), kernel)
    assert unbiased.bias is None and torch.equal(unbiased(torch.zeros(2, 64)), torch.zeros(2, 48))


@pytest.mark.parametrize("kernel", ["dot", "pairs"])
def test_int8_sums_are_exact_even_where_every_product_is_at_its_largest(kernel):
    """Where int16 pair sums would saturate (AVX2's unsigned-by-signed multiply), the pairs kernel's 7-bit weights
    keep them exact: each output is the float64 product of the quantized values, scaled back."""
    top = 63 if kernel == "pairs" else 127
    assert Int8Linear.from_linear(torch.nn.Linear(512, 40), kernel).weight.abs().max() == top
    torch.manual_seed(1)
    weight = torch.randint(-top, top + 1, (40, 512), dtype=torch.int8)
    weight[0], weight[1] = top, -top
    weight[2] = torch.tensor([top, -top], dtype=torch.int8).repeat(256)
    layer = Int8Linear(weight, torch.ones(40), None, kernel)
    signs = weight[2].float().sign()
    x = torch.cat([torch.ones(2, 512) * torch.tensor([[3.0], [-1.0]]), signs[None], -signs[None], torch.randn(5, 512)])
    row_scale = x.abs().amax(dim=-1, keepdim=True) / 127
    exact = (x / row_scale).round().double() @ weight.double().t()
    assert (exact[:4, :3].abs() == 512 * 127 * top).sum() == 6  # the largest sums there are, of either sign
    assert torch.equal(layer(x), exact.float() * row_scale)


def test_every_linear_layer_is_quantized_and_the_embeddings_stay_float():
    model = tiny_model(30, seed=1, tie_embeddings=True)
    embedding = model.encoder.embed.tokens.weight.detach().clone()
    quantize_int8(model)
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 2 * (4 + 2) + 2 * (8 + 2) + 1  # attention projections and FFNs, and the output
    assert model.output.weight.dtype == torch.int8
    assert torch.equal(model.encoder.embed.tokens.weight, embedding)  # the tied embedding is not the int8 copy
    assert {layer.kernel for layer in layers} == {int8_kernel(runtime.cpu_features())}  # the CPU's fast one


def test_int8_is_cpu_only_and_says_whether_the_cpu_has_int8_dot_products():
    with pytest.raises(RuntimeSetupError, match="int8 runs on the CPU"):
        choose_precision("int8", "cuda", {"avx512_vnni"}, (9, 0))
    vnni = choose_precision("int8", "cpu", {"avx2", "avx512f", "avx512_vnni"})
    assert vnni.precision == "int8" and vnni.native and "AVX512-VNNI" in vnni.reason
    assert vnni.dtype == torch.float32  # attention and norms around the int8 layers
    avx2 = choose_precision("int8", "cpu", {"avx2", "fma"})
    assert avx2.precision == "int8" and avx2.native and avx2.reason.endswith("in pairs on AVX2, with 7-bit weights")
    older = choose_precision("int8", "cpu", {"sse4_2"})
    assert not older.native and "no AMX-INT8 or AVX512-VNNI or AVX-VNNI or AVX2: " in older.reason


def test_int8_products_run_on_the_kernel_the_cpu_is_fast_at():
    assert int8_kernel({"avx2", "avx512f", "avx512_vnni"}) == "dot" and int8_kernel({"avx2", "amx_int8"}) == "dot"
    assert int8_kernel({"avx2", "fma"}) == "pairs"
    assert int8_kernel({"sse4_2"}) == "dot" and int8_kernel(set()) == "dot"  # exact everywhere, if slow


def test_doctor_says_whether_int8_products_have_vnni(monkeypatch, no_cuda):
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert json.loads(invoke("doctor", "--json").stdout)["int8_decoding"]["precision"] == "int8"
    [line] = [line for line in invoke("doctor").stdout.splitlines() if line.startswith("int8 decoding")]
    assert line.endswith("cpu (int8 products on AVX512-VNNI)")
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx2"}))
    assert "cpu (int8 products in pairs on AVX2, with 7-bit weights)" in invoke("doctor").stdout
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"sse4_2"}))
    assert "no AMX-INT8 or AVX512-VNNI or AVX-VNNI or AVX2" in invoke("doctor").stdout


def test_translate_and_load_take_int8_and_agree(trained_run, corpus_files, tmp_path):
    lines = [*corpus_files["val.en"].read_text().splitlines()[:8], "", "A cat."]
    translator = mtkit.load(trained_run, device="cpu", precision="int8")
    assert translator.precision["precision"] == "int8"
    assert any(isinstance(m, Int8Linear) for m in translator.model.modules())
    expected = translator.translate(lines)
    assert len(expected) == len(lines) and expected[-2] == "" and sum(map(bool, expected)) >= 6
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines) + "\n")
    result = invoke("translate", trained_run, "--precision", "int8", "-i", source, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == expected


def test_training_takes_no_int8(tmp_path):
    result = invoke("train", tmp_path / "none.yaml", "--out", tmp_path / "run", "--precision", "int8")
    assert result.exit_code != 0 and "int8" in result.output
