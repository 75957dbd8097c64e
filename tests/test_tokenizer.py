"""SentencePiece models: round trip and the special ids every mtkit model shares."""

from __future__ import annotations

import pytest

from mtkit.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SpmOptions, Tokenizer, TokenizerError, train_spm


def test_round_trip_and_special_ids(spm_model, multi30k_slice):
    lines = multi30k_slice["train.de"].read_text().splitlines()[:50]
    assert spm_model.decode(spm_model.encode(lines)) == lines
    assert UNK_ID in spm_model.encode(["中"])[0]  # a character never seen in training
    sp = spm_model.sp
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert spm_model.vocab_size == 300


def test_bpe_and_seeded_sampling_are_reproducible(tmp_path, multi30k_slice):
    lines = multi30k_slice["train.en"].read_text().splitlines()
    options = SpmOptions(vocab_size=200, model_type="bpe", input_sentence_size=150, seed=7)
    a = train_spm(lines, tmp_path / "a", options)
    b = train_spm(lines, tmp_path / "b", options)
    pieces_a, pieces_b = (Tokenizer(p).sp for p in (a, b))
    assert [pieces_a.id_to_piece(i) for i in range(200)] == [pieces_b.id_to_piece(i) for i in range(200)]
    assert pieces_a.encode("A man rides a bike.", out_type=str)


def test_too_large_vocabulary_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="SentencePiece training failed"):
        train_spm(["a b c", "d e f"], tmp_path / "x", SpmOptions(vocab_size=5000))


def test_foreign_model_is_rejected(tmp_path):
    path = tmp_path / "junk.model"
    path.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer(path)
