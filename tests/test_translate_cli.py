"""`mtkit translate` output modes and streaming, on the tiny model `test_cli` trains."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest
from helpers import invoke, one_line_error

import mtkit.decoding.line_translator


@pytest.fixture(scope="module")
def lines(corpus_files) -> list[str]:
    chosen = corpus_files["val.en"].read_text().splitlines()[:6]
    chosen.insert(2, "")
    return chosen


def stdin_of(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def test_nbest_lists_are_sorted_distinct_and_headed_by_the_best(trained_run, lines):
    best = invoke("translate", trained_run, "--device", "cpu", "--beam", 4, input=stdin_of(lines)).stdout.splitlines()
    result = invoke("translate", trained_run, "--device", "cpu", "--beam", 4, "--nbest", 3, input=stdin_of(lines))
    assert result.exit_code == 0, result.output
    entries: dict[int, list[tuple[str, float, float]]] = {}
    for row in result.stdout.splitlines():
        index, text, score, logprob = row.split(" ||| ")
        entries.setdefault(int(index), []).append((text, float(score), float(logprob)))
    assert sorted(entries) == list(range(len(lines)))
    assert entries[2] == [("", 0.0, 0.0)]  # the empty input line
    for index, hyps in entries.items():
        assert hyps[0][0] == best[index]
        if index != 2:  # (distinct token sequences may still detokenize alike: search tests check those)
            assert len(hyps) == 3
            assert [h[1] for h in hyps] == sorted((h[1] for h in hyps), reverse=True)
            assert all(h[2] < 0 for h in hyps)


def test_scores_put_the_log_probability_before_each_translation(trained_run, lines):
    best = invoke("translate", trained_run, "--device", "cpu", "--beam", 3, input=stdin_of(lines)).stdout.splitlines()
    result = invoke("translate", trained_run, "--device", "cpu", "--beam", 3, "--scores", input=stdin_of(lines))
    assert result.exit_code == 0, result.output
    rows = [row.split("\t") for row in result.stdout.splitlines()]
    assert [text for _, text in rows] == best
    assert [float(logprob) < 0 for logprob, _ in rows] == [bool(line) for line in lines]  # empty input: 0


def test_nbest_larger_than_the_beam_is_a_one_line_error(trained_run):
    result = invoke("translate", trained_run, "--device", "cpu", "--beam", 2, "--nbest", 3, input="A dog.\n")
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: nbest 3 needs a beam of at least 3 (the beam is 2)"


def test_small_chunks_give_the_same_output_as_one_chunk(trained_run, lines, monkeypatch):
    def nbest_rows() -> list[tuple[str, str, float, float]]:
        out = invoke(
            "translate", trained_run, "--device", "cpu", "--beam", 3, "--nbest", 2, input=stdin_of(lines)
        ).stdout
        rows = (row.split(" ||| ") for row in out.splitlines())
        return [(i, text, float(score), float(logprob)) for i, text, score, logprob in rows]

    whole = nbest_rows()
    monkeypatch.setattr(mtkit.decoding.line_translator, "CHUNK_LINES", 2)
    chunked = nbest_rows()
    assert [row[:2] for row in chunked] == [row[:2] for row in whole]
    # Other batch-mates mean other padding, which moves scores only by float rounding.
    assert [v for row in chunked for v in row[2:]] == pytest.approx([v for row in whole for v in row[2:]], abs=1e-3)


def test_a_pipeline_gets_each_translation_before_the_input_ends(trained_run, lines):
    options = ["--device", "cpu", "--beam", "2", "--scores"]
    command = [sys.executable, "-m", "mtkit", "translate", str(trained_run), *options]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in (lines[0], "", lines[1]):
            proc.stdin.write((line + "\n").encode())
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, "no translation came back while the input stayed open"
            answer = proc.stdout.readline()
            assert answer.endswith(b"\n") and answer.startswith(b"0.0000\t") == (line == "")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_prefixes_come_from_a_line_aligned_file(trained_run, lines, tmp_path):
    prefixes = ["Ein Mann" if i % 2 == 0 else "" for i in range(len(lines))]
    prefix_file = tmp_path / "prefix.de"
    prefix_file.write_text(stdin_of(prefixes))
    result = invoke(
        "translate", trained_run, "--device", "cpu", "--beam", 2, "--prefix", prefix_file, input=stdin_of(lines)
    )
    assert result.exit_code == 0, result.output
    outputs = result.stdout.splitlines()
    assert len(outputs) == len(lines)
    for line, prefix, out in zip(lines, prefixes, outputs):
        assert out.startswith(prefix) if line else out == ""
    prefix_file.write_text(stdin_of(prefixes[:3]))
    short = invoke("translate", trained_run, "--device", "cpu", "--prefix", prefix_file, input=stdin_of(lines))
    assert short.exit_code == 1 and short.stderr.strip() == f"error: {prefix_file}: no prefix for input line 4"


def test_sampling_is_reproducible_with_a_seed_and_varies_without(trained_run, lines):
    def sampled(seed: int) -> list[str]:
        args = ["--sample", "--temperature", 1.5, "--seed", seed, "--scores"]
        result = invoke("translate", trained_run, "--device", "cpu", *args, input=stdin_of(lines))
        assert result.exit_code == 0, result.output
        return result.stdout.splitlines()

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2)


def test_sampling_with_nbest_draws_that_many_per_line_best_first(trained_run, lines):
    args = ["--device", "cpu", "--sample", "--temperature", 1.5, "--nbest", 8]
    result = invoke("translate", trained_run, *args, input=stdin_of(lines))
    assert result.exit_code == 0, result.output
    entries: dict[int, list[tuple[str, float]]] = {}
    for row in result.stdout.splitlines():
        index, text, score, _ = row.split(" ||| ")
        entries.setdefault(int(index), []).append((text, float(score)))
    assert sorted(entries) == list(range(len(lines)))
    for index, samples in entries.items():
        assert len(samples) == (1 if index == 2 else 8)  # line 2 is empty
        assert [s for _, s in samples] == sorted((s for _, s in samples), reverse=True)
    assert any(len({text for text, _ in samples}) > 1 for samples in entries.values())  # draws, not copies


def test_a_model_given_twice_is_an_ensemble_that_decodes_like_it(trained_run, lines):
    """In fp32: bf16 logits tie often, and an ensemble's renormalised mean may break a tie another way."""
    options = ["--beam", 3, "--scores", "--precision", "fp32", "--device", "cpu"]
    alone = invoke("translate", trained_run, *options, input=stdin_of(lines))
    twice = invoke("translate", trained_run, trained_run / "best", *options, input=stdin_of(lines))
    assert twice.exit_code == 0, twice.output
    assert [row.split("\t")[1] for row in twice.stdout.splitlines()] == [
        row.split("\t")[1] for row in alone.stdout.splitlines()
    ]


