"""Bad input through the command line, one test per kind: exit status 1 and one line saying what and where.

Translation is the exception the brief asks for: it keeps one output line per input line, so text it
can still read (invalid UTF-8, NUL bytes, a huge line) is repaired with a warning rather than refused.
"""

from __future__ import annotations

import builtins
import errno
import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import invoke, one_line_error, write_config

from mtkit.launch import preload_environment
from mtkit.model import checkpoint, run_folder


def train_on(tmp_path, corpus_files, spm_model, name: str, **data) -> object:
    """`mtkit train` for 2 updates on the given data files, with the session's tokenizer (no SentencePiece run)."""
    config = write_config(
        tmp_path / f"{name}.yaml",
        corpus_files,
        data=data,
        tokenizer={"model": str(spm_model.path)},
        train={"max_steps": 2, "valid_every": 0, "save_every": 0},
    )
    return invoke("train", config, "--out", tmp_path / name)


def final_weights(run) -> dict[str, torch.Tensor]:
    return checkpoint.read_checkpoint(run_folder.latest(run), with_state=False).weights


def translate_lines(run, lines: list[str], *args) -> list[str]:
    result = invoke(
        "translate", run, "--device", "cpu", "--beam", 2, *args, input="".join(line + "\n" for line in lines)
    )
    assert result.exit_code == 0, result.output
    return result.stdout.split("\n")[:-1]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, corpus_files, spm_model):
    """Two updates on the unaltered captions: what a repaired file must train exactly like."""
    root = tmp_path_factory.mktemp("clean")
    result = train_on(root, corpus_files, spm_model, "clean")
    assert result.exit_code == 0, result.output
    return root / "clean"


@pytest.fixture
def val_lines(corpus_files) -> list[str]:
    return corpus_files["val.en"].read_text().splitlines()[:5]


# -- training data ----------------------------------------------------------------------------


def test_parallel_files_of_different_lengths(tmp_path, corpus_files, spm_model):
    short = tmp_path / "short.de"
    short.write_text("nur eine Zeile\n")
    result = train_on(tmp_path, corpus_files, spm_model, "run", train_tgt=str(short))
    one_line_error(result, "train.en has 400 lines", "short.de has 1")


def test_empty_corpus(tmp_path, corpus_files):
    (tmp_path / "empty.en").write_text("")
    (tmp_path / "empty.de").write_text("")
    data = {"train_src": str(tmp_path / "empty.en"), "train_tgt": str(tmp_path / "empty.de")}
    config = write_config(tmp_path / "c.yaml", corpus_files, data=data)
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), "empty.en: empty corpus")


def test_corpus_of_only_empty_lines(tmp_path, corpus_files, spm_model):
    for side in ("en", "de"):
        (tmp_path / f"blank.{side}").write_text("\n  \n\n\t\n")
    data = {"train_src": str(tmp_path / "blank.en"), "train_tgt": str(tmp_path / "blank.de")}
    config = write_config(tmp_path / "c.yaml", corpus_files, data=data)
    one_line_error(invoke("train", config, "--out", tmp_path / "a"), "blank.en and", "no text to learn a tokenizer")
    # With a tokenizer given, the empty pairs reach the filter, which says what it dropped.
    result = train_on(tmp_path, corpus_files, spm_model, "b", **data)
    one_line_error(result, "no usable training pairs", "kept 0 pairs, dropped 4 (4 empty")


def test_invalid_utf8_in_training_data_names_file_and_line(tmp_path, corpus_files, spm_model):
    lines = corpus_files["train.en"].read_bytes().split(b"\n")
    lines[2] = b"A caf\xe9 in Paris."  # Latin-1, not UTF-8
    bad = tmp_path / "latin1.en"
    bad.write_bytes(b"\n".join(lines))
    result = train_on(tmp_path, corpus_files, spm_model, "run", train_src=str(bad))
    one_line_error(result, "latin1.en:3: invalid UTF-8")


