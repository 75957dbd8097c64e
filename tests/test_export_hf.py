"""transformers export: the MarianMTModel folder computes and decodes as mtkit does, on real Multi30k sentences.

The models are random but not trivial, as in test_export.py: LayerNorm gains and biases are
randomised (a misplaced norm or a dimension left out of the permutation shows), and the eos row of
the output is scaled up. The separate-vocabulary model's hypotheses then end at varied lengths; the
tied model's run to the length cap, where the forced eos must agree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import HAND_BUILT_MODEL as MODEL
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mtkit.cli import app
from mtkit.config import DecodeConfig, ModelConfig, RunConfig, TokenizerConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_spm
from mtkit.decoding.search import beam_search, greedy_search, max_lengths
from mtkit.files import file_sha256
from mtkit.interop.export_folder import MANIFEST
from mtkit.interop.hf_export import export_transformers, generation_settings
from mtkit.model import checkpoint, loading
from mtkit.model.transformer import build_model
from mtkit.training import run_directory

with pytest.MonkeyPatch.context() as env:
    env.setenv("HF_HUB_OFFLINE", "1")  # read as transformers loads: nothing may come from the Hub
    transformers = pytest.importorskip("transformers")

runner = CliRunner()
CPU = torch.device("cpu")
DECODE = DecodeConfig(beam=4, lenpen=0.6, max_len_a=1.2, max_len_b=5, min_len=2)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def save_run(run: Path, model_cfg: ModelConfig, toks: dict[str, Tokenizer], seed: int) -> Path:
    """A run directory holding a random model of ``model_cfg`` (norms randomised, eos favoured) as its checkpoint."""
    cfg = RunConfig(tokenizer=TokenizerConfig(joint=toks["src"] is toks["tgt"]), model=model_cfg, decode=DECODE)
    torch.manual_seed(seed)
    model = build_model(model_cfg, toks["src"].vocab_size, toks["tgt"].vocab_size, PAD_ID)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
        model.output.weight[EOS_ID] *= 3.0
    run.mkdir(parents=True)
    for tok in toks.values():
        shutil.copy(tok.path, run / tok.path.name)
    records = {side: {"file": tok.path.name, "sha256": tok.sha256} for side, tok in toks.items()}
    run_directory.save_in_run(run, 1, model.state_dict(), {"config": cfg.to_dict(), "tokenizer": records}, None, 0)
    return run


@dataclass
class Exported:
    run: Path
    hf_dir: Path
    bundle: loading.InferenceBundle
    hf: object  # MarianMTModel
    tokenizer: object  # MarianTokenizer
    lines: list[str]


def exported(run: Path, lines: list[str]) -> Exported:
    hf_dir = export_transformers(run, run.parent / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return Exported(run, hf_dir, loading.load_for_inference(run, CPU), hf, tokenizer, lines)


@pytest.fixture(scope="module")
def joint(tmp_path_factory, corpus_files, spm_model) -> Exported:
    """Tied embeddings, one joint vocabulary: mtkit's defaults."""
    root = tmp_path_factory.mktemp("joint")
    run = save_run(root / "run", ModelConfig(**MODEL), {"src": spm_model, "tgt": spm_model}, seed=1)
    return exported(run, corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(scope="module")
def separate(tmp_path_factory, corpus_files) -> Exported:
    """Untied embeddings, separate vocabularies of two sizes."""
    root = tmp_path_factory.mktemp("separate")
    toks = {}
    for side, lang, size in (("src", "en", 200), ("tgt", "de", 260)):
        lines = corpus_files[f"train.{lang}"].read_text().splitlines()
        toks[side] = Tokenizer(train_spm(lines, root / f"spm.{side}", TokenizerConfig(vocab_size=size)))
    run = save_run(root / "run", ModelConfig(**MODEL, tie_embeddings=False), toks, seed=4)  # ends most outputs
    return exported(run, corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(params=["joint", "separate"])
def export(request) -> Exported:
    return request.getfixturevalue(request.param)


def source_batch(ex: Exported, lines: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """mtkit's source tensor and mask, and the HF tokenizer's batch for the same lines (checked equal)."""
    src, src_pad_mask = source_tensor(ex.bundle.src_tok.encode(lines))
    batch = ex.tokenizer(lines, return_tensors="pt", padding=True)
    assert torch.equal(batch["attention_mask"].bool(), ~src_pad_mask)
    assert torch.equal(batch["input_ids"].masked_fill(src_pad_mask, PAD_ID), src)  # Marian pads with its own id
    assert (batch["input_ids"][src_pad_mask] == ex.hf.config.pad_token_id).all()
    return src, src_pad_mask, batch


def test_logits_equal_mtkit_teacher_forced(export, corpus_files):
    src, src_pad_mask, batch = source_batch(export, export.lines)
    targets = export.bundle.tgt_tok.encode(corpus_files["val.de"].read_text().splitlines())
    tgt_in, _ = source_tensor([[2, *t] for t in targets])  # bos + reference, padded
    decoder_in = tgt_in.clone()
    decoder_in[:, 0] = export.hf.config.decoder_start_token_id  # Marian's start: the appended zero row
    with torch.no_grad():
        expected = export.bundle.model(src, src_pad_mask, tgt_in)
        got = export.hf(**batch, decoder_input_ids=decoder_in, decoder_attention_mask=tgt_in != PAD_ID).logits
    real = tgt_in != PAD_ID
    vocab = expected.size(-1)
    assert got.shape[:-1] == expected.shape[:-1] and got.size(-1) > vocab
    torch.testing.assert_close(got[real][:, :vocab], expected[real], atol=1e-4, rtol=1e-4)
    assert (got[real][:, vocab:] < expected[real].min() - 1000).all()  # no share of the softmax


def test_importing_the_export_gives_back_the_same_model(export, corpus_files, tmp_path):
    """`mtkit import hf` of mtkit's own export: its layout is recognised (mtkit's ids kept, the padding rows and
    appended start dropped, bos taken back out of the decoder's position row 0), so text encodes to the same
    ids in vocabularies of the same sizes, and the model computes and decodes as the original."""
    out = tmp_path / "back"
    result = invoke("import", "hf", export.hf_dir, "-o", out)
    assert result.exit_code == 0, result.output
    back = loading.load_for_inference(out, CPU)
    targets = corpus_files["val.de"].read_text().splitlines()
    for side, lines in (("src_tok", export.lines), ("tgt_tok", targets)):
        original, again = getattr(export.bundle, side), getattr(back, side)
        assert again.vocab_size == original.vocab_size
        assert again.encode(lines) == original.encode(lines)
    src, src_pad_mask = source_tensor(export.bundle.src_tok.encode(export.lines))
    tgt_in, _ = source_tensor([[BOS_ID, *t] for t in export.bundle.tgt_tok.encode(targets)])
    with torch.no_grad():
        expected = export.bundle.model(src, src_pad_mask, tgt_in)
        got = back.model(src, src_pad_mask, tgt_in)
    real = tgt_in != PAD_ID
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    decode = DecodeConfig(beam=1)
    expected_ids = greedy_search(export.bundle.model, src, src_pad_mask, decode)
    assert greedy_search(back.model, src, src_pad_mask, decode) == expected_ids
    assert sum(map(len, expected_ids)) / len(expected_ids) > 5


def _edit_last_bias(weights: dict[str, torch.Tensor]) -> None:
    weights["final_logits_bias"][0, -1] = 0.0


def _edit_start_position(weights: dict[str, torch.Tensor]) -> None:
    weights["model.decoder.embed_positions.weight"][0, 0] += 0.5


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_edit_last_bias, "laid out as mtkit's export, but its appended ids are not a zero start row"),
        (_edit_start_position, "model.decoder.embed_positions.weight is not Marian's sinusoidal table"),
    ],
)
def test_an_export_whose_start_row_was_changed_is_refused_at_import(joint, tmp_path, edit, message):
    """Dropping the appended start id and bos' share of position row 0 keeps the model only when they are what the
    export wrote; otherwise the import would silently compute another function."""
    folder = tmp_path / "hf"
    shutil.copytree(joint.hf_dir, folder)
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors")
    result = invoke("import", "hf", folder, "-o", tmp_path / "back")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "back").exists()


