"""Files from elsewhere are data, never code: checkpoints, configs, config paths and text to translate.

Each hostile input tries to create a marker file; the tests check that it is refused (or read as
plain data) and that the marker never appears.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import time
import zipfile

import pytest
import torch
from helpers import invoke, one_line_error, with_header, write_config

from mtkit.model import checkpoint, run_folder


class RunsCode:
    """Unpickling this calls ``os.system``: what a booby-trapped checkpoint would do."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "a hostile input ran code"


REFUSED = "refused: it holds pickled Python objects other than tensors"


def test_a_checkpoint_that_runs_code_when_unpickled_is_refused(tmp_path, corpus_files, trained_run, marker):
    trap = tmp_path / "model.pt"
    torch.save({"format": 1, "model": RunsCode(marker)}, trap)
    not_read = "model.pt: a zip archive (a PyTorch file?), not a checkpoint"  # never unpickled at all
    one_line_error(invoke("translate", trap, "--device", "cpu", input="A dog.\n"), not_read)
    one_line_error(invoke("average", trap, trap, "-o", tmp_path / "avg.safetensors"), not_read)

    run = tmp_path / "run"  # a run directory whose newest training state was swapped for the trap
    shutil.copytree(trained_run, run)
    shutil.copyfile(trap, run_folder.latest(run) / checkpoint.STATE_FILE)
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"max_steps": 40})
    one_line_error(invoke("train", config, "--out", run), f"state.pt: {REFUSED}")


@pytest.mark.parametrize(
    "tag",
    ["!!python/object/apply:os.system [{command!r}]", "!!python/object/new:subprocess.Popen [[touch, {marker}]]"],
    ids=["apply", "new"],
)
def test_configs_are_read_with_the_safe_yaml_loader(tmp_path, marker, tag):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  max_steps: " + tag.format(command=f"touch {marker}", marker=marker) + "\n")
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), "c.yaml: line 2 not valid YAML")


@pytest.mark.parametrize("hostile", ["$(touch {marker})", "`touch {marker}`", "x; touch {marker}", "~/corpus.en"])
def test_paths_in_configs_are_taken_literally(tmp_path, corpus_files, marker, hostile):
    path = hostile.format(marker=marker)
    for key in ("train_src", "valid_src"):
        config = write_config(tmp_path / "c.yaml", corpus_files, data={key: path})
        one_line_error(invoke("train", config, "--out", tmp_path / "run"), f"error: {path}: file not found")
    config = write_config(tmp_path / "c.yaml", corpus_files, tokenizer={"model": path})
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), f"error: {path}: tokenizer model not found")


HOSTILE_LINES = [
    "../../../../tmp/escaped",
    "/etc/passwd",
    "$(touch {marker}) `touch {marker}`",
    "%s%s%n {0} {} \\x00 \\n",
    "\x1b]0;window title\x07\x1b[2J terminal escapes",
    "form\x0cfeed, vertical\x0btab, next\x85line, line\u2028and paragraph\u2029separators",
    "a carriage\rreturn inside the line",
    "",
]


def test_translating_hostile_text_writes_the_output_file_and_nothing_else(tmp_path, trained_run, marker):
    work = tmp_path / "work"
    work.mkdir()
    lines = [line.replace("{marker}", str(marker)) for line in HOSTILE_LINES]
    source = work / "in.txt"
    source.write_bytes("".join(line + "\n" for line in lines).encode())
    before = sorted(tmp_path.rglob("*"))
    options = ["-o", work / "out.txt", "--beam", 2, "--alignments", "--device", "cpu"]
    result = invoke("translate", trained_run, "-i", source, *options)
    assert result.exit_code == 0, result.output
    assert sorted(tmp_path.rglob("*")) == sorted([*before, work / "out.txt"])
    assert (work / "out.txt").read_bytes().count(b"\n") == len(lines)
    assert not (tmp_path / "escaped").exists()

    # Translating a file onto itself would replace the text it translates: refused, the source kept.
    text = source.read_bytes()
    one_line_error(
        invoke("translate", trained_run, "-i", source, "-o", source, "--device", "cpu"), "in.txt: is also an input"
    )
    assert source.read_bytes() == text