def test_nul_byte_in_training_data_names_file_and_line(tmp_path, corpus_files, spm_model):
    lines = corpus_files["train.de"].read_bytes().split(b"\n")
    lines[4] = b"Ein Hund\x00rennt."
    bad = tmp_path / "nul.de"
    bad.write_bytes(b"\n".join(lines))
    one_line_error(train_on(tmp_path, corpus_files, spm_model, "run", train_tgt=str(bad)), "nul.de:5: NUL byte")


def test_a_one_megabyte_training_line_is_filtered_and_counted(tmp_path, corpus_files, spm_model):
    lines = corpus_files["train.en"].read_text().splitlines()
    lines[7] = "word " * 200_000  # 1 MB, far over data.max_tokens
    (tmp_path / "huge.en").write_text("\n".join(lines) + "\n")
    result = train_on(tmp_path, corpus_files, spm_model, "run", train_src=str(tmp_path / "huge.en"))
    assert result.exit_code == 0, result.output
    assert "kept 399 pairs, dropped 1 (0 empty, 1 too long" in result.stderr


def test_crlf_training_files_train_exactly_like_lf_ones(tmp_path, corpus_files, spm_model, clean_run):
    crlf = {}
    for side in ("en", "de"):
        crlf[side] = tmp_path / f"crlf.{side}"
        crlf[side].write_bytes(corpus_files[f"train.{side}"].read_bytes().replace(b"\n", b"\r\n"))
    result = train_on(tmp_path, corpus_files, spm_model, "run", train_src=str(crlf["en"]), train_tgt=str(crlf["de"]))
    assert result.exit_code == 0, result.output
    reference, trained = final_weights(clean_run), final_weights(tmp_path / "run")
    assert all(torch.equal(reference[key], trained[key]) for key in reference)


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path, corpus_files, spm_model, clean_run):
    bom = tmp_path / "bom.en"
    bom.write_bytes(b"\xef\xbb\xbf" + corpus_files["train.en"].read_bytes())
    result = train_on(tmp_path, corpus_files, spm_model, "run", train_src=str(bom))
    assert result.exit_code == 0, result.output
    reference, trained = final_weights(clean_run), final_weights(tmp_path / "run")
    assert all(torch.equal(reference[key], trained[key]) for key in reference)


def test_missing_or_unreadable_files(tmp_path, corpus_files, spm_model, trained_run, monkeypatch):
    missing = tmp_path / "missing.en"
    one_line_error(train_on(tmp_path, corpus_files, spm_model, "a", train_src=str(missing)), "missing.en: file not")
    one_line_error(invoke("translate", trained_run, "--device", "cpu", "-i", missing), "missing.en: file not found")
    folder = tmp_path / "folder.en"
    folder.mkdir()
    one_line_error(train_on(tmp_path, corpus_files, spm_model, "b", train_src=str(folder)), "folder.en: is a folder")
    one_line_error(invoke("translate", trained_run, "--device", "cpu", "-i", folder), "folder.en: is a folder")

    locked = tmp_path / "locked.en"
    shutil.copyfile(corpus_files["train.en"], locked)
    locked.chmod(0)
    real_open = builtins.open

    def open_as_unprivileged(file, *args, **kwargs):  # root reads anything, so deny as the kernel would
        if str(file) == str(locked):
            raise PermissionError(13, "Permission denied", str(locked))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_as_unprivileged)
    result = train_on(tmp_path, corpus_files, spm_model, "c", train_src=str(locked))
    one_line_error(result, "locked.en: cannot read (Permission denied)")
    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "-i", locked), "locked.en: cannot read (Permission denied)"
    )


# -- translation input and output ------------------------------------------------------------


