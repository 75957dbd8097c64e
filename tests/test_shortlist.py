"""Vocabulary shortlists: built from real Multi30k pairs, searched over exactly, checked when loaded, on the CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import invoke, one_line_error, tiny_model, tiny_model_config
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mtkit import runtime
from mtkit.cli import app
from mtkit.config import ConfigError, DataConfig, DecodeConfig, RunConfig, SamplingConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import EOS_ID, Tokenizer
from mtkit.decoding import shortlist as lexical
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.line_translator import Translator
from mtkit.decoding.search import beam_search, sample_search
from mtkit.decoding.shortlist import ShortlistError
from mtkit.model.transformer import Candidates
from mtkit.training import run_directory

runner = CliRunner()
CPU = torch.device("cpu")


def pairs_of(paths: dict[str, Path], split: str = "train") -> list[tuple[str, str]]:
    src = paths[f"{split}.en"].read_text(encoding="utf-8").splitlines()
    return list(zip(src, paths[f"{split}.de"].read_text(encoding="utf-8").splitlines()))


def built(paths, tok: Tokenizer, per_source: int = 4, frequent: int = 10) -> lexical.Shortlist:
    chunks = lexical.co_occurring_pairs(tok, tok, pairs_of(paths))
    return lexical.build_shortlist(chunks, tok, tok, per_source, frequent)


@pytest.fixture(scope="module")
def shortlist(corpus_files, spm_model) -> lexical.Shortlist:
    return built(corpus_files, spm_model)


def test_each_source_token_keeps_its_strongest_co_occurring_targets(corpus_files, spm_model, shortlist):
    """Against Dice coefficients counted here by brute force: the listed targets are the best, best first."""
    pairs = [(set(s), set(t)) for s, t in zip(*(spm_model.encode(list(side)) for side in zip(*pairs_of(corpus_files))))]
    src_count = {s: sum(s in src for src, _ in pairs) for s in range(spm_model.vocab_size)}
    tgt_count = {t: sum(t in tgt for _, tgt in pairs) for t in range(spm_model.vocab_size)}
    checked = 0
    for s in range(spm_model.vocab_size):
        together: dict[int, int] = {}
        for src, tgt in pairs:
            if s in src:
                for t in tgt:
                    together[t] = together.get(t, 0) + 1
        dice = {t: 2 * c / (src_count[s] + tgt_count[t]) for t, c in together.items()}
        expected = sorted(dice, key=lambda t: (-dice[t], t))[:4]
        row = [t for t in shortlist.table[s].tolist() if t >= 0]
        assert row == expected, s
        checked += bool(row)
    assert checked > 100  # most pieces occur in the source side
    frequency = torch.bincount(
        torch.tensor([t for _, tgt in pairs_of(corpus_files) for t in spm_model.encode([tgt])[0]])
    )
    assert int(frequency.argmax()) in shortlist.always.tolist()
    assert {0, 1, 2, EOS_ID} <= set(shortlist.always.tolist())
    assert shortlist.always.numel() <= 10 + EOS_ID + 1


def multiply_through(library: str, monkeypatch) -> None:
    """Have fp32 decoding's products with the vocabulary, cut or whole, go through ``library`` on any CPU."""
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: "GenuineIntel" if library == "aten" else "AuthenticAMD")
    monkeypatch.setattr(runtime, "ONEDNN_MIN_WEIGHTS", 0)