# -- what checkpoint headers and manifests may say ------------------------------------------------


def test_a_tokenizer_name_in_a_header_cannot_lead_outside_the_checkpoint(tmp_path, trained_run):
    """A header naming ../conftest.py (with its true SHA-256) once made `average` write conftest.py outside runs/."""
    shipped = tmp_path / "shipped"
    (shipped / "conftest.py").parent.mkdir(parents=True)
    (shipped / "conftest.py").write_text("import os; os.system('touch ran')\n")
    digest = hashlib.sha256((shipped / "conftest.py").read_bytes()).hexdigest()

    def point_outside(meta):
        meta["tokenizer"]["src"] = {"file": "../conftest.py", "sha256": digest}

    for name in ("a", "b"):
        with_header(
            run_folder.latest(trained_run) / checkpoint.WEIGHTS_FILE,
            shipped / name / "model.safetensors",
            point_outside,
        )
    runs = tmp_path / "runs"
    runs.mkdir()
    result = invoke("average", shipped / "a", shipped / "b", "-o", runs / "avg.safetensors")
    one_line_error(result, "malformed checkpoint header: tokenizer.src.file must be one of", "'../conftest.py'")
    one_line_error(
        invoke("translate", shipped / "a", "--device", "cpu", input="A dog.\n"), "tokenizer.src.file must be one of"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "shipped"] and not any(runs.iterdir())


def test_a_name_in_an_export_manifest_cannot_lead_outside_the_export(tmp_path, trained_run):
    export = tmp_path / "ct2"
    assert invoke("export", trained_run, "-o", export).exit_code == 0
    manifest = json.loads((export / "mtkit.json").read_text())
    manifest["tokenizer"]["src"] = "../../etc/passwd"
    (export / "mtkit.json").write_text(json.dumps(manifest))
    result = invoke("translate", export, "--engine", "ctranslate2", input="A dog.\n")
    one_line_error(result, "malformed export manifest: tokenizer.src must be one of", "../../etc/passwd")
    (export / "mtkit.json").write_text('{"format": 1}')  # once a KeyError traceback
    result = invoke("translate", export, "--engine", "ctranslate2", input="A dog.\n")
    one_line_error(result, "malformed export manifest: it has no 'tokenizer', 'max_positions', 'decode'")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda meta: meta.pop("config"), "its metadata has no 'config'"),
        (lambda meta: meta.pop("tokenizer"), "its metadata has no 'tokenizer'"),
        (lambda meta: meta.update(step="12"), "step must be an integer, got '12'"),
        (lambda meta: meta.update(step=-1), "step must be at least 0"),
        (lambda meta: meta["tokenizer"]["tgt"].update(sha256=7), "tokenizer.tgt.sha256 must be a SHA-256"),
        (lambda meta: meta["config"]["model"].update(heads="four"), "model.heads must be of type int"),
        (lambda meta: meta["config"]["model"].update(max_positions=10**9), "model.max_positions must be between 8"),
        (lambda meta: meta["config"]["model"].update(d_model=65536, heads=1), "do not fit this model"),
    ],
    ids=["no-config", "no-tokenizer", "step-text", "step-negative", "sha-number", "heads-text", "huge-positions",
         "huge-width"],
)  # fmt: skip
def test_a_malformed_header_is_one_line_before_anything_is_built(tmp_path, trained_run, edit, message):
    """Each of these once ended in a KeyError, TypeError or ValueError traceback, or allocated gigabytes first."""
    model = tmp_path / "model.safetensors"
    with_header(trained_run / "best" / checkpoint.WEIGHTS_FILE, model, edit)
    shutil.copyfile(trained_run / "spm.model", tmp_path / "spm.model")
    started = time.perf_counter()
    one_line_error(invoke("translate", model, "--device", "cpu", input="A dog.\n"), f"{tmp_path}", message)
    assert time.perf_counter() - started < 30  # refused from the header, not after building a huge model


