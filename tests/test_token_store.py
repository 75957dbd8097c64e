"""The encoded training store: exact ids on disk, reuse across runs, whole-or-nothing writes, bounded memory."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import tracemalloc

import numpy as np
import pytest
import torch
import yaml
from helpers import invoke, small_config

from mtkit import progress
from mtkit.data import token_store
from mtkit.data.parallel import DataError, collate, iter_parallel, read_parallel
from mtkit.data.token_store import TokenStore, open_or_build, store_key
from mtkit.data.tokenizer import Tokenizer
from mtkit.training.trainer import Trainer


def build(cache, paths, tok: Tokenizer, pairs=None, max_tokens: int = 30, max_ratio: float = 2.0) -> TokenStore:
    files = [paths["train.en"], paths["train.de"]]
    key = store_key(files, tok, tok, max_tokens, max_ratio)
    pairs = iter_parallel(*files) if pairs is None else pairs
    return open_or_build(cache, pairs, key, tok, tok)


class Counted:
    """Pairs that count how many were read, to tell an encoding from a reuse."""

    def __init__(self, pairs) -> None:
        self.pairs, self.read = iter(pairs), 0

    def __iter__(self):
        for pair in self.pairs:
            self.read += 1
            yield pair


def test_store_holds_exactly_the_kept_pairs_ids_in_two_bytes(tmp_path, corpus_files, spm_model):
    store = build(tmp_path, corpus_files, spm_model)
    src_lines, tgt_lines = read_parallel(corpus_files["train.en"], corpus_files["train.de"])
    expected = [
        (s, t)
        for s, t in zip(spm_model.encode(src_lines), spm_model.encode(tgt_lines))
        if s and t and max(len(s), len(t)) <= 30 and max(len(s), len(t)) <= 2.0 * min(len(s), len(t))
    ]
    assert 0 < len(expected) < 400  # the filters really dropped some
    assert len(store) == len(expected) == store.meta["pairs"]
    assert [(store.sentence("src", i), store.sentence("tgt", i)) for i in range(len(store))] == expected
    report = store.report
    assert report.kept + report.empty + report.too_long + report.bad_ratio == store.meta["read"] == 400
    tokens = sum(len(s) for s, _ in expected)
    assert store.meta["src_tokens"] == tokens and (store.directory / "src.ids").stat().st_size == 2 * tokens
    assert store.ids["src"].dtype == np.uint16

    indices = store.batch_indices(256, seed=3)[0]
    batch = store.collate(indices)
    reference = collate([expected[i][0] for i in indices], [expected[i][1] for i in indices])
    assert all(torch.equal(a, b) for a, b in zip(vars(batch).values(), vars(reference).values()))
    assert store.target_tokens(indices) == batch.target_tokens


def test_on_a_terminal_encoding_shows_the_pairs_out_of_the_source_lines(
    tmp_path, corpus_files, spm_model, caplog, capsys, terminal
):
    with caplog.at_level(logging.INFO, logger="mtkit"):
        build(tmp_path, corpus_files, spm_model)
    [bar] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("encoding the training pairs")]
    assert "100% 400/400 pairs" in bar


def test_off_a_terminal_a_long_encoding_logs_the_pairs_done_now_and_then(
    tmp_path, corpus_files, spm_model, caplog, monkeypatch
):
    monkeypatch.setattr(token_store, "CHUNK_PAIRS", 150)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)  # each chunk is "a while"
    with caplog.at_level(logging.INFO, logger="mtkit"):
        build(tmp_path, corpus_files, spm_model)
    done = [m for m in caplog.messages if m.startswith("encoding the training pairs")]
    assert done == [f"encoding the training pairs: {n} pairs" for n in (150, 300, 400)]


def test_same_inputs_reuse_the_store_and_a_changed_file_or_filter_does_not(tmp_path, corpus_files, spm_model):
    first = build(tmp_path, corpus_files, spm_model)
    again = Counted(iter_parallel(corpus_files["train.en"], corpus_files["train.de"]))
    assert build(tmp_path, corpus_files, spm_model, pairs=again).directory == first.directory
    assert again.read == 0

    other_filter = build(tmp_path, corpus_files, spm_model, max_tokens=200, max_ratio=3.0)
    assert other_filter.directory != first.directory and len(other_filter) > len(first)

    changed = dict(corpus_files, **{"train.en": tmp_path / "train.en", "train.de": tmp_path / "train.de"})
    for side in ("en", "de"):
        changed[f"train.{side}"].write_text(corpus_files[f"train.{side}"].read_text().replace("dog", "cat"))
    assert build(tmp_path, changed, spm_model).directory != first.directory


def test_encoding_that_fails_midway_leaves_no_store(tmp_path, corpus_files, spm_model, monkeypatch):
    monkeypatch.setattr(token_store, "CHUNK_PAIRS", 50)

    def broken():
        yield from itertools.islice(iter_parallel(corpus_files["train.en"], corpus_files["train.de"]), 120)
        raise DataError("train.de:121: invalid UTF-8")

    with pytest.raises(DataError, match="121"):
        build(tmp_path, corpus_files, spm_model, pairs=broken())
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    assert len(build(tmp_path, corpus_files, spm_model)) == len(build(tmp_path / "b", corpus_files, spm_model))


def test_runs_starting_together_encode_once(tmp_path, corpus_files, spm_model):
    readers = [Counted(iter_parallel(corpus_files["train.en"], corpus_files["train.de"])) for _ in range(3)]
    stores = [None] * 3

    def start(i: int) -> None:
        stores[i] = build(tmp_path, corpus_files, spm_model, pairs=readers[i])

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.read for r in readers) == [0, 0, 400]
    assert len({s.directory for s in stores}) == 1


def test_no_pair_left_after_filtering_is_a_data_error(tmp_path, corpus_files, spm_model):
    with pytest.raises(DataError, match=r"train\.en and .*train\.de: no usable training pairs"):
        build(tmp_path, corpus_files, spm_model, max_tokens=1)


def test_encoding_memory_does_not_grow_with_the_corpus(tmp_path, corpus_files, spm_model, monkeypatch):
    """Python-side peak memory per extra pair stays at a few bytes (lengths), far below holding the corpus."""
    monkeypatch.setattr(token_store, "CHUNK_PAIRS", 500)
    base = list(iter_parallel(corpus_files["train.en"], corpus_files["train.de"]))

    def peak(n: int) -> int:
        pairs = ((f"{s} {i}", f"{t} {i}") for i, (s, t) in enumerate(itertools.islice(itertools.cycle(base), n)))
        tracemalloc.start()
        build(tmp_path / str(n), corpus_files, spm_model, pairs=pairs, max_tokens=200, max_ratio=3.0)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(2_000), peak(20_000)
    per_pair = (large - small) / 18_000
    assert per_pair < 64, f"{per_pair:.0f} bytes of peak memory per extra pair"


def test_a_second_run_on_the_same_data_reuses_the_encoding(tmp_path, corpus_files, spm_model, encoding_cache):
    cfg = small_config(corpus_files, spm_model, max_steps=1)
    first = Trainer(cfg, tmp_path / "a")
    meta = first.corpus.directory / "meta.json"
    stamp = meta.stat().st_mtime_ns
    second = Trainer(cfg, tmp_path / "b")
    assert second.corpus.directory == first.corpus.directory and meta.stat().st_mtime_ns == stamp
    assert json.loads(meta.read_text())["key"]["src_tokenizer"] == spm_model.sha256
    assert first.corpus.directory.parent == encoding_cache


def test_a_damaged_store_is_encoded_again(tmp_path, corpus_files, spm_model):
    store = build(tmp_path, corpus_files, spm_model)
    pairs = [(store.sentence("src", i), store.sentence("tgt", i)) for i in range(len(store))]
    ids = store.directory / "tgt.ids"
    ids.write_bytes(ids.read_bytes()[:-2])  # one token lost, as a bad copy would lose it
    with pytest.raises(DataError, match="damaged token store"):
        TokenStore(store.directory)
    again = build(tmp_path, corpus_files, spm_model)
    assert again.directory == store.directory
    assert [(again.sentence("src", i), again.sentence("tgt", i)) for i in range(len(again))] == pairs


def test_ids_overwritten_in_place_are_caught_when_the_store_opens(tmp_path, corpus_files, spm_model):
    """Ids beyond the vocabulary (a store edited or damaged in place, same size) once crashed training
    with an IndexError; now the store is found damaged and encoded again."""
    store = build(tmp_path, corpus_files, spm_model)
    pairs = [(store.sentence("src", i), store.sentence("tgt", i)) for i in range(len(store))]
    ids = np.memmap(store.directory / "src.ids", dtype=np.uint16, mode="r+")
    ids[10] = 65_000
    ids.flush()
    del ids
    with pytest.raises(DataError, match=r"damaged token store \(src ids outside the vocabulary of 300\)"):
        TokenStore(store.directory, (spm_model.vocab_size, spm_model.vocab_size))
    again = build(tmp_path, corpus_files, spm_model)
    assert [(again.sentence("src", i), again.sentence("tgt", i)) for i in range(len(again))] == pairs


@pytest.mark.parametrize(
    "edit",
    [
        lambda meta: meta["dtype"].update(src="object"),
        lambda meta: meta["dtype"].update(src="../../x"),
        lambda meta: meta.update(pairs="many"),
        lambda meta: meta.pop("filter"),
        lambda meta: meta["filter"].update(kept=None),
    ],
    ids=["dtype-object", "dtype-path", "pairs-text", "no-filter", "kept-none"],
)
def test_an_edited_meta_json_makes_the_store_one_to_encode_again(tmp_path, corpus_files, spm_model, edit):
    store = build(tmp_path, corpus_files, spm_model)
    meta = json.loads((store.directory / "meta.json").read_text())
    edit(meta)
    (store.directory / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="unreadable token store"):
        TokenStore(store.directory)
    assert len(build(tmp_path, corpus_files, spm_model)) == len(store)


def test_training_on_a_store_with_ids_beyond_the_vocabulary_encodes_it_again(tmp_path, corpus_files, spm_model):
    """Through the command line: such a store once crashed `mtkit train` with an IndexError."""
    raw = small_config(corpus_files, spm_model, max_steps=2).to_dict()
    raw["data"]["cache_dir"] = str(tmp_path / "encoded")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert invoke("train", config, "--out", tmp_path / "a").exit_code == 0
    (store,) = [path for path in (tmp_path / "encoded").iterdir() if path.is_dir()]
    ids = np.memmap(store / "tgt.ids", dtype=np.uint16, mode="r+")
    ids[:] = 60_000
    ids.flush()
    del ids
    result = invoke("train", config, "--out", tmp_path / "b")
    assert result.exit_code == 0, result.output
    assert "damaged token store (tgt ids outside the vocabulary of 300); encoding it again" in result.stderr


def test_resuming_after_a_training_file_was_edited_warns_naming_it(tmp_path, corpus_files, spm_model):
    """The edited file is encoded again, as always, with a warning naming it; the run refuses to resume on it."""
    train = {side: tmp_path / f"train.{side}" for side in ("en", "de")}
    for side, path in train.items():
        path.write_text(corpus_files[f"train.{side}"].read_text(encoding="utf-8"), encoding="utf-8")
    raw = small_config(dict(corpus_files, **{"train.en": train["en"], "train.de": train["de"]}), spm_model).to_dict()
    raw["data"]["cache_dir"] = str(tmp_path / "encoded")
    raw["train"]["max_steps"] = 2
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    first = invoke("train", config, "--out", tmp_path / "run")
    assert first.exit_code == 0 and "changed since" not in first.stderr
    train["en"].write_text(train["en"].read_text(encoding="utf-8").replace("dog", "cat"), encoding="utf-8")
    resumed = invoke("train", config, "--out", tmp_path / "run", "--set", "train.max_steps=4")
    assert resumed.exit_code == 1, resumed.output
    assert f"error: {tmp_path / 'run'}" in resumed.stderr and "trained on another data.train_src" in resumed.stderr
    [warning] = [line for line in resumed.stderr.splitlines() if " WARNING " in line and "changed since" in line]
    assert f"training data: {train['en'].resolve()} changed since an earlier run encoded it" in warning
    assert str(train["de"].resolve()) not in warning
