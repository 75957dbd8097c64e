"""CTranslate2 export: the exported model decodes as mtkit does on real Multi30k sentences; `mtkit export`.

The models are random but not trivial: LayerNorm gains and biases are randomised (so a dropped or
misplaced norm shows), and one variant's eos row is scaled up so that its hypotheses end at varied
lengths instead of all running to the length cap.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from helpers import HAND_BUILT_MODEL, joint_post_norm_run, joint_run, randomise_norms_, save_run
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

import mtkit
from mtkit.cli import app
from mtkit.config import ConfigError, DecodeConfig, ModelConfig, RunConfig, TokenizerConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_spm
from mtkit.decoding import shortlist as lexical
from mtkit.decoding.line_translator import EMPTY, Translation, Translator
from mtkit.decoding.search import greedy_search, max_lengths
from mtkit.files import file_sha256
from mtkit.interop.ct2_export import VMAP, export_ctranslate2
from mtkit.interop.ct2_translator import CTranslate2Translator
from mtkit.interop.export_folder import MANIFEST
from mtkit.model import checkpoint, loading
from mtkit.model.transformer import build_model

# CTranslate2 brings its own OpenMP, whose threads spin for a while after each call: alternating it with torch
# on a 2-core machine made torch 30x slower. The library reads the wait policy as it loads.
with pytest.MonkeyPatch.context() as env:
    env.setenv("OMP_WAIT_POLICY", "PASSIVE")
    ctranslate2 = pytest.importorskip("ctranslate2")

runner = CliRunner()
CPU = torch.device("cpu")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def rotary_run(root: Path, spm_model: Tokenizer, **model) -> Path:
    """Post-norm, rotary positions (no position table), one joint vocabulary: the Multi30k recipe's kind."""
    return joint_run(root, spm_model, seed=5, ending=True, **{"positions": "rotary", **model})


def separate_pre_norm_run(root: Path, corpus_files: dict[str, Path]) -> Path:
    """Pre-norm (final LayerNorms), learned positions, untied embeddings, separate vocabularies of two sizes."""
    for side, lang, size in (("src", "en", 200), ("tgt", "de", 260)):
        train_spm(
            corpus_files[f"train.{lang}"].read_text().splitlines(),
            root / f"spm.{side}",
            TokenizerConfig(vocab_size=size),
        )
    src, tgt = Tokenizer(root / "spm.src.model"), Tokenizer(root / "spm.tgt.model")
    cfg = RunConfig(
        tokenizer=TokenizerConfig(joint=False),
        model=ModelConfig(**HAND_BUILT_MODEL, norm="pre", positions="learned", tie_embeddings=False),
    )
    torch.manual_seed(3)
    model = build_model(cfg.model, src.vocab_size, tgt.vocab_size, PAD_ID)
    randomise_norms_(model, seed=4)
    with torch.no_grad():
        model.output.weight[EOS_ID] *= 3.0  # hypotheses end at varied lengths, not all at the cap
    return save_run(root / "run", cfg, model, {"src": src, "tgt": tgt})


@dataclass
class Exported:
    run: Path
    ct2_dir: Path
    bundle: loading.InferenceBundle
    lines: list[str]


def export_of(run: Path, lines: list[str]) -> Exported:
    ct2_dir = export_ctranslate2(run, run.parent / "ct2", None)
    return Exported(run, ct2_dir, loading.load_for_inference(run, CPU), lines)


