"""SentencePiece models: round trip and the special ids every mtkit model shares."""

from __future__ import annotations

import logging

import pytest
from helpers import invoke, write_config

from mtkit.config import TokenizerConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, TokenizerError, train_spm


def test_round_trip_and_special_ids(spm_model, corpus_files):
    lines = corpus_files["train.de"].read_text().splitlines()[:50]
    assert spm_model.decode(spm_model.encode(lines)) == lines
    assert UNK_ID in spm_model.encode(["中"])[0]  # a character never seen in training
    sp = spm_model.sp
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert spm_model.vocab_size == 300


def test_bpe_and_seeded_sampling_are_reproducible(tmp_path, corpus_files):
    lines = corpus_files["train.en"].read_text().splitlines()
    options = TokenizerConfig(vocab_size=200, type="bpe", input_sentence_size=150, seed=7)
    a = train_spm(lines, tmp_path / "a", options)
    b = train_spm(lines, tmp_path / "b", options)
    pieces_a, pieces_b = (Tokenizer(p).sp for p in (a, b))
    assert [pieces_a.id_to_piece(i) for i in range(200)] == [pieces_b.id_to_piece(i) for i in range(200)]
    assert pieces_a.encode("A man rides a bike.", out_type=str)


def test_training_logs_the_sentences_read_then_the_training(tmp_path, corpus_files, caplog):
    lines = corpus_files["train.en"].read_text().splitlines()
    with caplog.at_level(logging.INFO, logger="mtkit"):
        train_spm(["", *lines], tmp_path / "spm", TokenizerConfig(vocab_size=200))
    started, read, training, trained = caplog.messages[-4:]
    assert (started, training) == ("reading sentences for spm.model", "training spm.model (200 pieces)")
    assert read.startswith(f"reading sentences for spm.model: {len(lines)} sentences in ")  # the blank one skipped
    assert trained.startswith("training spm.model (200 pieces): done in ")


def test_on_a_terminal_training_shows_the_sentences_read_and_the_training(
    tmp_path, corpus_files, caplog, capsys, terminal
):
    lines = corpus_files["train.en"].read_text().splitlines()
    with caplog.at_level(logging.INFO, logger="mtkit"):
        train_spm(lines, tmp_path / "spm", TokenizerConfig(vocab_size=200))
    shown = capsys.readouterr().err
    assert f"reading sentences for spm.model {len(lines)} sentences" in shown
    assert "training spm.model (200 pieces)" in shown and not caplog.messages  # the display replaces the log


def test_too_large_vocabulary_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="SentencePiece training failed"):
        train_spm(["a b c", "d e f"], tmp_path / "x", TokenizerConfig(vocab_size=5000))


def test_foreign_model_is_rejected(tmp_path):
    path = tmp_path / "junk.model"
    path.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer(path)


def test_the_same_text_and_settings_give_a_byte_identical_model(tmp_path, corpus_files):
    """SentencePiece once stored its random temporary output folder inside the model, so no two were equal."""
    src, tgt = corpus_files["train.en"], corpus_files["train.de"]
    for name in ("a", "b"):
        result = invoke("tokenizer", "train", "--src", src, "--tgt", tgt, "-o", tmp_path / name, "--vocab-size", 250)
        assert result.exit_code == 0, result.output
    for suffix in ("model", "vocab"):
        assert (tmp_path / "a" / f"spm.{suffix}").read_bytes() == (tmp_path / "b" / f"spm.{suffix}").read_bytes()
    vocab = (tmp_path / "a" / "spm.vocab").read_text().splitlines()
    assert len(vocab) == 250 and vocab[:4] == ["<pad>\t0", "<unk>\t0", "<s>\t0", "</s>\t0"]


def test_runs_of_one_recipe_with_other_seeds_share_tokenizer_and_store_so_they_ensemble(tmp_path, corpus_files):
    """Two runs differing only in train.seed once had tokenizers of different SHA-256: their ensemble was
    refused and each encoded the corpus into a store of its own."""
    cache = tmp_path / "encoded"
    config = write_config(tmp_path / "c.yaml", corpus_files, data={"cache_dir": str(cache)}, train={"max_steps": 2})
    for seed in (1, 2):
        result = invoke("train", config, "--out", tmp_path / f"seed{seed}", "--set", f"train.seed={seed}")
        assert result.exit_code == 0, result.output
    assert (tmp_path / "seed1" / "spm.model").read_bytes() == (tmp_path / "seed2" / "spm.model").read_bytes()
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    result = invoke(
        "translate", tmp_path / "seed1", tmp_path / "seed2", "--beam", 2, "--device", "cpu", input="A dog runs.\n"
    )
    assert result.exit_code == 0 and result.stdout.count("\n") == 1, result.output
    last = [tmp_path / f"seed{seed}" / "checkpoints" / "update-00000002" for seed in (1, 2)]
    average = invoke("average", *last, "-o", tmp_path / "avg.safetensors")
    assert average.exit_code == 0, average.output
