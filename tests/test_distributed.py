"""Data-parallel training on CPU with gloo: 2 processes behave like 1 process with the same global batch."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import small_config, write_config

from mtkit.config import from_dict
from mtkit.model import checkpoint, run_folder
from mtkit.model.loss import TrainingObjective
from mtkit.training.distributed import DistributedError, from_environment
from mtkit.training.trainer import Trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_worker(rank: int, world: int, port: int, cfg_dict: dict, out: str, fault: str | None) -> None:
    """One rank of a training job, as torchrun would start it; writes its parameters and outcome to ``out``."""
    from mtkit.config import from_dict

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    cfg = from_dict(cfg_dict)
    dist = from_environment("cpu", cfg.train.ddp_timeout)
    if rank == 1 and fault is not None:
        inject(fault)
    trainer = Trainer(cfg, Path(out), dist=dist)
    outcome: dict = {}
    try:
        outcome["result"] = trainer.run()
    except DistributedError as err:
        outcome["error"] = str(err)
    torch.save(
        {"params": trainer.model.state_dict(), "progress": vars(trainer.progress), **outcome},
        Path(out) / f"rank{rank}.pt",
    )
    if "error" not in outcome:
        dist.close()


def inject(fault: str) -> None:
    """Rank 1 runs out of memory on its 3rd forward, or hangs there ("hang")."""
    original = TrainingObjective.forward
    calls = {"n": 0}

    def faulty(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            if fault == "oom":
                raise torch.OutOfMemoryError("injected")
            time.sleep(3600)
        return original(self, *args)

    TrainingObjective.forward = faulty


def run_ranks(cfg, out: Path, world: int = 2, fault: str | None = None, wait: float = 180) -> list[dict]:
    """Start ``world`` ranks, wait for rank 0, stop any rank still running; each rank's record."""
    out.mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=rank_worker, args=(r, world, port, cfg.to_dict(), str(out), fault)) for r in range(world)
    ]
    for p in procs:
        p.start()
    procs[0].join(wait)
    for p in procs[1:]:
        p.join(10 if fault != "hang" else 0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert procs[0].exitcode == 0, f"rank 0 exited with {procs[0].exitcode}"
    return [
        torch.load(out / f"rank{r}.pt", weights_only=True) if (out / f"rank{r}.pt").is_file() else {}
        for r in range(world)
    ]


def train_losses(run: Path) -> dict[int, float]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def deterministic_config(corpus_files, spm_model, **train):
    """Without dropout, so that ranks and a single process draw no random numbers that could differ."""
    raw = small_config(corpus_files, spm_model, **train).to_dict()
    return from_dict({**raw, "model": {**raw["model"], "dropout": 0.0}})


def test_two_ranks_make_the_updates_of_one_process_with_the_same_global_batch(tmp_path, corpus_files, spm_model):
    steps = {"max_steps": 6, "save_every": 3, "valid_every": 6, "valid_bleu": True, "best_metric": "bleu"}
    single = Trainer(deterministic_config(corpus_files, spm_model, accum=2, **steps), tmp_path / "one")
    single_result = single.run()
    ranks = run_ranks(deterministic_config(corpus_files, spm_model, accum=1, **steps), tmp_path / "two")

    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert list(two) == [1, 2, 3, 4, 5, 6]  # one line per update: only rank 0 logs
    assert two == pytest.approx(one, rel=1e-5)
    for name, value in single.model.state_dict().items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        if not name.endswith("k_proj.bias"):
            # Softmax ignores a shift shared by all keys, so a key bias has a true gradient of 0 and Adam
            # turns its float noise into full-size steps; every other weight must agree to float noise.
            assert torch.allclose(ranks[0]["params"][name], value, atol=1e-6), name
    # Validation runs on rank 0 over the whole set and both ranks act on its result.
    assert ranks[0]["result"]["valid_bleu"] == ranks[1]["result"]["valid_bleu"] == single_result["valid_bleu"]
    assert ranks[0]["result"]["valid_loss"] == pytest.approx(single_result["valid_loss"], rel=1e-5)
    assert ranks[0]["progress"] == ranks[1]["progress"]
    assert [p.name for p in run_folder.run_checkpoints(tmp_path / "two")] == ["update-00000003", "update-00000006"]
    saved = checkpoint.read_checkpoint(run_folder.latest(tmp_path / "two"))
    assert len(saved.state["rng"]) == 2  # each rank's dropout stream, for an exact resume


def test_an_out_of_memory_rank_makes_every_rank_skip_the_update(tmp_path, corpus_files, spm_model):
    ranks = run_ranks(small_config(corpus_files, spm_model, max_steps=4), tmp_path / "run", fault="oom")
    for rank in ranks:
        assert rank["progress"]["oom_skips"] == 1 and rank["progress"]["step"] == 4
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_a_hung_rank_ends_the_job_with_a_message_naming_it(tmp_path, corpus_files, spm_model):
    cfg = small_config(corpus_files, spm_model, max_steps=10, ddp_timeout=3)
    start = time.monotonic()
    ranks = run_ranks(cfg, tmp_path / "run", fault="hang", wait=60)
    assert time.monotonic() - start < 50
    assert "rank(s) 1 stopped responding" in ranks[0]["error"]


def test_nproc_per_node_trains_validates_and_resumes_through_torchrun(tmp_path, corpus_files):
    config = write_config(tmp_path / "c.yaml", corpus_files, train={"max_steps": 4, "valid_every": 2})
    run = tmp_path / "run"
    command = [sys.executable, "-m", "mtkit", "train", str(config), "--out", str(run), "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 2 joined (gloo)" in done.stderr and "final validation BLEU" in done.stderr
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "valid"] == [2, 4]
    more = subprocess.run(
        [*command, "--set", "train.max_steps=6"], capture_output=True, text=True, env=env, timeout=300
    )
    assert more.returncode == 0, more.stderr
    assert "at update 4" in more.stderr
    assert checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"] == 6


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_launcher_makes_the_ranks_save_and_exit(tmp_path, corpus_files, how):
    """SIGTERM is passed on by torchrun; after SIGKILL the ranks learn of their launcher's death from Linux."""
    config = write_config(
        tmp_path / "c.yaml", corpus_files, train={"max_steps": 100_000, "valid_every": 0, "log_every": 1}
    )
    run = tmp_path / "orphans"
    command = [sys.executable, "-m", "mtkit", "train", str(config), "--out", str(run), "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
        assert launcher.poll() is None and time.monotonic() < deadline, "training never got going"
        time.sleep(0.05)
    ranks = [pid for pid in processes_mentioning(str(run)) if pid != launcher.pid]
    assert len(ranks) == 2
    launcher.send_signal(how)
    _, err = launcher.communicate(timeout=60)
    if how == signal.SIGTERM:
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert "stopped by SIGTERM" in err.splitlines()[-1] and "Traceback" not in err
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in ranks):
        assert time.monotonic() < deadline, "ranks kept running after their launcher was killed"
        time.sleep(0.1)
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert run_folder.latest(run) is not None, err
    assert checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"] == logged[-1]


@pytest.mark.parametrize("fault", ["missing-file", "bad-line"])
def test_bad_input_under_nproc_per_node_is_one_error_line(tmp_path, corpus_files, fault):
    """A missing file once gave three error lines and a false 'rank 0 stopped responding (hung or dead)'.

    A missing file is found before the ranks start; a bad line only while rank 0 trains the tokenizer,
    with the other rank waiting: rank 0 says what is wrong, the others and the launcher stay quiet.
    """
    bad = tmp_path / "bad.de"
    if fault == "bad-line":
        lines = corpus_files["train.de"].read_bytes().split(b"\n")
        lines[100] = b"\xff\xfe not UTF-8"
        bad.write_bytes(b"\n".join(lines))
    config = write_config(tmp_path / "c.yaml", corpus_files, data={"train_tgt": str(bad)}, train={"max_steps": 2})
    command = [
        sys.executable,
        "-m",
        "mtkit",
        "train",
        str(config),
        "--out",
        str(tmp_path / "run"),
        "--nproc-per-node",
        "2",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    expected = "bad.de: file not found" if fault == "missing-file" else "bad.de:101: invalid UTF-8"
    assert errors[0].startswith("error: ") and expected in errors[0] and "hung or dead" not in done.stderr


def test_one_rank_under_torchrun_trains_as_one_process_alone(tmp_path, corpus_files):
    """--nproc-per-node 1 joins a process group of one rank and runs the data-parallel code (the agreement, the
    gradient all-reduce): the losses are those of the same training in one process alone."""
    sections = {"train": {"max_steps": 6, "valid_every": 0, "log_every": 1}, "model": {"dropout": 0.0}}
    config = write_config(tmp_path / "c.yaml", corpus_files, **sections)
    losses = {}
    for ranks in ([], ["--nproc-per-node", "1"]):
        run = tmp_path / f"run{len(ranks)}"
        command = [sys.executable, "-m", "mtkit", "train", str(config), "--out", str(run), *ranks]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert ("rank 0 of 1 joined (gloo)" in done.stderr) == bool(ranks)
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[bool(ranks)] = [(line["loss"], line["grad_norm"]) for line in lines if line["event"] == "train"]
    assert len(losses[True]) == 6 and losses[True] == losses[False]