def test_invalid_utf8_in_translation_input_is_replaced_and_the_line_kept(tmp_path, trained_run, val_lines):
    raw = [line.encode() for line in val_lines]
    raw[1] = b"Two dogs \xff\xfe play."
    source = tmp_path / "in.en"
    source.write_bytes(b"\n".join(raw) + b"\n")
    result = invoke("translate", trained_run, "--device", "cpu", "-i", source, "--beam", 2)
    assert result.exit_code == 0, result.output
    assert f"{source}:2: invalid UTF-8 replaced" in result.stderr
    hyps = result.stdout.split("\n")[:-1]
    expected = translate_lines(trained_run, val_lines)
    assert len(hyps) == len(val_lines) and [hyps[i] for i in (0, 2, 3, 4)] == [expected[i] for i in (0, 2, 3, 4)]


def test_nul_bytes_in_translation_input_are_replaced_and_the_line_kept(trained_run, val_lines):
    with_nul = list(val_lines)
    with_nul[3] = with_nul[3].replace(" ", "\0", 1)
    result = invoke(
        "translate", trained_run, "--device", "cpu", "--beam", 2, input="".join(line + "\n" for line in with_nul)
    )
    assert result.exit_code == 0, result.output
    assert "<stdin>:4: NUL bytes replaced by spaces" in result.stderr
    assert result.stdout.split("\n")[:-1] == translate_lines(trained_run, val_lines)


def test_a_one_megabyte_line_gets_one_output_line(trained_run, val_lines):
    lines = [val_lines[0], "A man is walking. " * 55_000, val_lines[1]]
    hyps = translate_lines(trained_run, lines)
    assert len(hyps) == 3 and [hyps[0], hyps[2]] == translate_lines(trained_run, [val_lines[0], val_lines[1]])


def test_crlf_and_bom_translation_input_reads_like_plain_lines(tmp_path, trained_run, val_lines):
    source = tmp_path / "windows.en"
    source.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\r\n" for line in val_lines).encode())
    result = invoke("translate", trained_run, "--device", "cpu", "-i", source, "--beam", 2)
    assert result.exit_code == 0, result.output
    assert "\r" not in result.stdout and result.stdout.split("\n")[:-1] == translate_lines(trained_run, val_lines)


def test_an_output_path_in_a_missing_folder(tmp_path, trained_run, corpus_files):
    out = tmp_path / "no" / "such" / "out.de"
    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "-i", corpus_files["val.en"], "-o", out),
        "folder",
        "not exist",
    )
    one_line_error(invoke("average", trained_run, "-o", tmp_path / "no" / "avg.safetensors"), "does not exist")
    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "-i", corpus_files["val.en"], "-o", tmp_path), "is a folder"
    )
    assert not (tmp_path / "no").exists()


def test_beam_0(trained_run):
    result = invoke("translate", trained_run, "--device", "cpu", "--beam", 0, input="A dog.\n")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert result.stderr.startswith("error: ") and "Invalid value for '--beam'" in result.stderr


def test_cuda_asked_for_on_a_machine_without_it(tmp_path, trained_run, corpus_files, no_cuda):
    one_line_error(invoke("translate", trained_run, "--device", "cuda", input="A dog.\n"), "no CUDA device")
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"device": "cuda"})
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), "no CUDA device")


# -- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, values, expected",
    [
        ("train", {"learning_rate": 0.1}, r"c\.yaml:\d+: unknown config key train\.learning_rate"),
        ("train", {"max_steps": "many"}, r"c\.yaml:\d+: train\.max_steps must be of type int, got 'many'"),
        ("train", {"batch_tokens": -4096}, r"c\.yaml:\d+: train\.batch_tokens must be >= 1"),
        ("model", {"d_model": -32}, r"c\.yaml:\d+: model\.d_model and model\.heads must be >= 1"),
        ("tokenizer", {"vocab_size": -8000}, r"c\.yaml:\d+: tokenizer\.vocab_size must be >= 16"),
    ],
    ids=["unknown-key", "wrong-type", "negative-batch", "negative-width", "negative-vocabulary"],
)
def test_a_bad_config_names_file_line_and_key(tmp_path, corpus_files, section, values, expected):
    config = write_config(tmp_path / "c.yaml", corpus_files, **{section: values})
    key = f"{next(iter(values))}:"
    line = next(n for n, text in enumerate(config.read_text().splitlines(), 1) if text.strip().startswith(key))
    message = one_line_error(invoke("train", config, "--out", tmp_path / "run"))
    assert re.search(expected, message) and f"c.yaml:{line}:" in message, message


