"""The command line end to end on a caption corpus (tests/captions.py), and one-line errors for bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import invoke, joint_run, one_line_error, write_config

from mtkit import runtime
from mtkit.model import checkpoint, run_folder


@pytest.mark.parametrize(
    "command", [[], ["train"], ["translate"], ["eval"], ["serve"], ["doctor"], ["tokenizer"], ["tokenizer", "train"]]
)
def test_every_command_has_help(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0 and "Usage" in result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.startswith("mtkit ")


def test_tokenizer_train_joint_and_separate(tmp_path, corpus_files):
    s, t = corpus_files["train.en"], corpus_files["train.de"]
    assert (
        invoke("tokenizer", "train", "--src", s, "--tgt", t, "-o", tmp_path / "j", "--vocab-size", 300).exit_code == 0
    )
    assert (tmp_path / "j" / "spm.model").is_file() and (tmp_path / "j" / "spm.vocab").is_file()
    result = invoke(
        "tokenizer",
        "train",
        "--src",
        s,
        "--tgt",
        t,
        "--separate",
        "-o",
        tmp_path / "s",
        "--vocab-size",
        250,
        "--type",
        "bpe",
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s" / "spm.src.model").is_file() and (tmp_path / "s" / "spm.tgt.model").is_file()
    assert f"wrote {tmp_path / 's' / 'spm.src.model'} and {tmp_path / 's' / 'spm.src.vocab'}" in result.stderr


def test_train_writes_a_complete_run_directory(trained_run):
    for name in ("config.yaml", "spm.model", "spm.vocab", "metrics.jsonl", "best/model.safetensors"):
        assert (trained_run / name).is_file(), name
    assert [path.name for path in run_folder.run_checkpoints(trained_run)] == ["update-00000150", "update-00000300"]
    events = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "valid"] == [150, 300]
    assert all("bleu_signature" in e for e in events if e["event"] == "valid")


def test_dry_run_prints_config_batch_and_schedule(tmp_path, corpus_files):
    config = write_config(tmp_path / "c.yaml", corpus_files)
    result = invoke("train", config, "--set", "train.accum=2", "--dry-run", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "d_model: 32" in result.output and "accum: 2" in result.output
    assert "effective batch: 2048" in result.output and "update 5: 0.003" in result.output
    assert not (tmp_path / "run").exists()


def test_tied_embeddings_over_two_tokenizers_to_train_are_refused_before_any_work(tmp_path, corpus_files):
    config = write_config(tmp_path / "c.yaml", corpus_files)
    result = invoke("train", config, "--set", "tokenizer.joint=false", "--out", tmp_path / "run")
    assert result.exit_code == 1 and "model.tie_embeddings needs a joint vocabulary" in result.output


def test_translate_keeps_one_line_per_input_line(trained_run, corpus_files, tmp_path):
    lines = corpus_files["val.en"].read_text().splitlines()[:12]
    lines[3] = ""
    lines[7] = "   "
    src = tmp_path / "in.en"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.de"
    result = invoke("translate", trained_run, "--device", "cpu", "-i", src, "-o", out, "--beam", 3, "--batch-size", 4)
    assert result.exit_code == 0, result.output
    hyps = out.read_text().split("\n")[:-1]
    assert len(hyps) == len(lines)
    assert hyps[3] == "" and hyps[7] == ""
    # Each output belongs to its own input: dropping the blank lines drops just their outputs.
    kept = [line for i, line in enumerate(lines) if i not in (3, 7)]
    alone = invoke("translate", trained_run, "--device", "cpu", "--beam", 3, input="\n".join(kept) + "\n")
    assert alone.stdout.split("\n")[:-1] == [h for i, h in enumerate(hyps) if i not in (3, 7)]

    piped = invoke("translate", trained_run / "best", "--device", "cpu", "--beam", 3, input="\n".join(lines) + "\n")
    assert piped.exit_code == 0
    assert piped.stdout.split("\n")[:-1] == hyps  # file and stdin, batch size 4 and 128: same output


def test_eval_prints_scores_with_signatures(trained_run, corpus_files, tmp_path):
    hyp = tmp_path / "hyp.de"
    assert invoke("translate", trained_run, "--device", "cpu", "-i", corpus_files["val.en"], "-o", hyp).exit_code == 0
    result = invoke("eval", "--hyp", hyp, "--ref", corpus_files["val.de"], "--metrics", "bleu", "chrf", "ter", "--json")
    assert result.exit_code == 0, result.output
    scores = {s["name"]: s for s in json.loads(result.stdout)}
    assert set(scores) == {"BLEU", "chrF2", "TER"}
    assert all("version:" in s["signature"] for s in scores.values())
    for spelling in (["bleu,chrf,ter"], ["bleu", "--metrics", "chrf,ter"]):
        again = invoke("eval", "--hyp", hyp, "--ref", corpus_files["val.de"], "--json", "--metrics", *spelling)
        assert json.loads(again.stdout) == json.loads(result.stdout)
    perfect = invoke(
        "eval", "--hyp", corpus_files["val.de"], "--ref", corpus_files["val.de"], "--ref", hyp, "--metrics", "bleu"
    )
    assert perfect.exit_code == 0 and "BLEU = 100.00" in perfect.stdout and "nrefs:2" in perfect.stdout


def test_bad_translate_and_eval_input_is_one_line_and_exit_1(tmp_path, corpus_files):
    one_line_error(invoke("translate", tmp_path / "no-run", "--device", "cpu"), "checkpoint not found")
    hyp = tmp_path / "hyp"
    hyp.write_text("a\nb\n")
    one_line_error(invoke("eval", "--hyp", hyp, "--ref", corpus_files["val.de"]), "hyp has 2 lines", "has 40")
    one_line_error(invoke("eval", "--hyp", hyp, "--ref", hyp, "--metrics", "meteor"), "--metrics")
    one_line_error(invoke("eval", "--hyp", hyp, "--ref", hyp, "--metrics", "bleu", "stray"), "--metrics", "stray")


def test_real_process_exit_status_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mtkit", "eval", "--hyp", str(tmp_path / "missing"), "--ref", str(tmp_path / "r")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "file not found" in proc.stderr


def test_separate_vocabularies_train_and_translate(tmp_path, corpus_files):
    config = write_config(
        tmp_path / "sep.yaml",
        corpus_files,
        tokenizer={"joint": False, "vocab_size": 200},
        model={"tie_embeddings": False},
        train={"max_steps": 2, "valid_every": 0},
    )
    assert invoke("train", config, "--out", tmp_path / "run").exit_code == 0
    assert (tmp_path / "run" / "spm.src.model").is_file() and (tmp_path / "run" / "spm.tgt.model").is_file()
    result = invoke("translate", tmp_path / "run", "--device", "cpu", "--beam", 2, input="A dog.\n\nTwo cats.\n")
    assert result.exit_code == 0 and len(result.stdout.split("\n")) == 4


def wait_for_logged_updates(proc: subprocess.Popen, metrics, count: int) -> None:
    """Block until a training subprocess has logged ``count`` updates (it must still be running)."""
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= count):
        assert proc.poll() is None, "training ended before it was interrupted"
        assert time.monotonic() < deadline, f"training never logged {count} updates"
        time.sleep(0.02)


def test_sigterm_saves_a_whole_update_and_the_same_command_resumes(tmp_path, corpus_files):
    config = write_config(
        tmp_path / "long.yaml",
        corpus_files,
        train={"max_steps": 100_000, "valid_every": 0, "save_every": 0, "log_every": 1},
    )
    run = tmp_path / "run"
    command = [sys.executable, "-m", "mtkit", "train", str(config), "--out", str(run)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    wait_for_logged_updates(proc, metrics, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err

    saved = checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"]
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert saved == logged[-1]  # the checkpoint holds exactly the updates that were logged
    resumed = subprocess.run(command + ["--set", f"train.max_steps={saved + 2}"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {run_folder.run_checkpoints(run)[-2]} at update {saved}" in resumed.stderr
    assert checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"] == saved + 2


def test_doctor_reports_the_machine(tmp_path, no_cuda):
    import torch

    result = invoke("doctor", "--json", "--path", tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["torch"] == torch.__version__
    assert report["threads"] == torch.get_num_threads()
    assert report["distributed_backends"]["gloo"] is True
    assert report["disk_free_gib"] > 0 and "fp32" in report["precisions"]["cpu"]
    assert report["fp32_vocabulary_gemm"] == runtime.fp32_vocabulary_gemm(runtime.cpu_vendor())
    assert report["bf16_decoding_gemm"] == runtime.bf16_decoding_gemm(runtime.cpu_vendor(), runtime.cpu_features())
    text = invoke("doctor")
    assert text.exit_code == 0 and "distributed backends" in text.stdout and "fp32 output projection" in text.stdout
    assert "bf16 decoding products" in text.stdout


def test_doctor_on_a_path_not_made_yet_says_where_it_measured_the_disk(tmp_path, no_cuda):
    missing = tmp_path / "runs" / "first"
    text = invoke("doctor", "--path", missing)
    assert text.exit_code == 0, text.output
    [row] = [line for line in text.stdout.splitlines() if line.startswith("disk free")]
    assert row.endswith(f"GiB at {tmp_path.resolve()} ({missing} does not exist: its nearest existing parent)")
    assert json.loads(invoke("doctor", "--json", "--path", missing).stdout)["disk_path"] == str(tmp_path.resolve())
    assert "does not exist" not in invoke("doctor", "--path", tmp_path).stdout


def per_step_losses(metrics_file) -> dict[int, float]:
    """Training loss by update; a resumed run re-logs updates lost in the kill, so the last entry wins."""
    events = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path, corpus_files):
    config = write_config(
        tmp_path / "kill.yaml",
        corpus_files,
        train={"max_steps": 100_000, "valid_every": 0, "save_every": 2, "log_every": 1},
    )
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "mtkit", "train", str(config)]
    proc = subprocess.Popen(command + ["--out", str(killed)], stderr=subprocess.DEVNULL)
    wait_for_logged_updates(proc, killed / "metrics.jsonl", 5)
    proc.kill()
    proc.wait()
    saved = checkpoint.read_checkpoint(run_folder.latest(killed)).meta["step"]
    assert saved >= 2 and saved % 2 == 0
    target = f"train.max_steps={saved + 4}"
    for out in (killed, tmp_path / "straight"):
        done = subprocess.run(command + ["--out", str(out), "--set", target], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert per_step_losses(killed / "metrics.jsonl") == per_step_losses(tmp_path / "straight" / "metrics.jsonl")
    a = checkpoint.read_checkpoint(run_folder.latest(killed)).weights
    b = checkpoint.read_checkpoint(run_folder.latest(tmp_path / "straight")).weights
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize(
    "command",
    [["tokenizer", "train"], ["prepare"], ["train"], ["translate"], ["run"], ["eval"], ["average"], ["attention"],
     ["export"], ["doctor"]],
)  # fmt: skip
def test_every_command_help_ends_with_examples(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0 and "Examples:" in result.output and f"mtkit {command[0]}" in result.output


def test_output_spellings_and_quiet_logging(tmp_path, corpus_files):
    """-o/--output on every command that writes, the older --out and --out-dir kept; --quiet keeps stderr to
    warnings and errors."""
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"max_steps": 2, "valid_every": 0})
    loud = invoke("train", config, "-o", tmp_path / "a")
    quiet = invoke("--quiet", "train", config, "--output", tmp_path / "b")
    assert loud.exit_code == quiet.exit_code == 0
    assert " INFO " in loud.stderr and " INFO " not in quiet.stderr
    assert invoke("--log-level", "warning", "train", config, "--out", tmp_path / "c").exit_code == 0
    assert all(run_folder.latest(tmp_path / name) is not None for name in "abc")
    s, t = corpus_files["train.en"], corpus_files["train.de"]
    for spelling in ("-o", "--output", "--out-dir"):
        folder = tmp_path / spelling.strip("-")
        assert (
            invoke("tokenizer", "train", "--src", s, "--tgt", t, spelling, folder, "--vocab-size", 200).exit_code == 0
        )
        assert (folder / "spm.model").is_file()


def test_the_command_line_starts_without_torch():
    """`mtkit --help` and shell completion run on every keystroke: they must not pay for importing torch."""
    probe = "import sys, mtkit.cli; print(sorted({'torch', 'numpy', 'sacrebleu', 'fastapi'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.fixture
def torch_threads():
    """The number of torch threads a test will set, one more than now; the count is restored after the test."""
    before = torch.get_num_threads()
    yield before + 1
    torch.set_num_threads(before)


def threads_during_search(monkeypatch) -> list[int]:
    """torch's thread count at each beam search the translator runs."""
    import mtkit.decoding.line_translator
    from mtkit.decoding.search import beam_search

    seen = []

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return beam_search(*args, **kwargs)

    monkeypatch.setattr(mtkit.decoding.line_translator, "beam_search", recording)
    return seen


