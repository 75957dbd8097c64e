"""Reading, filtering and batching parallel text."""

from __future__ import annotations

import gzip

import captions
import numpy as np
import pytest

from mtkit.data.parallel import DataError, collate, filter_pairs, read_lines, read_parallel, token_batches
from mtkit.data.sampling import CorpusMix, corpus_probabilities
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


def test_collate_shifts_target_and_marks_padding():
    batch = collate([[7, 8, 9], [7]], [[5, 6], [5, 6, 7]])
    assert batch.src.tolist() == [[7, 8, 9, EOS_ID], [7, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.src_pad_mask.tolist() == [[False] * 4, [False, False, True, True]]  # True = padding
    assert batch.tgt_in.tolist() == [[BOS_ID, 5, 6, PAD_ID], [BOS_ID, 5, 6, 7]]
    assert batch.tgt_out.tolist() == [[5, 6, EOS_ID, PAD_ID], [5, 6, 7, EOS_ID]]
    assert batch.target_tokens == 7


def test_token_batches_respect_budget_cover_everything_once_and_vary_by_seed():
    lengths = [3, 17, 5, 9, 9, 2, 30, 12, 4, 8] * 20
    batches = token_batches(lengths, lengths[::-1], batch_tokens=64, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(max(lengths[i], lengths[::-1][i]) + 1 for i in b)
        assert longest * len(b) <= 64 or len(b) == 1
    again = token_batches(lengths, lengths[::-1], 64, seed=1)
    assert [b.tolist() for b in again] == [b.tolist() for b in batches]
    other = token_batches(lengths, lengths[::-1], 64, seed=2)
    assert [b.tolist() for b in other] != [b.tolist() for b in batches]


def test_sorted_batches_keep_padding_small():
    lengths = [(i * 7919) % 40 + 1 for i in range(2000)]
    batches = token_batches(lengths, lengths, batch_tokens=512, seed=0)
    real = sum(lengths) + len(lengths)
    padded = sum(max(lengths[i] + 1 for i in b) * len(b) for b in batches)
    assert real / padded > 0.9


def test_batches_of_real_sentence_pairs_pad_little_on_either_side():
    """English and German lengths differ pair by pair, so sorting by one side alone pads the other."""
    text = captions.parallel(8000, seed=8)
    src = [len(line.split()) for line in text["en"]]
    tgt = [len(line.split()) for line in text["de"]]
    batches = token_batches(src, tgt, batch_tokens=2000, seed=0)

    def fill(lengths):
        real = sum(lengths) + len(lengths)
        return real / sum((max(lengths[i] for i in b) + 1) * len(b) for b in batches)

    assert fill(tgt) > 0.97
    assert fill(src) > 0.88


def test_an_over_budget_pair_still_forms_a_batch():
    assert [b.tolist() for b in token_batches([100], [100], batch_tokens=10, seed=0)] == [[0]]


def test_filter_counts_each_reason():
    src = [[1], [], [1] * 50, [1, 2], [1] * 10]
    tgt = [[1], [1], [1] * 3, [1, 2, 3], [1]]
    kept_src, _, report = filter_pairs(src, tgt, max_tokens=20, max_ratio=3.0)
    assert (report.kept, report.empty, report.too_long, report.bad_ratio) == (2, 1, 1, 1)
    assert kept_src == [[1], [1, 2]]
    assert "dropped 3" in report.describe()


def test_gzip_is_read_transparently(tmp_path):
    path = tmp_path / "a.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("Ein Hund.\nZwei Katzen.\n")
    assert read_lines(path) == ["Ein Hund.", "Zwei Katzen."]


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.en"
    path.write_bytes(b"fine\nalso fine\nbroken \xff here\n")
    with pytest.raises(DataError, match=r"bad\.en:3: invalid UTF-8"):
        read_lines(path)


def test_mismatched_parallel_files_name_both_files_and_counts(tmp_path):
    (tmp_path / "a.en").write_text("1\n2\n3\n")
    (tmp_path / "a.de").write_text("1\n2\n")
    with pytest.raises(DataError, match=r"a\.en has 3 lines, .*a\.de has 2"):
        read_parallel(tmp_path / "a.en", tmp_path / "a.de")


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "e.en").write_text("")
    (tmp_path / "e.de").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        read_parallel(tmp_path / "e.en", tmp_path / "e.de")
    with pytest.raises(DataError, match="file not found"):
        read_lines(tmp_path / "nope.en")


def test_tsv_holds_both_sides(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("a dog\tein Hund\ntwo cats\tzwei Katzen\n")
    assert read_parallel(path, "") == (["a dog", "two cats"], ["ein Hund", "zwei Katzen"])
    path.write_text("a dog\tein Hund\nno tab here\n")
    with pytest.raises(DataError, match=r"train\.tsv:2: expected 2 tab-separated columns"):
        read_parallel(path, "")


class _OneBatchStore:
    """What CorpusMix asks of a token store: one batch an epoch."""

    def batch_indices(self, batch_tokens: int, seed: int) -> list[np.ndarray]:
        return [np.array([0])]


def test_corpus_shares_stay_probabilities_at_small_temperatures_and_large_weights():
    """Computed in log space: neither 0.5 ** 10,000 (underflow, 0 / 0) nor 1e307 * 300 (overflow) makes them NaN."""
    assert corpus_probabilities([100, 100], [1, 1], 1e-4).tolist() == [0.5, 0.5]
    assert corpus_probabilities([100, 300, 300], [1, 1, 1], 1e-300).tolist() == [0.0, 0.5, 0.5]
    assert corpus_probabilities([100, 300], [1e307, 1e307], 1.0) == pytest.approx([0.25, 0.75])
    assert corpus_probabilities([2, 1], [1, 1e300], 1e-3).tolist() == [0.0, 1.0]
    mix = CorpusMix([_OneBatchStore(), _OneBatchStore()], corpus_probabilities([9, 9], [1, 1], 1e-4), 100, seed=1)
    drawn = [mix.corpus_of(draw) for draw in range(200)]
    assert 60 < drawn.count(0) < 140  # both corpora, as equal shares draw them, not the last one every time