def test_translation_reads_only_as_much_input_as_it_needs(trained_run, lines):
    """An endless input still yields translations: memory is bounded by the chunk, not the input."""
    import itertools

    import torch

    from mtkit.config import DecodeConfig
    from mtkit.model.loading import load_for_inference

    bundle = load_for_inference(trained_run, torch.device("cpu"))
    translator = mtkit.decoding.line_translator.Translator(
        bundle.model, bundle.src_tok, bundle.tgt_tok, DecodeConfig(beam=1, max_len_b=3), torch.device("cpu")
    )
    endless = mtkit.decoding.line_translator.chunked(itertools.cycle(lines), 20)
    first = list(itertools.islice(translator.stream(endless), 50))
    assert len(first) == 50
    assert all((t[0].logprob == 0.0) == (i % len(lines) == 2) for i, t in enumerate(first))  # line 2 is empty


def test_on_batch_counts_every_line_once_and_changes_no_output(trained_run, lines):
    """Validation's progress bar counts with it; the empty line counts too, so the bar reaches its total."""
    import torch

    from mtkit.config import DecodeConfig
    from mtkit.model.loading import load_for_inference

    bundle = load_for_inference(trained_run, torch.device("cpu"))
    model = (bundle.model, bundle.src_tok, bundle.tgt_tok, DecodeConfig(beam=2, batch_size=2), torch.device("cpu"))
    done: list[int] = []
    reported = mtkit.decoding.line_translator.Translator(*model, on_batch=done.append).translate(lines)
    assert reported == mtkit.decoding.line_translator.Translator(*model).translate(lines)
    assert sum(done) == len(lines) and len(done) == 4  # the empty line, then three batches of two


