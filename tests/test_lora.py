"""LoRA adapters at inference: the adapted layer's arithmetic on every decoding path, merging, the adapter file read
as untrusted, and an adapter used by translate, score, the Python API and the exports (CTranslate2, transformers,
and peft's LoRA over the transformers export computing what mtkit computes).

The base model is hand-built and random but not trivial (helpers.joint_run), and its adapter too: random A and B,
so that the adapted model translates otherwise than its base.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import safetensors
import torch
from helpers import invoke, joint_run, one_line_error
from safetensors.torch import save_file

import mtkit
from mtkit.config import LoraConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import EOS_ID, PAD_ID
from mtkit.decoding.search import greedy_search, max_lengths
from mtkit.interop.export_folder import MANIFEST
from mtkit.interop.marian import layer_weights, residual_order
from mtkit.model import checkpoint, loading, lora
from mtkit.model.adapter_file import ADAPTER_KEY, adapter_header
from mtkit.model.attention import DecoderCache
from mtkit.model.linear import Linear

with pytest.MonkeyPatch.context() as env:
    env.setenv("OMP_WAIT_POLICY", "PASSIVE")  # CTranslate2's OpenMP threads must not spin beside torch's
    ctranslate2 = pytest.importorskip("ctranslate2")
    env.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
SETTINGS = LoraConfig(rank=4, alpha=8.0, targets=("attention", "ffn"))


def write_adapter(path: Path, base: Path, settings: LoraConfig = SETTINGS, seed: int = 5) -> Path:
    """An adapter file for the model ``base``: A as training draws it, B random (not zero), its record of the base's
    weights digest."""
    model = loading.load_for_inference(base, CPU).model
    torch.manual_seed(seed)
    lora.add_adapters(model, settings)
    with torch.no_grad():
        for layer in lora.adapted_layers(model).values():
            layer.lora.b.normal_(0.0, 0.1)
    digest = checkpoint.stored_weights_digest(checkpoint.weights_file(loading.resolve(base)))
    tensors = {name: t.detach().contiguous() for name, t in lora.adapter_weights(model).items()}
    save_file(tensors, path, metadata=adapter_header(settings, digest))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, spm_model) -> Path:
    """A hand-built post-norm model with sinusoidal positions and tied embeddings (what both exports take)."""
    return joint_run(tmp_path_factory.mktemp("base"), spm_model, seed=1, ending=True)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("adapter") / "adapter.safetensors", base)


@pytest.fixture(scope="module")
def lines(corpus_files) -> list[str]:
    return corpus_files["val.en"].read_text().splitlines()[:12]


def greedy(model, tok, lines: list[str]) -> list[list[int]]:
    src, src_pad_mask = source_tensor(tok.encode(lines))
    return greedy_search(model, src, src_pad_mask)


# -- the adapted layer ----------------------------------------------------------------------------------------


def test_every_decoding_path_of_a_layer_adds_its_adapter():
    torch.manual_seed(0)
    layers = [Linear(16, n) for n in (16, 8, 16)]
    for layer in layers[::2]:  # the middle one keeps no adapter
        layer.lora = lora.LowRank(16, layer.out_features, rank=3, alpha=6.0, dropout=0.0)
        torch.nn.init.normal_(layer.lora.a)
        torch.nn.init.normal_(layer.lora.b)
    x = torch.randn(5, 16)
    with torch.no_grad():
        plain = [torch.nn.functional.linear(x, layer.weight, layer.bias) for layer in layers]
        adapted = [layer(x) for layer in layers]
        expected = [
            out + 2.0 * x @ layer.lora.a.T @ layer.lora.b.T if layer.lora is not None else out
            for out, layer in zip(plain, layers)
        ]
        for got, want in zip(adapted, expected):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(Linear.joined(layers)(x), torch.cat(expected, dim=-1))
        ids = torch.tensor([1, 4, 9])
        torch.testing.assert_close(layers[0].rows(ids)(x), expected[0][:, ids])
        torch.testing.assert_close(layers[0].decoding()(x), expected[0])


def test_new_adapters_leave_the_model_as_it_was_and_merging_keeps_what_it_computes(base):
    model = loading.load_for_inference(base, CPU).model
    src = torch.randint(4, 300, (3, 7))
    pad = torch.zeros_like(src, dtype=torch.bool)
    tgt = torch.randint(4, 300, (3, 6))
    with torch.no_grad():
        before = model(src, pad, tgt)
        added = lora.add_adapters(model, SETTINGS)
        model.eval()
        assert torch.equal(model(src, pad, tgt), before)  # B starts at zero
        assert added == sum(t.numel() for t in lora.adapter_weights(model).values()) > 0
        for layer in lora.adapted_layers(model).values():
            layer.lora.b.normal_(0.0, 0.1)
        adapted = model(src, pad, tgt)
        cache = DecoderCache()  # cached steps: the joined q, k and v projections carry the adapters too
        memory = model.encode(src, pad)
        stepped = torch.cat([model.decode(tgt[:, i : i + 1], memory, pad, cache) for i in range(6)], dim=1)
        torch.testing.assert_close(stepped, adapted, atol=1e-5, rtol=1e-5)
        lora.merge_adapters(model)
        assert lora.adapted_layers(model) == {}
        merged = model(src, pad, tgt)
    assert (adapted - before).abs().max() > 0.1
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)


def test_targets_choose_the_layers_and_a_rank_too_wide_is_refused(base):
    model = loading.load_for_inference(base, CPU).model
    names = lora.target_layers(model, LoraConfig(rank=2, targets=("self_v", "cross_out", "ffn_up")))
    assert sorted(names) == sorted(
        [f"{side}.layers.{i}.self_attn.v_proj" for side in ("encoder", "decoder") for i in range(2)]
        + [f"decoder.layers.{i}.cross_attn.out_proj" for i in range(2)]
        + [f"{side}.layers.{i}.ffn.up" for side in ("encoder", "decoder") for i in range(2)]
    )
    with pytest.raises(mtkit.MtkitError, match="rank 65 is more than encoder.layers.0.self_attn.q_proj can take"):
        lora.target_layers(model, LoraConfig(rank=65, targets=("attention",)))


# -- using an adapter -----------------------------------------------------------------------------------------


def test_unmerged_and_merged_adapters_give_the_same_logits_and_translations(base, adapter, lines):
    unmerged = loading.load_for_inference(base, CPU, adapter=adapter)
    merged = loading.load_for_inference(base, CPU, adapter=adapter, merge=True)
    plain = loading.load_for_inference(base, CPU)
    assert lora.adapted_layers(unmerged.model) and not lora.adapted_layers(merged.model)
    src, src_pad_mask = source_tensor(plain.src_tok.encode(lines))
    tgt_in, _ = source_tensor([[2, *t] for t in plain.tgt_tok.encode(lines)])
    with torch.no_grad():
        torch.testing.assert_close(
            merged.model(src, src_pad_mask, tgt_in), unmerged.model(src, src_pad_mask, tgt_in), atol=1e-5, rtol=1e-5
        )
    adapted = greedy(unmerged.model, unmerged.src_tok, lines)
    assert adapted == greedy(merged.model, merged.src_tok, lines)
    assert adapted != greedy(plain.model, plain.src_tok, lines)
    assert unmerged.adapter.record()["rank"] == 4 and unmerged.base_sha256 == checkpoint.weights_digest(
        checkpoint.read_checkpoint(loading.resolve(base)).weights
    )
    int8 = loading.load_for_inference(base, CPU, "int8", adapter=adapter)  # quantizes the merged weights
    assert not lora.adapted_layers(int8.model)


def test_translate_score_and_the_api_take_an_adapter(base, adapter, lines, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines) + "\n")
    options = ["--device", "cpu", "--precision", "fp32", "--beam", "2"]
    result = invoke("translate", base, "--adapter", adapter, "-i", source, *options)
    assert result.exit_code == 0, result.output
    translator = mtkit.load(base, device="cpu", precision="fp32", beam=2, adapter=adapter)
    assert result.stdout.splitlines() == translator.translate(lines)
    assert translator.translate(lines) != mtkit.load(base, device="cpu", precision="fp32", beam=2).translate(lines)
    target = tmp_path / "hyp.de"
    target.write_text(result.stdout)
    scored = invoke("score", base, "--adapter", adapter, "--src", source, "--tgt", target, "--device", "cpu",
                    "--precision", "fp32")  # fmt: skip
    assert scored.exit_code == 0, scored.output
    expected = [f"{s.logprob:.6f}\t{s.tokens}" for s in translator.score(lines, result.stdout.splitlines())]
    assert scored.stdout.splitlines() == expected
    one_line_error(invoke("translate", base, base, "--adapter", adapter, "-i", source), "one model, not an ensemble")
    one_line_error(invoke("translate", base, "--adapter", adapter, "-o", adapter, "-i", source), str(adapter))


# -- the adapter file, read as untrusted ----------------------------------------------------------------------


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _edited_metadata(edit):
    def make(source: Path, target: Path) -> None:
        with safetensors.safe_open(source, framework="pt") as f:
            metadata, tensors = dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}
        record = json.loads(metadata[ADAPTER_KEY])
        edited = edit(record)
        metadata[ADAPTER_KEY] = edited if isinstance(edited, str) else json.dumps(record)
        save_file(tensors, target, metadata=metadata)

    return make


def _edited_tensors(edit):
    def make(source: Path, target: Path) -> None:
        with safetensors.safe_open(source, framework="pt") as f:
            metadata, tensors = dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}
        edit(tensors)
        save_file(tensors, target, metadata=metadata)

    return make


def _truncated(source: Path, target: Path) -> None:
    target.write_bytes(source.read_bytes()[:-100])


def _huge_header(source: Path, target: Path) -> None:
    target.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")


def _not_json(source: Path, target: Path) -> None:
    header, data = _header_and_data(source)
    text = b"{" * 1000
    target.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _without_record(source: Path, target: Path) -> None:
    header, data = _header_and_data(source)
    del header["__metadata__"][ADAPTER_KEY]
    target.write_bytes(_with_header(header, data))


def _nan(tensors: dict) -> None:
    tensors["decoder.layers.1.ffn.down.lora.b"][0, 0] = float("nan")


def _missing(tensors: dict) -> None:
    del tensors["encoder.layers.0.self_attn.k_proj.lora.a"]


def _extra(tensors: dict) -> None:
    tensors["output.lora.a"] = torch.zeros(4, 64)


def _wrong_shape(tensors: dict) -> None:
    tensors["encoder.layers.1.ffn.up.lora.b"] = torch.zeros(128, 5)


def _half(tensors: dict) -> None:
    tensors["encoder.layers.1.ffn.up.lora.b"] = tensors["encoder.layers.1.ffn.up.lora.b"].half()


def _setting(key, value):
    def edit(record: dict) -> None:
        record[key] = value

    return edit


BAD_ADAPTERS = {
    "truncated": (_truncated, "not a readable adapter"),
    "huge header": (_huge_header, "refused: a header of 1,099,511,627,776 bytes"),
    "header not JSON": (_not_json, "its safetensors header is not JSON"),
    "NaN": (_edited_tensors(_nan), "decoder.layers.1.ffn.down.lora.b holds NaN or infinite values"),
    "missing tensor": (_edited_tensors(_missing), "no encoder.layers.0.self_attn.k_proj.lora.a"),
    "extra tensor": (_edited_tensors(_extra), "an extra 'output.lora.a'"),
    "wrong shape": (_edited_tensors(_wrong_shape), "encoder.layers.1.ffn.up.lora.b is 'F32' [128, 5] there"),
    "float16": (_edited_tensors(_half), "'F16' [128, 4] there; this base model's adapter of its rank needs F32"),
    "other base": (_edited_metadata(_setting("base_sha256", "0" * 64)), "adapts another base model than"),
    "rank not a number": (_edited_metadata(_setting("rank", "4")), "rank must be an integer"),
    "rank too wide": (_edited_metadata(_setting("rank", 100)), "rank 100 is more than"),
    "alpha infinite": (_edited_metadata(_setting("alpha", float("inf"))), "alpha must be a finite"),
    "alpha negative": (_edited_metadata(_setting("alpha", -1.0)), "train.lora.alpha must be > 0"),
    "unknown target": (_edited_metadata(_setting("targets", ["output"])), "must be one of attention"),
    "unknown key": (_edited_metadata(_setting("path", "/etc")), "unknown key(s) 'path'"),
    "other format": (_edited_metadata(_setting("format", 2)), "format 2 is not 1"),
    "metadata not JSON": (_edited_metadata(lambda record: "{"), "mtkit.adapter is not JSON"),
    "not an adapter": (_without_record, "not an mtkit adapter (no 'mtkit.adapter' entry in its header)"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_a_bad_adapter_file_is_refused_in_one_line_naming_it(base, adapter, tmp_path, case):
    make, message = BAD_ADAPTERS[case]
    bad = tmp_path / "bad.safetensors"
    make(adapter, bad)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        loading.load_for_inference(base, CPU, adapter=bad)
    assert str(refused.value).startswith(f"{bad}: ") and message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_model_file_a_foreign_digest_and_a_link_out_of_the_folder_are_refused(base, adapter, tmp_path, spm_model):
    model_file = checkpoint.weights_file(loading.resolve(base))
    one_line_error(invoke("translate", base, "--adapter", model_file), "not an mtkit adapter (no 'mtkit.adapter'")
    other = joint_run(tmp_path, spm_model, seed=9)
    line = one_line_error(invoke("translate", other, "--adapter", adapter), "adapts another base model than")
    assert str(adapter) in line and str(loading.resolve(other)) in line
    folder = tmp_path / "shared"
    folder.mkdir()
    os.symlink(adapter, folder / "adapter.safetensors")
    one_line_error(invoke("translate", base, "--adapter", folder / "adapter.safetensors"), "outside")


# -- exports --------------------------------------------------------------------------------------------------


def test_exports_merge_the_adapter_and_decode_as_mtkit_does(base, adapter, lines, tmp_path):
    bundle = loading.load_for_inference(base, CPU, adapter=adapter)
    expected = greedy(bundle.model, bundle.src_tok, lines)
    for fmt in ("ctranslate2", "hf"):
        result = invoke("export", base, "--adapter", adapter, "--format", fmt, "-o", tmp_path / fmt)
        assert result.exit_code == 0, result.output
        manifest = json.loads((tmp_path / fmt / MANIFEST).read_text())
        assert manifest["adapter"] == {**bundle.adapter.record(), "base_sha256": bundle.base_sha256}

    ids = bundle.src_tok.encode(lines)
    src, src_pad_mask = source_tensor(ids)
    caps = max_lengths(src_pad_mask, 1.5, 10, bundle.cfg.model.max_positions) - 1  # tokens before eos
    engine = ctranslate2.Translator(str(tmp_path / "ctranslate2"))
    banned = [[bundle.tgt_tok.sp.id_to_piece(PAD_ID)], [bundle.tgt_tok.sp.id_to_piece(2)]]
    got = []
    for seq, cap in zip(ids, caps.tolist()):
        [result] = engine.translate_batch(
            [bundle.src_tok.sp.id_to_piece(seq)], beam_size=1, max_decoding_length=cap, min_decoding_length=0,
            suppress_sequences=banned, max_input_length=0,
        )  # fmt: skip
        got.append(bundle.tgt_tok.sp.piece_to_id(result.hypotheses[0]))
    assert got == expected

    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    generated = []
    for line, cap in zip(lines, (caps + 1).tolist()):
        out = hf.generate(**tokenizer([line], return_tensors="pt"), num_beams=1, max_new_tokens=cap, min_new_tokens=0)
        generated.append([t for t in out[0, 1:].tolist() if t not in (EOS_ID, hf.config.pad_token_id)])
    assert generated == expected


def test_peft_lora_on_the_transformers_export_of_the_base_computes_the_adapted_logits(base, adapter, lines, tmp_path):
    """peft's LoraModel, given the adapter's A and B (their residual-stream axis permuted as the export permutes
    the weights: marian.py), over the export of the base alone."""
    peft = pytest.importorskip("peft")
    assert invoke("export", base, "--format", "hf", "-o", tmp_path / "hf").exit_code == 0
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = peft.LoraConfig(r=SETTINGS.rank, lora_alpha=SETTINGS.alpha, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])  # fmt: skip
    tuned = peft.get_peft_model(hf, config).eval()
    bundle = loading.load_for_inference(base, CPU, adapter=adapter)
    order = residual_order(bundle.model.output.in_features)
    where = {id(tensor): (name.removesuffix(".weight"), axis) for name, tensor, axis in layer_weights(bundle.model)}
    peft_layers = dict(tuned.base_model.model.named_modules())
    copied = 0
    for layer in lora.adapted_layers(bundle.model).values():
        name, axis = where[id(layer.weight)]
        a, b = layer.lora.a.detach(), layer.lora.b.detach()
        target = peft_layers[name]
        with torch.no_grad():
            target.lora_A["default"].weight.copy_(a[:, order] if axis == "reads" else a)
            target.lora_B["default"].weight.copy_(b[order] if axis == "writes" else b)
        copied += 1
    assert copied == 2 * 6 + 2 * 10
    src, src_pad_mask = source_tensor(bundle.src_tok.encode(lines))
    tgt_in, _ = source_tensor([[2, *t] for t in bundle.tgt_tok.encode(lines)])
    decoder_in = tgt_in.clone()
    decoder_in[:, 0] = hf.config.decoder_start_token_id
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = bundle.model(src, src_pad_mask, tgt_in)
        got = tuned(**batch, decoder_input_ids=decoder_in, decoder_attention_mask=tgt_in != PAD_ID).logits
    real = tgt_in != PAD_ID
    torch.testing.assert_close(got[real][:, : expected.size(-1)], expected[real], atol=1e-4, rtol=1e-4)