def hf_outputs(ex: Exported, lines: list[str], decode: DecodeConfig, **options) -> list[list[int]]:
    """transformers' output ids (no start, eos or pad) per line, each line under mtkit's own length cap."""
    _, src_pad_mask, batch = source_batch(ex, lines)
    caps = max_lengths(src_pad_mask, decode.max_len_a, decode.max_len_b, ex.bundle.cfg.model.max_positions)
    outputs: list[list[int]] = [[] for _ in lines]
    for cap in caps.unique().tolist():
        rows = (caps == cap).nonzero().flatten()
        generated = ex.hf.generate(
            input_ids=batch["input_ids"][rows],
            attention_mask=batch["attention_mask"][rows],
            max_new_tokens=cap,
            **options,
        )
        for row, ids in zip(rows.tolist(), generated.tolist()):
            outputs[row] = [t for t in ids[1:] if t not in (EOS_ID, ex.hf.config.pad_token_id)]
    return outputs


def test_greedy_generate_equals_mtkit_greedy_search(export):
    decode = DecodeConfig(beam=1)
    src, src_pad_mask, _ = source_batch(export, export.lines)
    expected = greedy_search(export.bundle.model, src, src_pad_mask, decode)
    got = hf_outputs(export, export.lines, decode, num_beams=1, min_new_tokens=0)
    mismatched = [i for i in range(len(got)) if got[i] != expected[i]]
    assert len(got) == 40 and len(mismatched) <= len(got) // 100, f"{len(mismatched)} of {len(got)} differ"
    assert sum(map(len, expected)) / len(expected) > 5  # non-trivial outputs