def test_alignments_pair_source_and_target_words(trained_run, lines):
    result = invoke(
        "translate", trained_run, "--device", "cpu", "--beam", 2, "--min-len", 3, "--alignments", input=stdin_of(lines)
    )
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()
    assert len(rows) == len(lines)
    plain = invoke(
        "translate", trained_run, "--device", "cpu", "--beam", 2, "--min-len", 3, input=stdin_of(lines)
    ).stdout.splitlines()
    for line, row, text in zip(lines, rows, plain):
        translation, alignment = row.split(" ||| ")
        assert translation == text
        pairs = [tuple(map(int, pair.split("-"))) for pair in alignment.split()]
        assert pairs == sorted(set(pairs))
        assert all(i < len(line.split()) and j < max(len(translation.split()), 1) for i, j in pairs)
        assert bool(pairs) == bool(line and translation)


def test_bf16_translation_keeps_every_line(trained_run, lines):
    """Against an fp32 reference on every CPU (``auto`` would be bf16 itself on one with native bf16)."""
    fp32 = invoke(
        "translate", trained_run, "--device", "cpu", "--beam", 3, "--precision", "fp32", input=stdin_of(lines)
    )
    assert fp32.exit_code == 0, fp32.output
    bf16 = invoke(
        "translate", trained_run, "--device", "cpu", "--beam", 3, "--precision", "bf16", input=stdin_of(lines)
    )
    assert bf16.exit_code == 0, bf16.output
    assert [bool(row) for row in bf16.stdout.splitlines()] == [bool(row) for row in fp32.stdout.splitlines()]
    assert len(bf16.stdout.splitlines()) == len(lines)


def test_early_stop_changes_no_output_without_a_length_penalty(trained_run, lines):
    options = ["--device", "cpu", "--beam", 4, "--lenpen", 0]
    early = invoke("translate", trained_run, *options, input=stdin_of(lines))
    full = invoke("translate", trained_run, *options, "--no-early-stop", input=stdin_of(lines))
    assert full.exit_code == 0, full.output
    assert full.stdout == early.stdout


def test_on_a_terminal_a_file_shows_its_total_and_stdout_stays_the_translations(
    trained_run,
    lines,
    tmp_path,
    monkeypatch,
    terminal,
):
    source = tmp_path / "in.en"
    source.write_text(stdin_of(lines))
    with monkeypatch.context() as off_terminal:
        off_terminal.delenv("TTY_COMPATIBLE")
        expected = invoke("translate", trained_run, "--device", "cpu", "-i", source, "--beam", 2)
    assert expected.stderr == "" and len(expected.stdout.splitlines()) == len(lines)

    def bar(result, name: str) -> str:
        assert result.exit_code == 0 and result.stdout == expected.stdout, result.output
        return [line for line in result.stderr.splitlines() if f"translating {name}" in line][-1]

    from_file = invoke("translate", trained_run, "--device", "cpu", "-i", source, "--beam", 2)
    assert f"100% {len(lines)}/{len(lines)} lines" in bar(from_file, "in.en")
    piped = invoke("translate", trained_run, "--device", "cpu", "--beam", 2, input=stdin_of(lines))
    from_pipe = bar(piped, "<stdin>")
    assert f"{len(lines)} lines" in from_pipe and "%" not in from_pipe  # no total to give
    quiet = invoke("--quiet", "translate", trained_run, "--device", "cpu", "-i", source, "--beam", 2)
    assert quiet.stdout == expected.stdout and quiet.stderr == ""