@pytest.mark.parametrize("library", ["aten", "onednn"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_candidates_of_the_whole_vocabulary_search_exactly_as_without(
    corpus_files, spm_model, int8, library, monkeypatch
):
    """The cut output layer is the whole one: hypotheses, scores and n-best lists are the same, for an ensemble too."""
    multiply_through(library, monkeypatch)
    lines = corpus_files["val.en"].read_text().splitlines()[:12]
    src, mask = source_tensor(spm_model.encode(lines))
    vocab = spm_model.vocab_size
    decode = DecodeConfig(beam=4)
    for model in (model_of(vocab, (3,), int8), model_of(vocab, (3, 4), int8)):
        everything = Candidates(torch.arange(vocab))
        prefixes = [spm_model.encode(["Ein"])[0]] + [[]] * (len(lines) - 1)
        assert beam_search(model, src, mask, decode, 3, prefixes, everything) == beam_search(
            model, src, mask, decode, 3, prefixes
        )


def test_a_batchs_candidates_are_rounded_up_with_unused_ids(corpus_files, spm_model, shortlist, monkeypatch):
    src, _ = source_tensor(spm_model.encode(corpus_files["val.en"].read_text().splitlines()[:3]))
    monkeypatch.setattr(lexical, "CANDIDATE_MULTIPLE", 1)
    exact = shortlist.candidates(src).ids
    for multiple in (64, 1000):
        monkeypatch.setattr(lexical, "CANDIDATE_MULTIPLE", multiple)
        rounded = shortlist.candidates(src).ids
        assert rounded.numel() == min(-(-exact.numel() // multiple) * multiple, spm_model.vocab_size)
        assert set(exact.tolist()) <= set(rounded.tolist()) and rounded.unique().numel() == rounded.numel()
        assert torch.equal(rounded, rounded.sort().values)


def test_outputs_are_candidates_of_their_batch_and_forced_prefixes_still_lead(
    corpus_files, spm_model, shortlist, monkeypatch
):
    monkeypatch.setattr(lexical, "CANDIDATE_MULTIPLE", 1)  # the exact cut, far from the tiny vocabulary
    model = tiny_model(spm_model.vocab_size, seed=5)
    lines = corpus_files["val.en"].read_text().splitlines()[:8]
    src, mask = source_tensor(spm_model.encode(lines))
    candidates = shortlist.candidates(src)
    assert candidates.ids.numel() < spm_model.vocab_size / 2  # a real cut
    assert candidates.ids[: EOS_ID + 1].tolist() == list(range(EOS_ID + 1))  # special ids are their own columns
    hyps = beam_search(model, src, mask, DecodeConfig(beam=3), 3, candidates=candidates)
    allowed = set(candidates.ids.tolist())
    assert all(set(h.tokens) <= allowed for sentence in hyps for h in sentence)
    assert any(h.tokens for sentence in hyps for h in sentence)

    outside = next(t for t in range(EOS_ID + 1, spm_model.vocab_size) if t not in allowed)
    prefixes = [[outside, outside]] * len(lines)
    forced = beam_search(model, src, mask, DecodeConfig(beam=3), 1, prefixes, shortlist.candidates(src, prefixes))
    assert all(sentence[0].tokens[:2] == [outside, outside] for sentence in forced)

    for batch_prefixes in (None, prefixes):  # greedy over the candidates finds what beam 1 does
        cut = shortlist.candidates(src, batch_prefixes)
        greedy = sample_search(model, src, mask, None, DecodeConfig(beam=1), batch_prefixes, None, cut)
        beam = beam_search(model, src, mask, DecodeConfig(beam=1), 1, batch_prefixes, cut)
        assert greedy == [sentence[0] for sentence in beam]
        assert all(set(h.tokens) <= set(cut.ids.tolist()) for h in greedy)


def test_a_saved_shortlist_loads_the_same_and_a_bad_one_is_named(tmp_path, corpus_files, spm_model, shortlist):
    path = tmp_path / "shortlist.safetensors"
    shortlist.save(path)
    again = lexical.load_shortlist(path, spm_model, spm_model)
    assert torch.equal(again.table, shortlist.table) and torch.equal(again.always, shortlist.always)

    tensors, meta = load_file(path), {"format": lexical.FORMAT, "src_sha256": spm_model.sha256}
    meta["tgt_sha256"] = spm_model.sha256
    bad = {
        "other tokenizers": ({**meta, "tgt_sha256": "0" * 64}, tensors),
        "outside the target vocabulary": (meta, {**tensors, "table": tensors["table"] + 10_000}),
        "table has shape": (meta, {**tensors, "table": tensors["table"][:10]}),
        "always has shape": (meta, {**tensors, "always": torch.zeros(100_000, dtype=torch.int32)}),
        "not an mtkit shortlist": ({**meta, "format": "other"}, tensors),
    }
    for message, (metadata, contents) in bad.items():
        save_file(contents, str(path), metadata=metadata)
        with pytest.raises(ShortlistError, match=f"{path}: .*{message}"):
            lexical.load_shortlist(path, spm_model, spm_model)
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(ShortlistError, match="unreadable shortlist"):
        lexical.load_shortlist(path, spm_model, spm_model)
    with pytest.raises(ShortlistError, match="not found"):
        lexical.load_shortlist(tmp_path / "missing", spm_model, spm_model)


def test_sampling_has_no_shortlist(spm_model, shortlist):
    with pytest.raises(ConfigError, match="beam search"):
        Translator(
            tiny_model(spm_model.vocab_size),
            spm_model,
            spm_model,
            DecodeConfig(),
            CPU,
            1,
            SamplingConfig(),
            None,
            shortlist=shortlist,
        )


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_files, spm_model) -> Path:
    """A run directory whose config names the slice as its training data."""
    run = tmp_path_factory.mktemp("shortlisted") / "run"
    run.mkdir()
    shutil.copy(spm_model.path, run / spm_model.path.name)
    data = DataConfig(train_src=str(corpus_files["train.en"]), train_tgt=str(corpus_files["train.de"]))
    cfg = RunConfig(data=data, model=tiny_model_config())
    record = {"file": spm_model.path.name, "sha256": spm_model.sha256}
    meta = {"config": cfg.to_dict(), "tokenizer": {"src": record, "tgt": record}}
    model = tiny_model(spm_model.vocab_size, seed=6)
    run_directory.save_in_run(run, 1, model.state_dict(), meta, None, keep_last=0)
    return run


def training_pairs(corpus_files) -> list[str]:
    return ["--src", str(corpus_files["train.en"]), "--tgt", str(corpus_files["train.de"])]


def test_shortlist_command_builds_what_translate_uses(run, corpus_files, tmp_path):
    out = tmp_path / "sl.safetensors"
    options = ["-o", str(out), "--per-source", "3", "--frequent", "5", *training_pairs(corpus_files)]
    done = runner.invoke(app, ["shortlist", str(run), *options])
    assert done.exit_code == 0, done.output
    assert "3 candidates per source token" in done.output
    lines = corpus_files["val.en"].read_text().splitlines()
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines[:10] + ["", lines[10]]) + "\n", encoding="utf-8")
    hyp = tmp_path / "out.de"
    translate = ["translate", str(run), "--device", "cpu", "-i", str(source)]
    done = runner.invoke(app, [*translate, "-o", str(hyp), "--shortlist", str(out)])
    assert done.exit_code == 0, done.output
    outputs = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(outputs) == 12 and outputs[10] == ""

    missing = ["--src", str(tmp_path / "none.en"), "--tgt", str(corpus_files["train.de"])]
    for args, message in (
        ([*translate, "--shortlist", str(out), "--sample"], "beam search"),
        ([*translate, "--shortlist", str(tmp_path / "none")], "none"),
        (["shortlist", str(run), "-o", str(out), *missing], "none.en"),
    ):
        done = runner.invoke(app, args)
        assert done.exit_code == 1 and done.output.startswith("error: ") and message in done.output, done.output
    out.write_bytes(b"\0" * 64)
    done = runner.invoke(app, [*translate, "--shortlist", str(out)])
    assert done.exit_code == 1 and done.output.startswith(f"error: {out}: "), done.output


def test_shortlist_opens_no_training_data_its_checkpoint_names(run, corpus_files, tmp_path):
    """A header's paths are data: a downloaded checkpoint must not make mtkit read a file of the user's.
    They are shown as a hint, and the user names the training pairs."""
    out = tmp_path / "sl.safetensors"
    line = one_line_error(invoke("shortlist", run, "-o", out), "--src")
    assert repr(str(corpus_files["train.en"])) in line and repr(str(corpus_files["train.de"])) in line
    one_line_error(invoke("shortlist", run, "-o", out, "--src", corpus_files["train.en"]), "--tgt")
    assert not out.exists()


def test_a_shortlist_built_over_several_chunks_is_the_one_built_at_once(corpus_files, spm_model, monkeypatch):
    """Counts carried from chunk to chunk, and --pairs cutting the last chunk short, as ``CHUNK_PAIRS`` does with
    more pairs than a test can afford."""
    pairs = pairs_of(corpus_files)
    for first in (len(pairs), 150):
        whole = lexical.build_shortlist(
            lexical.co_occurring_pairs(spm_model, spm_model, pairs[:first]), spm_model, spm_model, 4
        )
        with monkeypatch.context() as small:
            small.setattr(lexical, "CHUNK_PAIRS", 64)
            chunks = list(lexical.co_occurring_pairs(spm_model, spm_model, pairs, first))
        assert [len(src) for src, _ in chunks] == [64] * (first // 64) + [first % 64]
        chunked = lexical.build_shortlist(chunks, spm_model, spm_model, 4)
        assert torch.equal(chunked.table, whole.table) and torch.equal(chunked.always, whole.always)


def model_of(vocab: int, seeds: tuple[int, ...], int8: bool = False):
    models = [tiny_model(vocab, seed=seed, int8=int8) for seed in seeds]
    return models[0] if len(models) == 1 else Ensemble(models)


def scores(hyps: list[list]) -> list[float]:
    return [value for sentence in hyps for h in sentence for value in (h.score, h.logprob)]


def masked(model, allowed: torch.Tensor, vocab: int):
    """``model`` (each member of an ensemble) with its logits outside ``allowed`` at -inf: the whole-vocabulary
    search that a search over the candidates ``allowed`` must equal."""
    mask = torch.full((vocab,), float("-inf"))
    mask[allowed] = 0.0
    for member in getattr(model, "members", [model]):
        member.decode = lambda *args, decode=member.decode: decode(*args) + mask
    return model


@pytest.mark.parametrize("library", ["aten", "onednn"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_a_real_cut_searches_as_the_whole_vocabulary_with_the_rest_masked(
    corpus_files, spm_model, shortlist, monkeypatch, int8, library
):
    """Outputs, n-best lists and scores of a cut to under half the vocabulary, against the full model's search
    with the other ids' logits at -inf: an id taken for another (a column for its id) changes them."""
    multiply_through(library, monkeypatch)
    monkeypatch.setattr(lexical, "CANDIDATE_MULTIPLE", 1)
    lines = corpus_files["val.en"].read_text().splitlines()[:12]
    src, mask = source_tensor(spm_model.encode(lines))
    prefixes = [spm_model.encode(["Ein Hund"])[0]] + [[]] * (len(lines) - 1)
    candidates = shortlist.candidates(src, prefixes)
    vocab = spm_model.vocab_size
    assert candidates.ids.numel() < vocab / 2, candidates.ids.numel()
    decode = DecodeConfig(beam=4, min_len=2, max_len_a=0.0, max_len_b=16)
    for seeds in ((3,), (3, 4)):  # one model, an ensemble
        cut = beam_search(model_of(vocab, seeds, int8), src, mask, decode, 3, prefixes, candidates)
        reference = beam_search(
            masked(model_of(vocab, seeds, int8), candidates.ids, vocab), src, mask, decode, 3, prefixes
        )
        assert [[h.tokens for h in sentence] for sentence in cut] == [[h.tokens for h in s] for s in reference]
        # The two project and normalise rows of other widths: scores agree up to float rounding.
        assert scores(cut) == pytest.approx(scores(reference), rel=1e-6, abs=1e-5)
        whole = beam_search(model_of(vocab, seeds, int8), src, mask, decode, 3, prefixes)
        assert reference != whole  # a cut that tells


def test_the_ctranslate2_engine_refuses_a_shortlist_for_the_exports_own_map(run, corpus_files, shortlist, tmp_path):
    """CTranslate2 applies the map `export --shortlist` stores (use_vmap); a shortlist file it would not apply."""
    path, export = tmp_path / "sl.safetensors", tmp_path / "ct2"
    shortlist.save(path)
    done = invoke("export", run, "-o", export, "--shortlist", path)
    assert done.exit_code == 0 and (export / "vmap.txt").is_file(), done.output
    out = tmp_path / "out.de"
    args = ["translate", export, "--engine", "ctranslate2", "-i", corpus_files["val.en"], "-o", out]
    one_line_error(invoke(*args, "--shortlist", path), "--engine ctranslate2", "--shortlist", "use_vmap")
    assert not out.exists()
