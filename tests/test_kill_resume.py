"""SIGKILL at random moments of training, again and again: every time the run resumes, exactly.

A kill -9 runs no handler and flushes nothing: it is what atomic writes and resuming are for. Each
faulty run is a subprocess that wraps one phase (an update, a validation, a checkpoint save; at the
start of a run, the tokenizer training, the data encoding and the config write) and, in the phase's
K-th call, counts Python profile events and kills itself at event N, or when the call returns. N is
drawn from the events one call makes, as counted by a first run. A random half of the kills count
every call and return (of C functions too), so they land anywhere in the phase; the others count
only the C calls that change files (open, write, fsync, rename, unlink...), so they land just before
or after one. Those windows are a few events among tens of thousands (pickling the optimizer state,
decoding), which draws over all events would almost never hit.

After each kill the run directory must hold a loadable checkpoint whose step never goes back, and a
best model wherever one was being replaced. Finished afterwards, the run must be the uninterrupted
run bit for bit: the same weights, the same metrics with each update logged once, the same files.
MTKIT_KILL_SEED=N draws another sequence of kills.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import write_config

from mtkit.model import checkpoint, loading, run_folder

SEED = int(os.environ.get("MTKIT_KILL_SEED", "20260301"))
KILLS = 20
# One thread: on a 2-core CI machine two busy-waiting torch threads make each run several times slower.
TRAIN = {
    "max_steps": 110,  # enough that every kill comes before the end (pick_call checks it)
    "save_every": 2,
    "valid_every": 3,
    "keep_last": 2,
    "log_every": 1,
    "best_metric": "loss",  # a new best/ at nearly every validation, so its replacement is killed too
    "threads": 1,
}

# Where each phase lives, as module:attribute; the trainer looks each one up when it calls it.
PHASES = {
    "step": "mtkit.training.trainer:Trainer.train_step",
    "validation": "mtkit.training.trainer:Trainer._validate_and_log",  # decoding, best/ and the metrics line
    "checkpoint": "mtkit.training.trainer:Trainer.save_last",  # the state, its rename into place, pruning
    "spm": "mtkit.training.tokenizers:train_spm",
    "config": "mtkit.files:atomic_write_text",  # first called for RUN/config.yaml
    "encode": "mtkit.training.training_data:open_training_data",
}
LOOP_PHASES = ("step", "validation", "checkpoint")
KINDS = ("any", "file")  # which events a kill counts: all calls and returns, or the C calls that change files

RUNNER = Path(__file__).with_name("kill_runner.py")  # mtkit with a fault plan; see its docstring


def mtkit_train(config: Path, run: Path, plan: dict | None = None, *overrides: str) -> subprocess.CompletedProcess:
    """``mtkit train CONFIG --out RUN`` in a subprocess that carries out ``plan``."""
    command = [sys.executable, str(RUNNER), json.dumps(plan or {}), "train", str(config), "--out", str(run)]
    command += [arg for override in overrides for arg in ("--set", override)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def tail(proc: subprocess.CompletedProcess) -> str:
    """The end of a run's log, for assertion messages."""
    return "\n".join(proc.stderr.strip().splitlines()[-15:])


@dataclass
class KillSetup:
    """What every kill test shares: configs, the calibration, and the run to compare with."""

    config: Path  # the config of the killed runs, whose tokenizer is already trained
    bare_config: Path  # the same without a tokenizer
    events: dict[str, dict[str, int]]  # events of each kind that one call of each phase makes
    reference: Path  # the run trained without faults


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory, corpus_files) -> KillSetup:
    """Count the events of each phase in a short run that also trains the tokenizer; train the reference."""
    root = tmp_path_factory.mktemp("kill_resume")
    data = {"cache_dir": str(root / "encoded")}
    bare = write_config(root / "bare.yaml", corpus_files, data=data, train=TRAIN)
    report = root / "events.json"
    counted = mtkit_train(bare, root / "counted", {"count": PHASES, "report": str(report)}, "train.max_steps=8")
    assert counted.returncode == 0, tail(counted)
    calls = json.loads(report.read_text())
    assert set(calls) == set(PHASES), calls
    # The first call of a phase in a process also does one-off work; later calls show the steady state.
    events = {
        phase: {kind: max(c[kind] for c in counts[1:] or counts) for kind in KINDS} for phase, counts in calls.items()
    }
    tokenizer = {"model": str(root / "counted" / "spm.model")}
    config = write_config(root / "run.yaml", corpus_files, data=data, tokenizer=tokenizer, train=TRAIN)
    reference = root / "reference"
    done = mtkit_train(config, reference)
    assert done.returncode == 0, tail(done)
    return KillSetup(config, bare, events, reference)


@dataclass
class Kill:
    phase: str
    call: int  # K
    kind: str
    event: int  # N
    of: int  # events of that kind in one call

    def plan(self) -> dict:
        return {"target": PHASES[self.phase], "call": self.call, "kind": self.kind, "event": self.event}

    def __str__(self) -> str:
        return f"{self.phase} call {self.call}, {self.kind} event {self.event} of {self.of}"


def draw_kill(events: dict[str, dict[str, int]], phase: str, call: int, rng: random.Random) -> Kill:
    """A SIGKILL at a random event of the ``call``-th call of ``phase``."""
    counts = events[phase]
    kind = rng.choice([kind for kind in KINDS if counts[kind]])
    return Kill(phase, call, kind, rng.randint(1, counts[kind]), counts[kind])


