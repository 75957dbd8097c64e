"""Random and edited inputs through the command line: each case ends in exit status 0 or in one
``error:`` line (status 1, or 2 for a usage error), never in a traceback, and writes nothing but its
output path: each case runs in a sandbox of its own, whose every file is checked (``in_sandbox``).

The inputs are a real checkpoint's header with a value replaced or its bytes flipped, configs of
random sections, keys and values, random YAML and random bytes given as a config, a model or text to
translate. The examples are drawn from a fixed seed, so a failure reproduces; MTKIT_FUZZ_SCALE=10
draws ten times as many. About a minute in all on 2 cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors
import safetensors.torch
import yaml
from helpers import invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtkit.config import SECTIONS
from mtkit.model import checkpoint

SCALE = int(os.environ.get("MTKIT_FUZZ_SCALE", "1"))


def fuzz(examples: int):
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=True,  # the same examples on every run: a CI failure reproduces on any machine
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


# How deep in its sandbox a case folder is: a write that climbs out of the case folder (../), up to this many levels,
# lands in the sandbox, whose every file is checked; one more level up is the sandbox's parent, checked too.
SANDBOX_DEPTH = 3


def sandbox_of(work: Path) -> Path:
    """The sandbox a case folder of ``work_folder`` lies in."""
    return work.parents[SANDBOX_DEPTH - 1]


def assert_clean_outcome(result, work: Path, allowed: set[str]) -> None:
    """Exit 0 or exactly one error line, no traceback, no file in ``work`` beyond ``allowed``, and nothing else in
    its sandbox (``work_folder``) than the folders above ``work`` and an empty home: a write that climbs out of the
    folder (../, ../../, ...) or goes to the home folder is caught too."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    if result.exit_code != 0:
        assert result.exit_code in (1, 2), result.output
        lines = [line for line in result.stderr.splitlines() if not re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) ", line)]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    written = {str(path.relative_to(work)) for path in work.rglob("*")}
    assert written <= allowed, f"written in {work} beyond its outputs: {sorted(written - allowed)}"
    sandbox = sandbox_of(work)
    expected = {path.relative_to(sandbox) for path in work.parents[: SANDBOX_DEPTH - 1]} | {work.relative_to(sandbox)}
    expected.add(Path("home"))
    stray = sorted(
        str(relative)
        for relative in (path.relative_to(sandbox) for path in sandbox.rglob("*") if work not in path.parents)
        if relative not in expected
    )
    assert not stray, f"written in the sandbox {sandbox}, outside {work}: {stray}"


def work_folder(tmp_path_factory, name: str) -> Path:
    """An empty case folder ``SANDBOX_DEPTH`` folders down a sandbox of its own, beside the sandbox's empty home
    folder, for ``in_sandbox`` and ``assert_clean_outcome``."""
    sandbox = tmp_path_factory.mktemp(name)
    work = sandbox.joinpath(*(f"level{n}" for n in range(1, SANDBOX_DEPTH)), "case")
    work.mkdir(parents=True)
    (sandbox / "home").mkdir()
    return work


@contextlib.contextmanager
def in_sandbox(work: Path) -> Iterator[None]:
    """Run in ``work`` as the current folder, with its sandbox's home as HOME: a relative path or ~ written to is
    checked with the rest of the sandbox. The sandbox's parent must gain nothing either (one more level up)."""
    sandbox = sandbox_of(work)
    before = set(sandbox.parent.iterdir())
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        patch.setenv("HOME", str(sandbox / "home"))
        yield
    beside = sorted(str(path) for path in set(sandbox.parent.iterdir()) - before)
    assert not beside, f"written beside the sandbox {sandbox}: {beside}"


def run(work: Path, *args, **kwargs):
    """``invoke`` in the sandbox of ``work`` (``in_sandbox``)."""
    with in_sandbox(work):
        return invoke(*args, **kwargs)


@pytest.mark.parametrize("stray", ["x", "sub/x", "../x", "../../x", "../../../x", "../../../../x", "~/x", "~/.x/y"])
def test_the_check_catches_a_write_anywhere_out_of_the_outputs(tmp_path_factory, stray):
    """The check itself, on a stand-in for a command that succeeds and writes ``stray`` (relative to the current
    folder, or ~) besides its output; the same command without it passes."""
    succeeded = SimpleNamespace(exception=None, output="", exit_code=0)
    work = work_folder(tmp_path_factory, "check")
    with in_sandbox(work):
        (work / "out.txt").write_text("output")
    assert_clean_outcome(succeeded, work, {"out.txt"})
    with pytest.raises(AssertionError, match="written"):
        with in_sandbox(work):
            target = Path(stray).expanduser().absolute()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("stray")
        assert_clean_outcome(succeeded, work, {"out.txt"})
    target.unlink()  # the sandbox's parent is every sandbox's: what one test leaves there, the next would not see


@pytest.fixture(scope="module")
def model_case(tmp_path_factory, trained_run):
    """A folder to fuzz in (``work_folder``), and the trained run's best weights and tokenizer, to edit."""
    work = work_folder(tmp_path_factory, "fuzz")
    weights = (trained_run / "best" / checkpoint.WEIGHTS_FILE).read_bytes()
    return work, weights, (trained_run / "spm.model").read_bytes()


def fresh(work: Path, tokenizer: bytes) -> Path:
    """``work`` emptied, with only the tokenizer in it."""
    shutil.rmtree(work)
    work.mkdir()
    (work / "spm.model").write_bytes(tokenizer)
    return work


def header_and_tensors(data: bytes) -> tuple[dict, dict]:
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__", {}), load(data)