def test_sigint_on_a_pipeline_leaves_whole_lines_and_says_how_many(trained_run, lines):
    command = [sys.executable, "-m", "mtkit", "translate", str(trained_run), "--device", "cpu", "--beam", "2"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(stdin_of(lines[:5]).encode())
        proc.stdin.flush()
        answers = [proc.stdout.readline() for _ in range(5)]  # five lines done; the input stays open
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert all(answer.endswith(b"\n") for answer in answers) and rest == b""
    assert err.decode().strip() == "stopped by SIGINT after 5 complete lines"


def test_sigint_while_translating_a_file_keeps_the_lines_done_in_a_partial_file(
    trained_run,
    lines,
    tmp_path,
    monkeypatch,
):
    source = tmp_path / "in.en"
    source.write_text(stdin_of(lines * 3))
    full = invoke("translate", trained_run, "--device", "cpu", "-i", source, "--beam", 2).stdout.splitlines()
    real_stream = mtkit.decoding.line_translator.Translator.stream

    def stream_then_interrupt(translator, *args):
        for done, translations in enumerate(real_stream(translator, *args), 1):
            yield translations
            if done == 7:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, between two lines

    monkeypatch.setattr(mtkit.decoding.line_translator, "CHUNK_LINES", 4)
    monkeypatch.setattr(mtkit.decoding.line_translator.Translator, "stream", stream_then_interrupt)
    out = tmp_path / "out.de"
    result = invoke("translate", trained_run, "--device", "cpu", "-i", source, "-o", out, "--beam", 2)
    assert result.exit_code == 128 + signal.SIGINT, result.output
    partial = tmp_path / "out.de.partial"
    assert (
        result.stderr.strip()
        == f"stopped by SIGINT after 7 complete lines: they are in {partial}, and {out} is not written"
    )
    assert not out.exists() and partial.read_text() == stdin_of(full[:7])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out.de.partial"]  # no temporary file left


def test_a_signal_during_a_line_write_waits_for_the_line(monkeypatch):
    from mtkit.translation.lines import Interrupted, WholeLines

    written = []
    with pytest.raises(Interrupted) as stop, WholeLines() as whole_lines:
        with whole_lines.writing():
            os.kill(os.getpid(), signal.SIGTERM)
            written.append("the rest of the line")
        written.append("never reached")
    assert written == ["the rest of the line"] and stop.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers are restored


@pytest.mark.parametrize("temperature", ["1e300", "1e-300"])
def test_a_temperature_beyond_float32_is_one_error_line(trained_run, temperature):
    """float32 turns 1e300 into infinity and 1e-300 into 0: the draw's weights were NaN, and the command ended in
    a traceback ("index 5 is out of bounds for dimension 1 with size 5")."""
    result = invoke(
        "translate", trained_run, "--device", "cpu", "--sample", "--temperature", temperature, input="A dog runs.\n"
    )
    one_line_error(result, f"--temperature must be in [1e-30, 1e+30], got {float(temperature):g}")


def test_the_length_penalty_option_chooses_what_a_score_is_divided_by(trained_run, lines):
    """At lenpen 1 a score is the log-probability over length L (tokens and eos) with --length-penalty power, and over
    (5 + L) / 6 by default (gnmt): LOGPROB / SCORE gives L, a whole number, either way."""
    lengths = {}
    for form in ("gnmt", "power"):
        result = invoke(
            "translate", trained_run, "--device", "cpu", "--beam", 3, "--nbest", 3, "--lenpen", 1,
            "--length-penalty", form, input=stdin_of(lines),
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        rows = [row.split(" ||| ") for row in result.stdout.splitlines()]
        ratios = [float(logprob) / float(score) for _, _, score, logprob in rows if float(score)]
        lengths[form] = [ratio if form == "power" else 6 * ratio - 5 for ratio in ratios]
        assert len(ratios) >= 10 and all(abs(n - round(n)) < 0.02 and round(n) >= 1 for n in lengths[form])
    assert len({round(n) for n in lengths["power"]}) > 1  # hypotheses of several lengths