def test_beam_generate_equals_mtkit_beam_search_without_length_penalty(export):
    """With lenpen 0 and fairseq's stopping rule (mtkit's early_stop false) the two beam searches are one
    algorithm, but at the length cap: transformers forces eos there with a log-probability of 0, mtkit
    extends the best hypotheses that did not end and counts the eos it forces. So they agree wherever
    mtkit's best hypothesis ended before its cap (the random models' beams often reach it)."""
    decode = DecodeConfig(beam=5, lenpen=0.0, early_stop=False)
    src, src_pad_mask, _ = source_batch(export, export.lines)
    expected = [hyps[0].tokens for hyps in beam_search(export.bundle.model, src, src_pad_mask, decode)]
    got = hf_outputs(export, export.lines, decode, num_beams=5, length_penalty=0.0, min_new_tokens=0)
    caps = max_lengths(src_pad_mask, decode.max_len_a, decode.max_len_b, export.bundle.cfg.model.max_positions)
    ended = [i for i in range(len(got)) if len(expected[i]) < caps[i] - 1]
    same = sum(got[i] == expected[i] for i in ended)
    assert len(ended) >= 5 and same == len(ended), f"{same} of {len(ended)} best hypotheses equal"


def test_beam_generate_equals_mtkit_beam_search_at_the_power_length_penalty(export):
    """decode.length_penalty power divides by length ** lenpen as transformers' length_penalty does (eos counted, the
    start token not), so at transformers' default of 1.0 the two searches agree where both best hypotheses ended
    before the cap: there transformers' forced eos costs nothing, and a cut hypothesis may win."""
    decode = DecodeConfig(beam=5, lenpen=1.0, length_penalty="power", early_stop=False)
    src, src_pad_mask, _ = source_batch(export, export.lines)
    expected = [hyps[0].tokens for hyps in beam_search(export.bundle.model, src, src_pad_mask, decode)]
    got = hf_outputs(export, export.lines, decode, num_beams=5, length_penalty=1.0, min_new_tokens=0)
    caps = max_lengths(src_pad_mask, decode.max_len_a, decode.max_len_b, export.bundle.cfg.model.max_positions)
    ended = [i for i in range(len(got)) if max(len(expected[i]), len(got[i])) < caps[i] - 1]
    same = sum(got[i] == expected[i] for i in ended)
    assert len(ended) >= 5 and same == len(ended), f"{same} of {len(ended)} best hypotheses equal"