def test_a_tensor_whose_dtype_was_changed_in_the_header_is_refused(tmp_path, trained_run):
    """float32 bytes read as int32 (same size) once loaded silently and translated garbage."""
    data = (trained_run / "best" / checkpoint.WEIGHTS_FILE).read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    key = next(k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32")
    header[key]["dtype"] = "I32"
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    model = tmp_path / "model.safetensors"
    model.write_bytes(data[:8] + text + data[8 + size :])
    shutil.copyfile(trained_run / "spm.model", tmp_path / "spm.model")
    one_line_error(
        invoke("translate", model, "--device", "cpu", input="A dog.\n"),
        f"{key} is torch.int32 there, torch.float32 here",
    )


def test_a_zip_bombed_training_state_is_refused_before_it_expands(tmp_path, corpus_files, trained_run):
    """A 1 MB state.pt whose compressed entry expands to 800 MB, as torch.load would expand it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    state = run_folder.latest(run) / checkpoint.STATE_FILE
    with zipfile.ZipFile(state) as original:
        entries = [(info, original.read(info)) for info in original.infolist()]
    bombed = next(info.filename for info, _ in entries if "/data/" in info.filename)
    with zipfile.ZipFile(state, "w") as bomb:
        for info, content in entries:
            big = info.filename == bombed
            bomb.writestr(info, bytes(200_000_000) if big else content, zipfile.ZIP_DEFLATED if big else None)
    assert state.stat().st_size < 2_000_000
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"max_steps": 40})
    one_line_error(invoke("train", config, "--out", run), "state.pt: refused: it holds compressed entries")


@pytest.mark.parametrize("kind", ["text", "tokenizer", "gzip", "empty"])
def test_a_file_that_is_no_checkpoint_is_named_for_what_it_is(tmp_path, trained_run, kind):
    """Any such file was once reported as holding pickled objects that could run code."""
    path = tmp_path / "model.pt"
    content, what = {
        "text": (b"A dog runs on the beach.\n", "a text file"),
        "tokenizer": ((trained_run / "spm.model").read_bytes(), "a SentencePiece model"),
        "gzip": (gzip.compress(b"text\n"), "a gzip file"),
        "empty": (b"", "an empty file"),
    }[kind]
    path.write_bytes(content)
    one_line_error(
        invoke("translate", path, "--device", "cpu", input="A dog.\n"), f"model.pt: {what}, not a checkpoint"
    )
    one_line_error(
        invoke("translate", trained_run / "spm.model", "--device", "cpu", input="A dog.\n"), "a SentencePiece model"
    )


def test_a_yaml_alias_bomb_is_refused_at_once_with_a_short_error(tmp_path):
    """421 bytes of nested aliases once took 38 s and 4 GB, and printed an 800 MB error line."""
    levels = ['&a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for name, previous in zip("bcdefgh", "abcdefg"):
        levels.append(f"&{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    config = tmp_path / "bomb.yaml"
    config.write_text("train:\n  max_steps: [" + ", ".join(levels) + "]\n")  # all under one key
    started = time.perf_counter()
    error = one_line_error(invoke("train", config, "--out", tmp_path / "run"), "aliases expand to more than")
    assert time.perf_counter() - started < 10 and len(error) < 300
    config.write_text("train: {max_steps: " + "[" * 50_000 + "]" * 50_000 + "}\n")
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), "not valid YAML (nested too deeply)")
    anchors = tmp_path / "anchors.yaml"  # anchors used as they are meant to be still work
    anchors.write_text("train: {lr: &lr 0.002, max_steps: 10}\ndecode: {lenpen: *lr}\n")
    result = invoke("train", anchors, "--dry-run")
    assert result.exit_code == 0 and "lenpen: 0.002" in result.stdout


def test_a_path_a_header_names_is_shown_whole_and_a_huge_one_cut_short():
    """The training data a checkpoint names is a hint the user may copy (whole at any real length), never a way to
    fill an error line."""
    from mtkit import untrusted

    path = "/data/" + "corpora/" * 30 + "train.en"  # 254 characters
    assert untrusted.shown_path(path) == repr(path)
    assert len(untrusted.shown_path("/x" * 500_000)) < 500
    assert untrusted.shown_path(["not", "a", "path"]) == untrusted.shown(["not", "a", "path"])