def test_no_training_corpus_configured(tmp_path, corpus_files):
    config = write_config(tmp_path / "c.yaml", corpus_files, data={"train_src": ""})
    one_line_error(invoke("train", config, "--out", tmp_path / "run"), "data.train_src is not set")


def test_a_bad_override_names_the_set_flag(tmp_path, corpus_files):
    config = write_config(tmp_path / "c.yaml", corpus_files)
    one_line_error(invoke("train", config, "--set", "model.heads=5"), "--set model.heads=5:", "divisible")
    one_line_error(invoke("train", tmp_path / "nope.yaml"), "nope.yaml: config file not found")


# -- checkpoints and tokenizers -----------------------------------------------------------------


@pytest.fixture(scope="module")
def other_vocabulary_run(tmp_path_factory, corpus_files):
    root = tmp_path_factory.mktemp("other")
    config = write_config(
        root / "c.yaml", corpus_files, tokenizer={"vocab_size": 250}, train={"max_steps": 2, "valid_every": 0}
    )
    assert invoke("train", config, "--out", root / "run").exit_code == 0
    return root / "run"


def test_resuming_from_a_checkpoint_of_another_vocabulary_or_architecture(
    tmp_path,
    corpus_files,
    trained_run,
    other_vocabulary_run,
):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    last = checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"]
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"max_steps": last + 20})
    newer = f"update-{last + 10:08d}"  # the newest, so the one a resume reads
    shutil.copytree(run_folder.latest(other_vocabulary_run), run / "checkpoints" / newer)
    one_line_error(invoke("train", config, "--out", run), f"{newer}: trained with another tokenizer")
    shutil.rmtree(run / "checkpoints" / newer)
    one_line_error(invoke("train", config, "--out", run, "--set", "model.d_model=64"), "model settings differ")
    one_line_error(invoke("train", config, "--out", run, "--set", "tokenizer.vocab_size=200"), "has 300 pieces")


def test_translating_weights_that_do_not_fit_their_config(tmp_path, trained_run):
    ckpt = checkpoint.read_checkpoint(trained_run / "best", with_state=False)
    weights = dict(ckpt.weights)
    weights["output.weight"] = torch.zeros(299, weights["output.weight"].shape[1])
    model = tmp_path / "model.safetensors"
    checkpoint.write_model_file(model, {k: v.clone() for k, v in weights.items()}, ckpt.meta, trained_run / "best")
    result = invoke("translate", model, "--device", "cpu", input="A dog.\n")
    one_line_error(result, "output.weight is (299, 32) there, (300, 32) here")


def test_truncated_checkpoints(tmp_path, corpus_files, trained_run):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    best = run / "best" / checkpoint.WEIGHTS_FILE
    best.write_bytes(best.read_bytes()[:3000])
    result = invoke("translate", run, "--device", "cpu", input="A dog.\n")
    one_line_error(result, "model.safetensors: not a readable mtkit checkpoint")
    state = run_folder.latest(run) / checkpoint.STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    newest, older = run_folder.run_checkpoints(run)[-1], run_folder.run_checkpoints(run)[-2]
    target = checkpoint.read_checkpoint(newest, with_state=False).meta["step"] + 2
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"max_steps": target})
    error = one_line_error(invoke("train", config, "--out", run), "state.pt: not a readable mtkit checkpoint")
    assert error.endswith(f"; delete {newest} to resume from {older}")
    shutil.rmtree(newest)  # as the message says
    assert invoke("train", config, "--out", run).exit_code == 0
    assert checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"] == target


