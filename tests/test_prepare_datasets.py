"""`mtkit prepare hf:...`: local folders laid out as Hub dataset repositories, and data files, through
``datasets``, offline, on captions (tests/captions.py)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import captions
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import invoke

import mtkit
from mtkit.files import file_sha256

pytestmark = pytest.mark.usefixtures("hf_offline")  # offline, with this test's own Arrow cache

CARD = """---
configs:
- config_name: de-en
  data_files:
  - split: train
    path: de-en/train-*
  - split: validation
    path: de-en/validation-*
  - split: test
    path: de-en/test-*
---
Captions, laid out as a Hub dataset repository.
"""
SIZES = {"train": 200, "validation": 30, "test": 30}
_CAPTIONS = captions.parallel(sum(SIZES.values()), seed=40)


def caption_pairs(split: str) -> list[tuple[str, str]]:
    """(en, de) caption pairs of a split (train, validation or test), as a Multi30k-like corpus would give."""
    start = sum(list(SIZES.values())[: list(SIZES).index(split)])
    return list(zip(*(_CAPTIONS[lang][start : start + SIZES[split]] for lang in ("en", "de"))))


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def hub_repository(folder: Path) -> Path:
    """A dataset card with a de-en config, and its parquet shards (train in two) with a translation column."""
    (folder / "de-en").mkdir(parents=True)
    (folder / "README.md").write_text(CARD, encoding="utf-8")
    for split in SIZES:
        pairs = caption_pairs(split)
        shards = [pairs[:100], pairs[100:]] if split == "train" else [pairs]
        for i, shard in enumerate(shards):
            rows = [{"translation": {"de": de, "en": en}} for en, de in shard]
            name = f"{split}-{i:05d}-of-{len(shards):05d}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), folder / "de-en" / name)
    return folder


def test_a_local_hub_repository_with_a_translation_column_is_prepared_once_and_recorded(tmp_path):
    repo, out = hub_repository(tmp_path / "repo"), tmp_path / "out"
    result = invoke("prepare", f"hf:{repo}", "--config", "de-en", "--langpair", "en-de", "--out", out)
    assert result.exit_code == 0, result.output
    assert f"hf:{repo} in {out}: train 200, valid 30, test 30 lines" in result.stdout
    assert lines(out / "valid.en") == [en for en, _ in caption_pairs("validation")]
    assert lines(out / "test.de") == [de for _, de in caption_pairs("test")]
    assert len(lines(out / "train.en")) == len(lines(out / "train.de")) == 200  # these 200 pass cleaning

    record = json.loads((out / "prepare.json").read_text())
    source = record["source"]
    assert source["revision"] is None and source["config"] == "de-en"  # local: no revision, checksums instead
    shards = sorted((repo / "de-en").glob("train-*"))
    assert source["data_files"]["train"] == [{"file": str(p), "sha256": file_sha256(p)} for p in shards]
    assert record["splits"]["valid"]["dataset_split"] == "validation" and record["splits"]["valid"]["rows"] == 30
    fingerprints = {split["fingerprint"] for split in record["splits"].values()}
    assert len(fingerprints) == 3 and all(isinstance(f, str) and f for f in fingerprints)
    assert record["splits"]["train"]["clean"]["read"] == 200

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = invoke("prepare", f"hf:{repo}", "--config", "de-en", "--langpair", "en-de", "--out", out)
    assert again.exit_code == 0 and "already prepared" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    reverse = invoke("prepare", f"hf:{repo}", "--config", "de-en", "--langpair", "de-en", "--out", tmp_path / "de_en")
    assert reverse.exit_code == 0, reverse.output
    assert lines(tmp_path / "de_en" / "test.de") == lines(out / "test.de")


def test_flat_columns_are_named_by_src_and_tgt_column(tmp_path):
    """FLORES-style columns, in a folder without a card: datasets finds the splits by the file names."""
    repo = tmp_path / "flores"
    repo.mkdir()
    for split in SIZES:
        english, german = zip(*caption_pairs(split))
        table = pa.table({"id": range(len(english)), "sentence_eng_Latn": english, "sentence_deu_Latn": german})
        pq.write_table(table, repo / f"{split}.parquet")
    columns = ["--src-column", "sentence_deu_Latn", "--tgt-column", "sentence_eng_Latn"]
    result = invoke("prepare", f"hf:{repo}", "--langpair", "de-en", *columns, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert lines(tmp_path / "out" / "test.de") == [de for _, de in caption_pairs("test")]
    assert lines(tmp_path / "out" / "test.en") == [en for en, _ in caption_pairs("test")]


def test_data_dir_picks_one_corpus_of_a_repository_that_holds_several(tmp_path):
    """The layout of a Hub parquet branch: one folder per corpus, one per split inside, no card."""
    repo = tmp_path / "multi"
    for corpus, swap in (("m30k-en-de", False), ("m30k-de-en", True)):
        for split in SIZES:
            (repo / corpus / split).mkdir(parents=True)
            rows = [
                {"translation": {"en": de if swap else en, "de": en if swap else de}} for en, de in caption_pairs(split)
            ]
            pq.write_table(pa.Table.from_pylist(rows), repo / corpus / split / "0000.parquet")
    out = tmp_path / "out"
    result = invoke("prepare", f"hf:{repo}", "--data-dir", "m30k-en-de", "--langpair", "en-de", "--out", out)
    assert result.exit_code == 0, result.output
    assert lines(out / "test.en") == [en for en, _ in caption_pairs("test")]
    assert json.loads((out / "prepare.json").read_text())["source"]["data_dir"] == "m30k-en-de"


def test_jsonl_data_files_with_columns_named_by_language(tmp_path):
    files = []
    for split in SIZES:
        path = tmp_path / f"{split}.jsonl"
        rows = (json.dumps({"en": en, "de": de}, ensure_ascii=False) for en, de in caption_pairs(split))
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
        files += ["--data-files", f"{split}={path}"]
    result = invoke("prepare", "hf:json", *files, "--langpair", "en-de", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert lines(tmp_path / "out" / "valid.de") == [de for _, de in caption_pairs("validation")]
    record = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert record["source"]["data_files"]["test"][0]["sha256"] == file_sha256(tmp_path / "test.jsonl")


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_csv_and_tsv_data_files(tmp_path, delimiter):
    suffix = "tsv" if delimiter == "\t" else "csv"
    files = []
    for split in ("train", "test"):
        path = tmp_path / f"{split}.{suffix}"
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter=delimiter)
            writer.writerow(["source", "target"])
            writer.writerows(caption_pairs(split))
        files += ["--data-files", f"{split}={path}"]
    columns = ["--src-column", "source", "--tgt-column", "target"]
    result = invoke(
        "prepare", "hf:csv", *files, *columns, "--splits", "train=train,test=test", "--langpair", "en-de",
        "--out", tmp_path / "out",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert lines(tmp_path / "out" / "test.en") == [en for en, _ in caption_pairs("test")]
    assert not (tmp_path / "out" / "valid.en").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--splits", "train=train,valid=dev"], r"no split dev \(splits: test, train, validation\)"),
        (["--langpair", "en-fr"], r"the translation column has no fr \(languages: de, en\)"),
        (["--src-column", "english", "--tgt-column", "german"], r"no column english, german \(columns: translation\)"),
        (["--langpair", "english"], r"needs --langpair SRC-TGT"),
    ],
)
def test_a_missing_split_language_or_column_is_one_error_line(tmp_path, args, expected):
    repo = hub_repository(tmp_path / "repo")
    options = {"--langpair": "en-de", "--config": "de-en"}
    for flag, value in zip(args[::2], args[1::2]):
        options[flag] = value
    result = invoke("prepare", f"hf:{repo}", *(x for kv in options.items() for x in kv), "--out", tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert re.search(expected, line), line
    assert not (tmp_path / "out" / "prepare.json").exists()


def test_an_unknown_dataset_offline_is_one_error_line(tmp_path):
    result = invoke("prepare", "hf:nobody/no-such-corpus", "--langpair", "en-de", "--out", tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert line.startswith("error: hf:nobody/no-such-corpus: cannot load the dataset (")


def test_a_row_without_text_on_one_side_is_named(tmp_path):
    rows = [{"en": en, "de": de} for en, de in caption_pairs("test")]
    rows[2]["de"] = None
    path = tmp_path / "test.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    result = invoke(
        "prepare", "hf:json", "--data-files", f"test={path}", "--splits", "test=test", "--langpair", "en-de",
        "--out", tmp_path / "out",
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == "error: hf:json test: row 3 has no text on both sides"


def test_rows_keep_their_order_across_shards_row_groups_and_batches_and_a_missing_side_is_named(tmp_path):
    """20,000 caption pairs in two parquet shards of 3,000-row groups, read back through the Arrow cache's
    10,000-row batches: every pair in its place; then one side missing in the second shard, named by its row."""
    text = captions.parallel(20_000, seed=41)
    pairs = list(zip(text["en"], text["de"]))
    repo = tmp_path / "repo"

    def write_shards() -> None:
        (repo / "de-en").mkdir(parents=True, exist_ok=True)
        for i, shard in enumerate([pairs[:12_000], pairs[12_000:]]):
            rows = [{"translation": {"de": de, "en": en}} for en, de in shard]
            pq.write_table(pa.Table.from_pylist(rows), repo / "de-en" / f"test-{i:05d}-of-00002.parquet", 3_000)

    write_shards()
    args = ["--splits", "test=test", "--langpair", "en-de", "--data-files", f"test={repo}/de-en/test-*"]
    result = invoke("prepare", "hf:parquet", *args, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert lines(tmp_path / "out" / "test.en") == [en for en, _ in pairs]
    assert lines(tmp_path / "out" / "test.de") == [de for _, de in pairs]

    pairs[12_344] = (pairs[12_344][0], None)
    write_shards()
    result = invoke("prepare", "hf:parquet", *args, "--out", tmp_path / "missing")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == "error: hf:parquet test: row 12345 has no text on both sides"


def test_the_python_api_prepares_an_hf_corpus_as_the_command_does(tmp_path):
    repo = hub_repository(tmp_path / "repo")
    record = mtkit.prepare(f"hf:{repo}", tmp_path / "api", config="de-en", src_lang="en", tgt_lang="de", max_ratio=9.0)
    assert invoke("prepare", f"hf:{repo}", "--config", "de-en", "--langpair", "en-de", "--max-ratio", "9",
                  "--out", tmp_path / "cli").exit_code == 0  # fmt: skip
    for name in ("train.en", "train.de", "valid.de", "test.en"):
        assert lines(tmp_path / "api" / name) == lines(tmp_path / "cli" / name)
    assert record["splits"]["train"]["lines"] == len(lines(tmp_path / "api" / "train.en"))
    with pytest.raises(mtkit.MtkitError, match="hf: corpora only"):
        mtkit.prepare("multi30k_en_de", tmp_path / "x", config="de-en")