def test_generation_config_gives_the_power_penalty_as_it_is():
    """transformers' length_penalty is the power penalty's alpha; a GNMT alpha is converted (module docstring)."""
    power = generation_settings(DecodeConfig(beam=4, lenpen=1.3, length_penalty="power"), 128, 99)
    assert power["length_penalty"] == 1.3 and power["early_stopping"] is True
    assert generation_settings(DecodeConfig(beam=4, lenpen=1.3), 128, 99)["length_penalty"] == 1.04  # 1.3 * 20 / 25


def test_generation_config_holds_the_runs_decoding(joint):
    settings = json.loads((joint.hf_dir / "generation_config.json").read_text())
    assert settings["num_beams"] == 4 and settings["length_penalty"] == 0.48 and settings["min_new_tokens"] == 2
    assert settings["max_new_tokens"] == 128  # max_positions: no sentence's cap exceeds it
    start = joint.bundle.tgt_tok.vocab_size  # the id after the vocabulary, Marian's pad
    assert settings["decoder_start_token_id"] == settings["pad_token_id"] == start
    assert settings["suppress_tokens"] == [0, 2]  # mtkit's pad and bos
    assert json.loads((joint.hf_dir / MANIFEST).read_text())["runtime"] == "transformers"


def test_the_export_translates_where_mtkit_cannot_be_imported(joint):
    """A fresh interpreter in which ``import mtkit`` fails loads the folder with transformers alone."""
    script = f"""
import sys
sys.modules["mtkit"] = None  # the editable install stays on the path; this makes importing it fail
try:
    import mtkit
except ImportError:
    pass
else:
    raise SystemExit("mtkit was importable")
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(joint.hf_dir)!r})
model = AutoModelForSeq2SeqLM.from_pretrained({str(joint.hf_dir)!r})
batch = tokenizer(sys.stdin.read().splitlines(), return_tensors="pt", padding=True)
for text in tokenizer.batch_decode(model.generate(**batch, num_beams=1, max_new_tokens=20), skip_special_tokens=True):
    print(text)
"""
    lines = joint.lines[:5]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", script], input="\n".join(lines), capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _, _, batch = source_batch(joint, lines)
    expected = joint.tokenizer.batch_decode(
        joint.hf.generate(**batch, num_beams=1, max_new_tokens=20), skip_special_tokens=True
    )
    src, src_pad_mask, _ = source_batch(joint, lines)
    ids = greedy_search(
        joint.bundle.model, src, src_pad_mask, DecodeConfig(beam=1, max_len_a=0, max_len_b=20, min_len=2)
    )
    assert done.stdout.splitlines() == expected == joint.bundle.tgt_tok.decode(ids)