def test_a_tokenizer_that_does_not_match_the_checkpoint(tmp_path, trained_run, other_vocabulary_run):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.copyfile(other_vocabulary_run / "spm.model", run / "spm.model")
    one_line_error(invoke("translate", run, "--device", "cpu", input="A dog.\n"), "spm.model: tokenizer does not match")


def test_weights_saved_by_safetensors_without_mtkit_metadata(tmp_path):
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, foreign)
    one_line_error(invoke("translate", foreign, "--device", "cpu", input="A dog.\n"), "not an mtkit checkpoint")


# -- damaged archives -------------------------------------------------------------------------


@pytest.fixture
def damaged_gz(tmp_path, corpus_files) -> dict[str, Path]:
    """The training captions gzipped, then cut in half, and with bytes in its middle overwritten."""
    data = gzip.compress(corpus_files["train.en"].read_bytes())
    cut, corrupt = tmp_path / "cut.en.gz", tmp_path / "corrupt.en.gz"
    cut.write_bytes(data[: len(data) // 2])
    middle = len(data) // 2
    corrupt.write_bytes(data[:middle] + bytes(64) + data[middle + 64 :])
    return {"truncated": cut, "corrupt": corrupt}


@pytest.mark.parametrize("kind", ["truncated", "corrupt"])
def test_a_damaged_gz_is_one_line_naming_it_in_every_command(tmp_path, corpus_files, spm_model, trained_run,
                                                             damaged_gz, kind):  # fmt: skip
    """Each once gave a zlib.error or EOFError traceback, or Click's bare 'Aborted.'."""
    bad = damaged_gz[kind]
    expected = f"{bad.name}: cannot read (corrupt or truncated gzip data"
    one_line_error(train_on(tmp_path, corpus_files, spm_model, "run", train_src=str(bad)), expected)
    one_line_error(invoke("translate", trained_run, "--device", "cpu", "-i", bad, "--beam", 1), expected)
    one_line_error(invoke("eval", "--hyp", bad, "--ref", corpus_files["train.de"]), expected)
    one_line_error(invoke("tokenizer", "train", "--src", bad, "-o", tmp_path / "tok", "--vocab-size", 100), expected)


# -- settings that cannot work together ---------------------------------------------------------


def test_positions_fewer_than_the_longest_training_sentence(tmp_path, corpus_files, spm_model):
    """model.max_positions below data.max_tokens once crashed in the forward pass."""
    config = write_config(
        tmp_path / "c.yaml", corpus_files, tokenizer={"model": str(spm_model.path)}, model={"max_positions": 16}
    )
    one_line_error(
        invoke("train", config, "--out", tmp_path / "run"), "data.max_tokens 200 must be below model.max_positions 16"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device", ["foo", "meta", "cuda:0", "cuda:x", "cpu:0"])
def test_a_device_that_is_not_here(trained_run, device, no_cuda):
    message = "no CUDA device" if device == "cuda:0" else "device must be auto, cpu, cuda or cuda:N"
    one_line_error(invoke("translate", trained_run, "--device", device, input="A dog.\n"), message)


def test_sampling_settings_at_their_limits(trained_run, val_lines):
    text = "".join(line + "\n" for line in val_lines)
    # In fp32: bf16 logits tie often, and sampling may break a tie differently from greedy search.
    greedy = translate_lines(trained_run, val_lines, "--beam", "1", "--precision", "fp32")
    options = ["--device", "cpu", "--sample", "--temperature", "1e-30", "--precision", "fp32"]
    cold = invoke("translate", trained_run, *options, input=text)
    assert cold.exit_code == 0, cold.output
    assert cold.stdout.split("\n")[:-1] == greedy  # a temperature near 0 tends to greedy search, not to NaN
    for value in ("inf", "nan", "0"):
        one_line_error(
            invoke("translate", trained_run, "--device", "cpu", "--sample", "--temperature", value, input=text),
            "--temperature",
        )
    too_big = invoke("translate", trained_run, "--device", "cpu", "--sample", "--seed", str(2**70), input=text)
    assert too_big.exit_code == 2 and "Traceback" not in too_big.output
    assert [line for line in too_big.stderr.splitlines() if line] == [too_big.stderr.strip()]
    assert too_big.stderr.startswith("error: ") and "translate: Invalid value for '--seed'" in too_big.stderr


def test_usage_errors_are_one_line(trained_run):
    """Click's usage errors once printed a box of several lines."""
    for args, fragment in (
        (["translate", trained_run, "--beam", "abc"], "Invalid value for '--beam'"),
        (["translate"], "Missing argument"),
        (["translate", trained_run, "--no-such-option"], "No such option"),
        (["no-such-command"], "No such command"),
    ):
        result = invoke(*args, input="A dog.\n")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("error: ") and fragment in result.stderr


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_an_infinite_length_cap_is_refused(trained_run, value):
    """--max-len-a inf was accepted and emptied every translation."""
    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "--max-len-a", value, input="A dog.\n"), "must be finite"
    )


def test_inputs_that_are_not_regular_files(tmp_path, trained_run, val_lines):
    """/dev/null, a FIFO, process substitution, /dev/stdin and - were once refused as 'file not found'."""
    assert invoke("translate", trained_run, "--device", "cpu", "-i", "/dev/null").stdout == ""
    text = "".join(line + "\n" for line in val_lines)
    expected = translate_lines(trained_run, val_lines)
    for name in ("-", "/dev/stdin"):
        result = invoke("translate", trained_run, "--device", "cpu", "-i", name, "--beam", 2, input=text)
        assert result.exit_code == 0 and result.stdout.split("\n")[:-1] == expected, result.output
    source = tmp_path / "in.en"
    source.write_text(text)
    command = (
        f"{sys.executable} -m mtkit translate {trained_run} --device cpu --beam 2 -i <(cat {source}) "
        "--prefix <(yes '' | head -5)"
    )
    piped = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout.split("\n")[:-1] == expected, piped.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["bash", "-c", f"cat {source} > {fifo}"])
    result = invoke("translate", trained_run, "--device", "cpu", "-i", fifo, "--beam", 2)
    writer.wait(timeout=60)
    assert result.exit_code == 0 and result.stdout.split("\n")[:-1] == expected, result.output
    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "-i", "-", "--prefix", "-", input=text),
        "both be standard input",
    )