def edited(value, path: list, new):
    """``value`` with the element at ``path`` (keys or indices, as far as they reach) replaced by ``new``."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return new
    key = list(value)[path[0] % len(value)] if isinstance(value, dict) else path[0] % len(value)
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[key] = edited(copy[key], path[1:], new)
    return copy


@fuzz(150)
@given(path=st.lists(st.integers(min_value=0, max_value=50), max_size=4), new=json_values)
def test_an_edited_checkpoint_header(model_case, path, new):
    root, weights, tokenizer = model_case
    work = fresh(root, tokenizer)
    header, tensors = header_and_tensors(weights)
    meta = edited(json.loads(header["mtkit"]), path, new)
    header = {**header, "mtkit": json.dumps(meta)}
    (work / "model.safetensors").write_bytes(safetensors.torch.save(tensors, metadata=header))
    options = ["-o", work / "out.txt", "--beam", 1, "--device", "cpu"]
    result = run(work, "translate", work / "model.safetensors", *options, input="A dog.\n")
    assert_clean_outcome(result, work, {"spm.model", "model.safetensors", "out.txt"})
    result = run(
        work, "average", work / "model.safetensors", work / "model.safetensors", "-o", work / "avg.safetensors"
    )
    assert_clean_outcome(result, work, {"spm.model", "model.safetensors", "out.txt", "avg.safetensors"})


@fuzz(150)
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)), min_size=1,
                      max_size=8))  # fmt: skip
def test_flipped_bytes_in_a_checkpoint_header(model_case, flips):
    root, weights, tokenizer = model_case
    work = fresh(root, tokenizer)
    header_end = 8 + int.from_bytes(weights[:8], "little")
    data = bytearray(weights)
    for position, byte in flips:
        data[position % header_end] = byte
    (work / "model.safetensors").write_bytes(bytes(data))
    options = ["-o", work / "out.txt", "--beam", 1, "--device", "cpu"]
    result = run(work, "translate", work / "model.safetensors", *options, input="A dog.\n")
    assert_clean_outcome(result, work, {"spm.model", "model.safetensors", "out.txt"})


@fuzz(100)
@given(content=st.binary(max_size=3000))
def test_random_bytes_as_a_model(model_case, content):
    root, _, tokenizer = model_case
    work = fresh(root, tokenizer)
    for name in ("model.pt", "model.safetensors"):
        (work / name).write_bytes(content)
        result = run(work, "translate", work / name, "-o", work / "out.txt", "--device", "cpu", input="A dog.\n")
        assert_clean_outcome(result, work, {"spm.model", "model.pt", "model.safetensors"})
        assert result.exit_code == 1


config_keys = st.sampled_from(
    sorted({f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}) + ["", "x", "preset"]
)


@fuzz(400)
@given(
    raw=st.dictionaries(
        st.sampled_from([*SECTIONS, "other"]),
        st.dictionaries(config_keys, json_values, max_size=4) | json_values,
        max_size=4,
    ),
    overrides=st.lists(st.text(max_size=30), max_size=2),
)
def test_a_config_of_random_sections_keys_and_values(tmp_path_factory, raw, overrides):
    work = work_folder(tmp_path_factory, "config")
    (work / "c.yaml").write_text(yaml.safe_dump(raw, allow_unicode=True))
    result = run(
        work,
        "train",
        work / "c.yaml",
        "--dry-run",
        "--out",
        work / "run",
        *(a for o in overrides for a in ("--set", o)),
    )
    assert_clean_outcome(result, work, {"c.yaml"})


@fuzz(300)
@given(text=st.text(max_size=300) | st.binary(max_size=300))
def test_random_text_or_bytes_as_a_config(tmp_path_factory, text):
    work = work_folder(tmp_path_factory, "yaml")
    path = work / "c.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    result = run(work, "train", path, "--dry-run", "--out", work / "run")
    assert_clean_outcome(result, work, {"c.yaml"})


@fuzz(80)
@given(content=st.binary(max_size=400) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_random_input_to_translate_keeps_one_line_per_line(tmp_path_factory, trained_run, content):
    work = work_folder(tmp_path_factory, "input")
    source = work / "in.txt"
    source.write_bytes(content)
    args = ["--beam", 2, "--max-len-a", 0, "--max-len-b", 3, "--device", "cpu"]
    result = run(work, "translate", trained_run, "-i", source, "-o", work / "out.txt", *args)
    assert_clean_outcome(result, work, {"in.txt", "out.txt"})
    if content.startswith(b"\x1f\x8b"):  # read as gzip, which this is not: an error is the right answer
        return
    assert result.exit_code == 0
    lines = content.count(b"\n") + (1 if content and not content.endswith(b"\n") else 0)
    assert (work / "out.txt").read_bytes().count(b"\n") == lines


@pytest.fixture(scope="module")
def export_case(tmp_path_factory, trained_run):
    root = work_folder(tmp_path_factory, "export")
    assert run(root, "export", trained_run, "-o", root / "ct2").exit_code == 0
    return root, json.loads((root / "ct2" / "mtkit.json").read_text())


@fuzz(100)
@given(path=st.lists(st.integers(min_value=0, max_value=50), max_size=3), new=json_values)
def test_an_edited_export_manifest(export_case, path, new):
    root, manifest = export_case
    (root / "ct2" / "mtkit.json").write_text(json.dumps(edited(manifest, path, new)))
    before = sorted(root.rglob("*"))
    result = run(
        root, "translate", root / "ct2", "--engine", "ctranslate2", "--beam", 1, "--device", "cpu", input="A dog.\n"
    )
    assert_clean_outcome(result, root, {str(p.relative_to(root)) for p in before})