def test_translate_computes_on_the_threads_it_is_given(tmp_path, spm_model, monkeypatch, torch_threads):
    """Several translating processes on one machine each take every core unless told their share."""
    run = joint_run(tmp_path, spm_model, seed=1)
    seen = threads_during_search(monkeypatch)
    result = invoke(
        "translate", run, "--threads", torch_threads, "--precision", "fp32", "--device", "cpu", input="A dog runs.\n"
    )
    assert result.exit_code == 0, result.output
    assert seen and set(seen) == {torch_threads}
    assert invoke("translate", run, "--threads", -1, input="A dog.\n").exit_code == 2  # a usage error


def test_serve_loads_its_model_on_the_threads_it_is_given(tmp_path, spm_model, monkeypatch, torch_threads):
    """The model is loaded, and every search run, after --threads is applied (the searches run in the loading
    thread)."""
    from mtkit.config import ConfigError
    from mtkit.translation import engines

    run = joint_run(tmp_path, spm_model, seed=1)
    loaded = []

    def loading_then_stopping(model, **load):
        server_translator = real_load(model, **load)
        loaded.append((torch.get_num_threads(), server_translator.precision["precision"]))
        raise ConfigError("stopped once the model was loaded")

    real_load = engines.load_translator
    monkeypatch.setattr(engines, "load_translator", loading_then_stopping)
    result = invoke("serve", run, "--port", 0, "--threads", torch_threads, "--precision", "fp32", "--device", "cpu")
    one_line_error(result, "stopped once the model was loaded")
    assert loaded == [(torch_threads, "fp32")]


def test_the_ctranslate2_engine_takes_the_thread_count_as_its_intra_threads(
    tmp_path, spm_model, monkeypatch, torch_threads
):
    import ctranslate2

    run = joint_run(tmp_path, spm_model, seed=1)
    assert invoke("export", run, "-o", tmp_path / "ct2").exit_code == 0
    made, real = [], ctranslate2.Translator

    def recording(*args, **kwargs):
        made.append(kwargs.get("intra_threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ctranslate2, "Translator", recording)
    options = ["--engine", "ctranslate2", "--threads", torch_threads, "--device", "cpu"]
    result = invoke("translate", tmp_path / "ct2", *options, input="A dog.\n")
    assert result.exit_code == 0, result.output
    assert made == [torch_threads]