@pytest.mark.parametrize("closed", ["stdin", "stdout"])
def test_closed_standard_streams(trained_run, closed):
    """`<&-` and `>&-` once ended in an AttributeError traceback."""
    redirect = "<&-" if closed == "stdin" else ">&- < /dev/null"
    command = f"{sys.executable} -m mtkit translate {trained_run} --device cpu --beam 1 {redirect}"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[
        -1
    ] == f"error: <{closed}>: standard {'input' if closed == 'stdin' else 'output'} is closed; " + (
        "give the text with -i FILE" if closed == "stdin" else "give a file to write with -o"
    )


def test_lines_of_invisible_characters_only_stay_empty(trained_run):
    """A line of U+FEFF or U+200B alone encodes to no token and once got a made-up translation."""
    hyps = translate_lines(trained_run, ["A dog.", "\ufeff", "\u200b\u200b", "\u2060", "A cat."])
    assert hyps[1:4] == ["", "", ""] and hyps[0] and hyps[4]


def test_a_prefix_longer_than_the_length_cap_is_kept_whole(tmp_path, trained_run):
    """The cap (max_len_a * length + max_len_b) once cut a forced prefix short."""
    prefix = "Ein Mann mit einem großen Hut und einer roten Jacke steht vor dem Haus"
    (tmp_path / "prefix.de").write_text(prefix + "\n")
    args = ["--prefix", tmp_path / "prefix.de", "--max-len-a", "0", "--max-len-b", "3", "--beam", "2"]
    result = invoke("translate", trained_run, "--device", "cpu", *args, input="A dog.\n")
    assert result.exit_code == 0 and result.stdout.startswith(prefix), result.output


# -- output paths ---------------------------------------------------------------------------------