@pytest.fixture(scope="module")
def capped(tmp_path_factory, corpus_files, spm_model) -> Exported:
    """Joint post-norm model whose every hypothesis runs to the length cap: long outputs, 45-67 tokens."""
    run = joint_post_norm_run(tmp_path_factory.mktemp("capped"), spm_model)
    return export_of(run, corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(scope="module")
def ending(tmp_path_factory, corpus_files) -> Exported:
    """Separate-vocabulary pre-norm model whose hypotheses mostly end with eos, at varied lengths."""
    run = separate_pre_norm_run(tmp_path_factory.mktemp("ending"), corpus_files)
    return export_of(run, corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(scope="module")
def rotary(tmp_path_factory, corpus_files, spm_model) -> Exported:
    """Joint post-norm model with rotary positions: CTranslate2 must rotate queries and keys as mtkit does."""
    run = rotary_run(tmp_path_factory.mktemp("rotary"), spm_model)
    return export_of(run, corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(params=["capped", "ending", "rotary"])
def exported(request) -> Exported:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def joint(tmp_path_factory, spm_model) -> Path:
    """A run directory of its own, for tests that write beside it."""
    return joint_post_norm_run(tmp_path_factory.mktemp("joint"), spm_model)


def test_greedy_ids_equal_mtkit_greedy_search(exported):
    bundle = exported.bundle
    ids = bundle.src_tok.encode(exported.lines)
    src, src_pad_mask = source_tensor(ids)
    expected = greedy_search(bundle.model, src, src_pad_mask)
    caps = max_lengths(src_pad_mask, 1.5, 10, bundle.cfg.model.max_positions) - 1  # tokens before eos
    engine = ctranslate2.Translator(str(exported.ct2_dir))
    banned = [[bundle.tgt_tok.sp.id_to_piece(PAD_ID)], [bundle.tgt_tok.sp.id_to_piece(BOS_ID)]]
    got = []
    for seq, cap in zip(ids, caps.tolist()):
        [result] = engine.translate_batch(
            [bundle.src_tok.sp.id_to_piece(seq)],
            beam_size=1,
            max_decoding_length=cap,
            min_decoding_length=0,
            suppress_sequences=banned,
            max_input_length=0,
        )
        got.append(bundle.tgt_tok.sp.piece_to_id(result.hypotheses[0]))
    mismatched = [i for i in range(len(ids)) if got[i] != expected[i]]
    assert len(ids) == 40 and mismatched == [], f"{len(mismatched)} of {len(ids)} greedy outputs differ"
    assert sum(map(len, expected)) / len(expected) > 5  # non-trivial outputs


def same_best(exported: Exported, decode: DecodeConfig) -> list[tuple[Translation, Translation]]:
    """(mtkit's, CTranslate2's) best translation of each of 40 lines where their texts agree.

    Also checks that an empty or blank line gives one empty translation, without the engine.
    """
    bundle = exported.bundle
    lines = [*exported.lines[:20], "", "  ", *exported.lines[20:]]
    expected = list(Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, decode, CPU).stream([lines]))
    got = list(CTranslate2Translator.from_dir(exported.ct2_dir, decode).stream([lines]))
    assert len(got) == len(lines) and got[20] == got[21] == [EMPTY]
    return [(e[0], g[0]) for e, g in zip(expected, got) if e[0].text == g[0].text and e[0] != EMPTY]


def assert_close_logprobs(pairs: list[tuple[Translation, Translation]]) -> None:
    for e, g in pairs:
        # Float rounding, and CTranslate2's renormalising after it bans pad and bos (higher by their share).
        assert -1e-3 < g.logprob - e.logprob < 0.01 * abs(e.logprob) + 1e-3


def test_greedy_translations_equal_mtkit_translations(exported):
    pairs = same_best(exported, DecodeConfig(beam=1))
    assert len(pairs) == 40
    assert_close_logprobs(pairs)


@pytest.mark.parametrize("lenpen", [0.0, 1.0])
def test_beam_best_equals_mtkit_beam_best(ending, lenpen):
    """39 of 40 agree. The two searches treat the length cap differently (see CTranslate2Translator): on line 21
    every hypothesis reaches it. Measured on the model whose hypotheses mostly end with eos, as the other's never do."""
    pairs = same_best(ending, DecodeConfig(beam=4, lenpen=lenpen))
    assert len(pairs) >= 39, f"{len(pairs)} of 40 best translations equal"
    assert_close_logprobs(pairs)


def test_beam_best_equals_mtkit_beam_best_at_the_power_length_penalty(ending):
    """With decode.length_penalty power, CTranslate2 searches under its own penalty, the same length ** lenpen, and
    finds what mtkit's search finds with early_stop false: 37 of 40 agree, the others at the length cap."""
    pairs = same_best(ending, DecodeConfig(beam=4, lenpen=1.0, length_penalty="power", early_stop=False))
    assert len(pairs) >= 37, f"{len(pairs)} of 40 best translations equal"
    assert_close_logprobs(pairs)


def test_nbest_lists_are_ranked_and_headed_by_the_best(exported):
    lines = exported.lines[:10]
    best = CTranslate2Translator.from_dir(exported.ct2_dir, DecodeConfig(beam=4))
    three = CTranslate2Translator.from_dir(exported.ct2_dir, DecodeConfig(beam=4), nbest=3)
    for one, hyps in zip(best.stream([lines]), three.stream([lines])):
        assert len(hyps) == 3 and hyps[0] == one[0]
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


class TorchOps(TorchDispatchMode):
    """Records every torch operator run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_translating_through_ctranslate2_runs_no_torch_op(ending):
    """torch's OpenMP threads spin after each op, and beside CTranslate2's on the same cores halve its speed."""
    translator = CTranslate2Translator.from_dir(ending.ct2_dir, DecodeConfig(beam=3), nbest=2)
    with TorchOps() as recorded:
        translations = translator.translate([*ending.lines[:8], "", "a" * 3000])
    assert len(translations) == 10 and translations[8] == ""
    assert recorded.ops == []


def test_batches_under_their_largest_cap_give_each_sentences_own_caps_search(exported):
    """A batch runs under the largest cap of its sentences and a sentence near its own cap runs again under it:
    the translations are those of one sentence at a time, each under its own cap (batches of one)."""
    decode = DecodeConfig(beam=4, max_len_a=0.5, max_len_b=4)  # caps that bind often, and differ within a batch
    batched = CTranslate2Translator.from_dir(exported.ct2_dir, decode, nbest=2)
    alone = CTranslate2Translator.from_dir(exported.ct2_dir, replace(decode, batch_size=1), nbest=2)
    lines = exported.lines
    for got, want in zip(batched.hypotheses(lines), alone.hypotheses(lines)):
        assert [t.text for t in got] == [t.text for t in want]
        for g, w in zip(got, want):
            assert math.isclose(g.logprob, w.logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_int8_export_translates_every_line(exported, tmp_path):
    int8_dir = export_ctranslate2(exported.run, tmp_path / "int8", "int8")
    assert json.loads((int8_dir / MANIFEST).read_text())["quantization"] == "int8"
    assert (int8_dir / "model.bin").stat().st_size < 0.5 * (exported.ct2_dir / "model.bin").stat().st_size
    lines = [*exported.lines, ""]
    results = list(CTranslate2Translator.from_dir(int8_dir, DecodeConfig(beam=4)).stream([lines]))
    assert len(results) == len(lines) and results[-1] == [EMPTY]
    assert all(len(r) == 1 and r[0].text and r[0].logprob < 0 for r in results[:-1])
    # --precision int8 computes a float32 export in int8, as the int8 export computes
    computed = mtkit.load(exported.ct2_dir, device="cpu", precision="int8", engine="ctranslate2", beam=4)
    assert computed.precision["precision"] == "int8"
    assert computed.translate(lines) == [r[0].text for r in results]


def test_overlong_line_is_truncated_as_mtkit_truncates_it(exported, caplog):
    long_line = " ".join(exported.lines[:20])  # well over model.max_positions source tokens
    bundle = exported.bundle
    decode = DecodeConfig(beam=1)
    expected = list(Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, decode, CPU).stream([[long_line]]))
    with caplog.at_level(logging.WARNING, logger="mtkit"):
        got = list(CTranslate2Translator.from_dir(exported.ct2_dir, decode).stream([["A dog.", long_line]]))
    assert got[1][0].text == expected[0][0].text
    assert "line 2:" in caplog.text and "truncated to 127" in caplog.text


def test_export_command_writes_a_folder_that_translates_and_can_be_replaced(joint, tmp_path):
    out = tmp_path / "ct2"
    for _ in range(2):  # the second export replaces the first
        result = invoke("export", joint, "--format", "ctranslate2", "-o", out)
        assert result.exit_code == 0, result.output
    assert "wrote" in result.stderr and "float32" in result.stderr
    names = {path.name for path in out.iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", MANIFEST, "spm.model"} <= names
    assert [path.name for path in tmp_path.iterdir()] == ["ct2"]  # no temporary folders left behind
    lines = ["A man in an orange hat.", "", "Two dogs play in the snow."]
    results = list(CTranslate2Translator.from_dir(out).stream([lines]))  # the run's decode settings
    assert [bool(r[0].text) for r in results] == [True, False, True]


def test_the_manifest_names_the_weights_by_digest_and_no_file_by_path(joint, tmp_path):
    """mtkit.json once recorded the path of the checkpoint on the exporter's machine; its recipients get the
    SHA-256 of the weights and their update step, and no file of the export holds a path."""
    out = tmp_path / "ct2"
    assert invoke("export", joint, "-o", out).exit_code == 0
    manifest = json.loads((out / MANIFEST).read_text())
    weights = loading.resolve(joint) / checkpoint.WEIGHTS_FILE
    assert manifest["weights_sha256"] == file_sha256(weights) and manifest["step"] == 1
    for path in out.iterdir():
        assert str(joint.parent).encode() not in path.read_bytes(), path.name


@pytest.mark.parametrize("kept", [0.0, 0.5, 0.9999], ids=["empty", "half", "all-but-the-end"])
def test_a_truncated_model_bin_is_one_error_line_naming_it(joint, tmp_path, kept):
    """A model.bin cut short (a copy that stopped) was a RuntimeError traceback."""
    out = export_ctranslate2(joint, tmp_path / "ct2")
    model = out / "model.bin"
    os.truncate(model, int(model.stat().st_size * kept))
    result = runner.invoke(app, ["translate", str(out), "--engine", "ctranslate2", "--device", "cpu"], input="A dog.\n")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith(f"error: {model}: CTranslate2 cannot load it on cpu ("), result.stderr


def test_a_shortlist_goes_with_the_export_as_ctranslate2s_vocabulary_map(
    joint, spm_model, corpus_files, tmp_path, monkeypatch
):
    monkeypatch.setattr(lexical, "CANDIDATE_MULTIPLE", 1)  # mtkit's exact candidates, as CTranslate2 takes them
    pairs = zip(corpus_files["train.en"].read_text().splitlines(), corpus_files["train.de"].read_text().splitlines())
    shortlist = lexical.build_shortlist(
        lexical.co_occurring_pairs(spm_model, spm_model, pairs), spm_model, spm_model, 3, 5
    )
    shortlist.save(tmp_path / "sl.safetensors")
    out = tmp_path / "ct2"
    result = invoke("export", joint, "-o", out, "--shortlist", tmp_path / "sl.safetensors")
    assert result.exit_code == 0, result.output
    assert "a vocabulary map" in result.stderr
    assert (out / VMAP).read_text(encoding="utf-8").startswith("\t<pad> <unk> <s> </s> ")

    lines = corpus_files["val.en"].read_text().splitlines()[:6]
    src, _ = source_tensor(spm_model.encode(lines))
    allowed = set(shortlist.candidates(src).ids.tolist())
    engine = ctranslate2.Translator(str(out), "cpu")
    pieces = [spm_model.sp.encode(line, out_type=str) for line in lines]
    narrowed = engine.translate_batch(pieces, beam_size=3, max_decoding_length=20, use_vmap=True)
    whole = engine.translate_batch(pieces, beam_size=3, max_decoding_length=20)
    ids = [spm_model.sp.piece_to_id(r.hypotheses[0]) for r in narrowed]
    assert all(set(seq) <= allowed for seq in ids)  # CTranslate2 reads the map as mtkit builds candidates
    assert any(not set(spm_model.sp.piece_to_id(r.hypotheses[0])) <= allowed for r in whole)  # and it narrows

    translator = CTranslate2Translator.from_dir(out, {"beam": 3}, use_vmap=True)
    assert len(translator.translate(lines)) == len(lines)
    plain = export_ctranslate2(joint, tmp_path / "plain")
    with pytest.raises(ConfigError, match="no vocabulary map"):
        CTranslate2Translator.from_dir(plain, use_vmap=True)
    result = invoke(
        "export", joint, "--format", "hf", "-o", tmp_path / "hf", "--shortlist", tmp_path / "sl.safetensors"
    )
    assert result.exit_code == 1 and result.stderr == (
        "error: --shortlist is for --format ctranslate2; a transformers export keeps the whole vocabulary\n"
    )


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--format", "onnx"], 2, "Invalid value for '--format'"),  # a usage error: the choices are the option's
        (["--quantization", "int4"], 1, "error: --quantization must be one of int8, "),
    ],
)
def test_bad_options_are_one_line_errors(joint, tmp_path, args, status, message):
    result = invoke("export", joint, "-o", tmp_path / "ct2", *args)
    assert result.exit_code == status
    assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "ct2").exists()


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ({"positions": "relative"}, "model.positions relative and model.attention_window 0"),
        ({"attention_window": 4}, "model.positions rotary and model.attention_window 4"),
    ],
)
def test_positions_ctranslate2_cannot_take_are_refused_before_writing(spm_model, tmp_path, model, named):
    run = rotary_run(tmp_path, spm_model, **model)
    result = invoke("export", run, "-o", tmp_path / "ct2")
    assert result.exit_code == 1 and result.stderr == (
        f"error: {run}: the CTranslate2 export takes sinusoidal, learned, rotary or fairseq positions and no "
        f"attention window; this model has {named}\n"
    )
    assert not (tmp_path / "ct2").exists()


def test_a_folder_that_is_not_an_export_is_never_replaced(joint, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = invoke("export", joint, "-o", tmp_path)
    assert result.exit_code == 1
    assert result.stderr == f"error: {tmp_path}: exists and is not an mtkit export; choose another output folder\n"
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_missing_ctranslate2_is_a_one_line_error(joint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    result = invoke("export", joint, "-o", tmp_path / "ct2")
    assert result.exit_code == 1
    assert result.stderr.strip().endswith("needs the ctranslate2 package: pip install ctranslate2")


def test_a_folder_without_a_readable_manifest_is_not_an_export(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="not an mtkit CTranslate2 export"):
        CTranslate2Translator.from_dir(tmp_path)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match="not readable JSON"):
        CTranslate2Translator.from_dir(tmp_path)


def test_export_has_help():
    result = invoke("export", "--help")
    assert result.exit_code == 0 and "--quantization" in result.output


def test_translate_with_the_ctranslate2_engine_matches_mtkit(ending):
    lines = ending.lines[:12] + ["", "   "]
    text = "".join(line + "\n" for line in lines)

    def translate(model, *options):
        args = ["translate", str(model), "--beam", "1", "--scores", "--device", "cpu", *options]
        result = runner.invoke(app, args, input=text)
        assert result.exit_code == 0, result.output
        return [row.split("\t") for row in result.stdout.splitlines()]

    mtkit_rows = translate(ending.run, "--precision", "fp32")  # as the export's weights
    ct2_rows = translate(ending.ct2_dir, "--engine", "ctranslate2")
    assert [t for _, t in ct2_rows] == [t for _, t in mtkit_rows]
    assert [float(lp) for lp, _ in ct2_rows] == pytest.approx([float(lp) for lp, _ in mtkit_rows], rel=1e-2, abs=1e-3)
    args = ["translate", str(ending.ct2_dir), "--engine", "ctranslate2", "--sample"]
    refused = runner.invoke(app, args, input="A.\n")
    assert refused.exit_code == 1 and "--engine ctranslate2 takes one model and no --sample" in refused.stderr


def test_an_output_folder_that_is_a_link_is_replaced_through_it(joint, tmp_path):
    """`-o LINK` to an earlier export replaces the export in the folder the link names and keeps the link; it once
    replaced the link itself, left `.LINK.old` behind and ended in "Cannot call rmtree on a symbolic link"."""
    (tmp_path / "exports").mkdir()
    (tmp_path / "current").symlink_to(tmp_path / "exports")
    for _ in range(2):  # the second export replaces the first, through the link
        result = invoke("export", joint, "-o", tmp_path / "current")
        assert result.exit_code == 0, result.output
    assert (tmp_path / "current").is_symlink() and (tmp_path / "exports" / MANIFEST).is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["current", "exports"]
    assert list(CTranslate2Translator.from_dir(tmp_path / "current").stream([["A dog."]]))