def calls_of(phase: str, resumed: int) -> list[int]:
    """The update at which each call of ``phase`` happens in a process that resumed at ``resumed``, before the last."""
    every = {"step": 1, "validation": TRAIN["valid_every"], "checkpoint": TRAIN["save_every"]}[phase]
    return [step for step in range(resumed + 1, TRAIN["max_steps"]) if step % every == 0]


def pick_call(phase: str, resumed: int, rng: random.Random) -> int:
    """K: one of the first two calls of ``phase`` that come after this process saved a checkpoint, bar its first call.

    A first call also does one-off work (imports, caches), unlike the calls whose events were counted.
    The checkpoint first means each process moves the run on; ``calls_of`` stops before the last update,
    so each process ends by the kill.
    """
    first_save = calls_of("checkpoint", resumed)[0]
    later = [k for k, step in enumerate(calls_of(phase, resumed), 1) if k >= 2 and step > first_save]
    assert later, f"train.max_steps {TRAIN['max_steps']} leaves no {phase} call to kill after update {resumed}"
    return rng.choice(later[:2])


def check_run_directory(run: Path, previous_step: int, where: str) -> int:
    """What a kill must leave: loadable checkpoints, the step not gone back, a best model, parseable metrics."""
    latest = run_folder.latest(run)
    assert latest is not None, f"{where}: no checkpoint left in {run}"
    step = checkpoint.read_checkpoint(latest).meta["step"]
    assert step >= previous_step, f"{where}: the newest checkpoint went back from update {previous_step} to {step}"
    for path in run_folder.run_checkpoints(run):
        assert checkpoint.read_checkpoint(path).state is not None, f"{where}: {path} has no training state"
    if (run / "best").exists() or (run / ".best.old").exists():
        best = loading.resolve(run)
        meta = checkpoint.read_checkpoint(best, with_state=False).meta
        assert "validation" in meta, f"{where}: the best model is lost: {best}"
    lines = (run / "metrics.jsonl").read_text().split("\n")
    for number, line in enumerate(lines[:-1], 1):  # the last one is empty, or a line torn by the kill
        try:
            json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"{where}: metrics.jsonl line {number} is not JSON: {line!r}")
    return step


def logged(run: Path) -> list[tuple]:
    """(event, step, loss) of each update and validation in metrics.jsonl, in order."""
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        (e["event"], e["step"], e.get("loss", e.get("valid_loss"))) for e in events if e["event"] in ("train", "valid")
    ]


def files(run: Path) -> list[str]:
    """Every file and folder under ``run``, hidden ones too."""
    return sorted(str(path.relative_to(run)) for path in run.rglob("*"))


def assert_same_weights(a: Path, b: Path) -> None:
    mine = checkpoint.read_checkpoint(a, with_state=False).weights
    theirs = checkpoint.read_checkpoint(b, with_state=False).weights
    assert mine.keys() == theirs.keys()
    different = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not different, f"{a} and {b} differ in {different}"


def test_sigkill_at_random_moments_then_resume_reproduces_the_uninterrupted_run(kill_setup, tmp_path):
    rng = random.Random(SEED)
    run = tmp_path / "run"
    step = 0
    for kill in range(1, KILLS + 1):
        phase = LOOP_PHASES[(kill - 1) % len(LOOP_PHASES)]
        fault = draw_kill(kill_setup.events, phase, pick_call(phase, step, rng), rng)
        where = f"MTKIT_KILL_SEED={SEED}, kill {kill}: {fault}, resumed at update {step}"
        print(where)
        proc = mtkit_train(kill_setup.config, run, fault.plan())
        assert proc.returncode == -9, f"{where}: exit status {proc.returncode}, not SIGKILL\n{tail(proc)}"
        step = check_run_directory(run, step, where)

    done = mtkit_train(kill_setup.config, run)
    assert done.returncode == 0, tail(done)
    last = run_folder.latest(run)
    assert checkpoint.read_checkpoint(last).meta["step"] == TRAIN["max_steps"]
    assert_same_weights(last, run_folder.latest(kill_setup.reference))
    assert_same_weights(loading.resolve(run), loading.resolve(kill_setup.reference))
    assert logged(run) == logged(kill_setup.reference)
    left, expected = files(run), files(kill_setup.reference)  # no temporary, set-aside or half-deleted leftovers
    assert left == expected, (
        f"left over: {sorted(set(left) - set(expected))}, missing: {sorted(set(expected) - set(left))}"
    )


def test_sigkill_while_a_run_starts_then_resume(kill_setup, tmp_path):
    rng = random.Random(SEED)
    run, fresh_cache = tmp_path / "run", f"data.cache_dir={tmp_path / 'encoded'}"
    for phase in ("spm", "encode", "config"):  # in the order a start goes through them, so each is reached
        fault = draw_kill(kill_setup.events, phase, 1, rng)
        where = f"MTKIT_KILL_SEED={SEED}: {fault}"
        print(where)
        proc = mtkit_train(kill_setup.bare_config, run, fault.plan(), fresh_cache, "train.max_steps=2")
        assert proc.returncode == -9, f"{where}: exit status {proc.returncode}, not SIGKILL\n{tail(proc)}"
    done = mtkit_train(kill_setup.bare_config, run, None, fresh_cache, "train.max_steps=2")
    assert done.returncode == 0, tail(done)
    assert checkpoint.read_checkpoint(run_folder.latest(run)).meta["step"] == 2
    left = [path for path in [*run.glob(".*"), *(tmp_path / "encoded").glob(".*")] if not path.name.endswith(".lock")]
    assert not left, f"leftovers of the killed runs: {left}"