def test_ctranslate2s_own_converter_turns_the_export_into_the_same_model(joint, tmp_path):
    """``ct2-transformers-converter``, as its users run it, on the export: its greedy search gives mtkit's
    tokens. The converter starts Marian's decoder from a zero embedding and drops the last id, which is
    what the export's layout is made for; the random model's outputs run to the length cap, where
    CTranslate2 cuts and mtkit forces eos."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    converter = Path(sys.executable).with_name("ct2-transformers-converter")
    out = tmp_path / "ct2"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [str(converter), "--model", str(joint.hf_dir), "--output_dir", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    vocab = joint.bundle.tgt_tok.vocab_size
    assert len(json.loads((out / "shared_vocabulary.json").read_text())) == vocab  # the appended id dropped

    cap = 12
    src, src_pad_mask, batch = source_batch(joint, joint.lines)
    expected = greedy_search(
        joint.bundle.model, src, src_pad_mask, DecodeConfig(beam=1, max_len_a=0, max_len_b=cap, min_len=0)
    )
    pieces = [joint.tokenizer.convert_ids_to_tokens(ids) for ids in joint.tokenizer(joint.lines)["input_ids"]]
    banned = [[piece] for piece in joint.tokenizer.convert_ids_to_tokens([PAD_ID, 2])]  # as mtkit's export bans them
    results = ctranslate2.Translator(str(out)).translate_batch(
        pieces, beam_size=1, max_decoding_length=cap - 1, suppress_sequences=banned
    )
    got = [joint.tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]
    same = sum(g == e for g, e in zip(got, expected))
    assert same >= len(got) - len(got) // 100, f"{same} of {len(got)} equal"
    assert sum(map(len, expected)) / len(expected) > 5


def test_export_command_writes_a_transformers_folder_and_replaces_it(joint, tmp_path):
    out = tmp_path / "hf"
    for _ in range(2):  # the second export replaces the first
        result = invoke("export", joint.run, "--format", "hf", "-o", out)
        assert result.exit_code == 0, result.output
    assert "wrote" in result.stderr and "MarianMTModel" in result.stderr
    names = {path.name for path in out.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm"}
    assert expected | {"vocab.json", "tokenizer_config.json", MANIFEST} <= names
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]  # no temporary folders left behind
    refused = runner.invoke(app, ["translate", str(out), "--engine", "ctranslate2"], input="A dog.\n")
    assert (
        refused.exit_code == 1
        and refused.stderr == f"error: {out}: an export for 'transformers', not for CTranslate2\n"
    )


def test_the_manifest_names_the_weights_by_digest_and_no_file_by_path(joint):
    """mtkit.json once recorded the path of the checkpoint on the exporter's machine; its recipients get the
    SHA-256 of the weights and their update step, and no file of the folder (config, tokenizer files) holds a path."""
    manifest = json.loads((joint.hf_dir / MANIFEST).read_text())
    weights = loading.resolve(joint.run) / checkpoint.WEIGHTS_FILE
    assert manifest["weights_sha256"] == file_sha256(weights) and manifest["step"] == 1
    for path in joint.hf_dir.iterdir():
        assert str(joint.run.parent).encode() not in path.read_bytes(), path.name


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"norm": "pre"}, "MarianMTModel is post-norm only (no final LayerNorm); this model has model.norm pre"),
        (
            {"positions": "learned"},
            "MarianMTModel has sinusoidal positions only; this model has model.positions learned",
        ),
        ({"positions": "rotary"}, "sinusoidal positions only; this model has model.positions rotary"),
        ({"positions": "relative"}, "sinusoidal positions only; this model has model.positions relative"),
        ({"attention_window": 4}, "MarianMTModel attends to every position; this model has model.attention_window 4"),
    ],
)
def test_what_marian_cannot_compute_is_a_one_line_error(tmp_path, spm_model, change, reason):
    run = save_run(tmp_path / "run", ModelConfig(**{**MODEL, **change}), {"src": spm_model, "tgt": spm_model}, seed=5)
    result = invoke("export", run, "--format", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {run}: cannot export to transformers: ") and reason in result.stderr
    assert not (tmp_path / "hf").exists()


def test_quantization_is_refused_for_transformers(tmp_path, joint):
    result = invoke("export", joint.run, "--format", "hf", "--quantization", "int8", "-o", tmp_path / "hf")
    assert result.exit_code == 1
    assert (
        result.stderr
        == "error: --quantization is for --format ctranslate2; a transformers export keeps float32 weights\n"
    )