def test_output_paths_that_must_not_be_replaced(tmp_path, trained_run):
    """Each case decided: a symlink is followed; a read-only file, the input itself and a checkpoint are refused."""
    source = tmp_path / "in.en"
    source.write_text("A dog.\n")
    target, link = tmp_path / "target.de", tmp_path / "link.de"
    target.write_text("old\n")
    link.symlink_to(target)
    assert invoke("translate", trained_run, "--device", "cpu", "-i", source, "-o", link, "--beam", 1).exit_code == 0
    assert link.is_symlink() and target.read_text() != "old\n"  # the link stays, its file holds the output

    locked = tmp_path / "locked.de"
    locked.write_text("keep me\n")
    locked.chmod(0o444)
    real_access = os.access
    with pytest.MonkeyPatch.context() as patch:  # root may write anything; answer as the kernel would a user
        patch.setattr(
            os, "access", lambda p, mode: not (str(p) == str(locked) and mode & os.W_OK) and real_access(p, mode)
        )
        one_line_error(
            invoke("translate", trained_run, "--device", "cpu", "-i", source, "-o", locked), "locked.de: is read-only"
        )
    assert locked.read_text() == "keep me\n"

    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "-i", source, "-o", source), "in.en: is also an input"
    )
    one_line_error(invoke("translate", trained_run, "--device", "cpu", "-i", link, "-o", target), "is also an input")
    newest = run_folder.latest(trained_run)
    before = (newest / checkpoint.WEIGHTS_FILE).read_bytes()
    one_line_error(invoke("average", trained_run, "-o", newest / checkpoint.WEIGHTS_FILE), "is inside the checkpoint")
    assert (newest / checkpoint.WEIGHTS_FILE).read_bytes() == before


def test_a_failed_output_write_names_the_output_not_its_temporary_file(tmp_path, trained_run, monkeypatch):
    out = tmp_path / "out.de"
    real_fsync = os.fsync

    def full_disk(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / ".out.de.")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    one_line_error(
        invoke("translate", trained_run, "--device", "cpu", "-o", out, input="A dog.\n"), f"error: {out}: No space left"
    )
    assert list(tmp_path.iterdir()) == []


# -- memory bounds ------------------------------------------------------------------------------


def peak_rss_mib(command: str, stdin: bytes) -> tuple[int, subprocess.CompletedProcess]:
    """Peak resident memory of ``python -m mtkit COMMAND`` run as a child, in MiB.

    The child starts with the allocator already preloaded as the mtkit command would preload it, so
    that it does not start again (which would skip the ``finally`` that reports the peak)."""
    code = (
        "import resource, runpy, sys; sys.argv = ['mtkit', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('mtkit', run_name='__main__')\n"
        "finally:\n    print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *command.split()],
        input=stdin,
        capture_output=True,
        timeout=300,
        env=preload_environment(),
    )
    peak = int(re.search(rb"peak (\d+)", result.stderr)[1])
    return peak, result


def test_a_huge_line_and_a_huge_beam_keep_memory_bounded(trained_run):
    """A 26 MB line once took 1.2 GB; 64 lines at beam 1000 took 2.4 GB (--batch-tokens ignored the beam)."""
    baseline, _ = peak_rss_mib(f"translate {trained_run} --device cpu --beam 1", b"A dog.\n")
    huge, result = peak_rss_mib(
        f"translate {trained_run} --device cpu --beam 1", b"A man is walking. " * 1_450_000 + b"\n"
    )
    assert result.returncode == 0 and result.stdout.count(b"\n") == 1
    assert huge - baseline < 400, (baseline, huge)
    lines = b"".join(b"A man in a red jacket is walking his dog.\n" for _ in range(64))
    wide, result = peak_rss_mib(f"translate {trained_run} --device cpu --beam 1000 --max-len-a 0 --max-len-b 8", lines)
    assert result.returncode == 0 and result.stdout.count(b"\n") == 64
    assert wide - baseline < 400, (baseline, wide)
