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
from helpers import invoke

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


# -- bad local datasets: one error line naming the file, nothing run, nothing read outside the folder ----------


def _jsonl_folder(folder: Path, name: str = "train.jsonl") -> Path:
    """A folder holding ``name``: the train split's caption pairs as jsonl, one column per language."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps({"en": en, "de": de}, ensure_ascii=False) for en, de in caption_pairs("train"))
    (folder / name).write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


def _script(repo: Path, marker: Path) -> Path:
    _jsonl_folder(repo)
    (repo / f"{repo.name}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n", encoding="utf-8")
    return repo / f"{repo.name}.py"


def _string_translation(repo: Path, marker: Path) -> Path:
    repo.mkdir()
    rows = (json.dumps({"translation": f"{en} ||| {de}"}) for en, de in caption_pairs("train"))
    (repo / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return repo / "train.jsonl"


def _latin1(repo: Path, marker: Path) -> Path:
    _jsonl_folder(repo)
    with open(repo / "train.jsonl", "ab") as f:
        f.write(b'{"en": "a caf\xe9", "de": "ein Caf\xe9"}\n')  # Latin-1, line 201
    return repo / "train.jsonl"


def _corrupt_parquet(repo: Path, marker: Path) -> Path:
    repo.mkdir()
    english, german = zip(*caption_pairs("train"))
    pq.write_table(pa.table({"en": english, "de": german}), repo / "train.parquet")
    data = (repo / "train.parquet").read_bytes()
    (repo / "train.parquet").write_bytes(data[: len(data) // 2])  # cut short: no footer
    return repo / "train.parquet"


def _bad_card(front_matter: str):
    def make(repo: Path, marker: Path) -> Path:
        _jsonl_folder(repo)
        (repo / "README.md").write_text(f"---\n{front_matter.format(marker=marker)}\n---\n# A card\n", encoding="utf-8")
        return repo / "README.md"

    return make


def _empty_split(repo: Path, marker: Path) -> Path:
    repo.mkdir()
    (repo / "train.jsonl").write_bytes(b"")
    return repo / "train.jsonl"


@pytest.mark.parametrize(
    "make, expected",
    [
        (_script, "a dataset loading script; mtkit never runs one"),
        (_string_translation, "the translation column holds string, not {language: text}"),
        (_latin1, ":201: not UTF-8 text"),
        (_corrupt_parquet, "not a readable parquet file"),
        (_bad_card("configs: [unclosed\n  - : :"), "unreadable YAML front matter, line 3"),
        (_bad_card('x: !!python/object/apply:os.system ["touch {marker}"]'), "could not determine a constructor"),
        (_empty_split, "an empty file"),
        (None, "not a data file (--data-files takes .parquet, .jsonl, .json, .csv or .tsv files, compressed or not)"),
    ],
    ids=[
        "loading-script",
        "translation-no-language",
        "non-utf8-jsonl",
        "corrupt-parquet",
        "invalid-yaml-card",
        "python-tag-card",
        "empty-split",
        "data-files-etc-passwd",
    ],  # fmt: skip
)
def test_a_bad_local_dataset_is_one_error_line_naming_the_file_and_nothing_in_it_runs(tmp_path, make, expected):
    marker = tmp_path / "ran"
    if make is None:
        bad, args = Path("/etc/passwd"), ["hf:json", "--data-files", "train=/etc/passwd"]
    else:
        bad = make(tmp_path / "repo", marker)
        args = [f"hf:{tmp_path / 'repo'}"]
    result = invoke("prepare", *args, "--splits", "train=train", "--langpair", "en-de", "--out", tmp_path / "out")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception  # no traceback
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert str(bad) in line and expected in line, line
    assert not marker.exists() and not (tmp_path / "out" / "prepare.json").exists()


def _card_path(where: str):
    """A card whose train split is the file ``where`` names ("relative": ../outside.jsonl, "absolute")."""

    def make(repo: Path, outside: Path) -> Path:
        repo.mkdir()
        path = "../outside.jsonl" if where == "relative" else str(outside)
        card = f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: {path}\n---\n"
        (repo / "README.md").write_text(card, encoding="utf-8")
        return repo / path

    return make


def _symlink(repo: Path, outside: Path) -> Path:
    repo.mkdir()
    (repo / "train.jsonl").symlink_to(outside)
    return repo / "train.jsonl"


@pytest.mark.parametrize("make", [_card_path("relative"), _card_path("absolute"), _symlink],
                         ids=["dot-dot", "absolute", "symlink"])  # fmt: skip
def test_a_folder_naming_a_file_outside_itself_is_refused(tmp_path, make):
    outside = _jsonl_folder(tmp_path, "outside.jsonl") / "outside.jsonl"
    named = make(tmp_path / "repo", outside)
    result = invoke("prepare", f"hf:{tmp_path / 'repo'}", "--splits", "train=train", "--langpair", "en-de",
                    "--out", tmp_path / "out")  # fmt: skip
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.output
    [line] = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert line.startswith(f"error: {named}: outside the dataset folder {tmp_path / 'repo'}"), line
    assert line.endswith("; a folder's data must lie inside it")
    assert not (tmp_path / "out").exists()


def test_a_changed_data_file_is_prepared_again_with_a_warning_naming_it(tmp_path):
    repo, out = _jsonl_folder(tmp_path / "repo"), tmp_path / "out"
    args = ["prepare", f"hf:{repo}", "--splits", "train=train", "--langpair", "en-de", "--out", out]
    assert invoke(*args).exit_code == 0
    rows = [json.dumps({"en": f"{en} again", "de": f"{de} wieder"}) for en, de in caption_pairs("train")]
    (repo / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    again = invoke(*args)
    assert again.exit_code == 0, again.output
    assert "already prepared" not in again.stderr
    assert f"WARNING hf:{repo}: {repo / 'train.jsonl'} changed since {out} was prepared from it" in again.stderr
    assert lines(out / "train.en")[0].endswith(" again")
    [entry] = json.loads((out / "prepare.json").read_text())["source"]["data_files"]["train"]
    assert entry["sha256"] == file_sha256(repo / "train.jsonl")
    assert "already prepared" in invoke(*args).stderr  # unchanged since: left alone


def test_an_output_that_is_a_file_is_refused_before_any_work(tmp_path):
    repo, out = _jsonl_folder(tmp_path / "repo"), tmp_path / "notes.txt"
    out.write_text("keep me\n")
    result = invoke("prepare", f"hf:{repo}", "--splits", "train=train", "--langpair", "en-de", "--out", out)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {out}: a file, not a folder; --out names the folder to prepare into"
    assert out.read_text() == "keep me\n"
    assert not list((tmp_path / "hf").rglob("*.arrow"))  # nothing converted
