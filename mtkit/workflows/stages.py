"""What `mtkit run` records of its stages: each one's wall clock, and how each output was made (RUN/stages.json),
so that a re-run can tell what is up to date; the one way a stage with work to do runs (``run_stage``: up to date?
otherwise run, time, record); and what its chains share: training as one of the run's stages, and the device and
precision a long translation is decoded in."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtkit.files import atomic_write_text, file_sha256

if TYPE_CHECKING:
    from mtkit.config import RunConfig
    from mtkit.training.reporting import Reporter

log = logging.getLogger("mtkit")

STAGE_RECORD = "stages.json"
RECORD_FORMAT = 1
_RECORD_MAX_BYTES = 1 << 20  # a record is a few KB; anything larger is not one mtkit wrote


@dataclass
class Stage:
    name: str
    seconds: float
    ran: bool  # False: its output was already up to date
    note: str = ""
    incomplete: str = ""  # why the model this stage trained was cut short (train.max_time): the run is incomplete


class StageRun:
    """A stage while ``run_stage`` times it: what its block sets for the report, and what the record says of it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ran = True  # False: its output was already up to date
        self.note = ""
        self.incomplete = ""  # as Stage.incomplete
        self.entry: dict = {}  # its record entry once ``out_of_date`` is asked (a new one as the block ends)
        self._to_record: tuple[StageRecord, Path, dict[str, str], dict[str, Any]] | None = None

    def out_of_date(
        self,
        record: StageRecord,
        output: Path,
        inputs: dict[str, str],
        settings: dict[str, Any],
        also: Collection[Path] = (),
    ) -> bool:
        """Whether the block must make ``output`` (and ``also``, the other files the stage writes): True unless
        ``record`` says ``output`` was made from ``inputs`` with ``settings`` and every file is there. When True,
        ``record`` learns of the new output as the block ends."""
        entry = record.current(self.name, output, inputs, settings)
        self.entry = entry or {}
        self.ran = entry is None or not all(path.is_file() for path in also)
        self._to_record = (record, output, inputs, settings) if self.ran else None
        return self.ran

    def _record_output(self) -> None:
        if self._to_record is not None:
            record, output, inputs, settings = self._to_record
            self.entry = record.write(self.name, output, inputs, settings)


@contextmanager
def run_stage(stages: list[Stage], name: str) -> Iterator[StageRun]:
    """Time the block as the stage ``name`` and add it to ``stages``, with what the block set on its StageRun.

    A block that asks ``StageRun.out_of_date`` does the stage's work only when that says so, and the record learns
    of the output the block made once it ends; a block that raises adds nothing and records nothing."""
    stage = StageRun(name)
    start = time.perf_counter()
    yield stage
    stage._record_output()
    stages.append(Stage(name, time.perf_counter() - start, stage.ran, stage.note, stage.incomplete))


def train_stage(cfg: RunConfig, out: Path, reporter: Reporter | None, label: str, restart: bool) -> dict:
    """Train ``cfg`` into ``out`` as the run's training ``label`` (train, reverse, teacher), from update 0 when
    ``restart``, else resuming; the result of training, with its "stop".

    A run directory that cannot go on training (its data, tokenizer or model settings changed, as they do when
    an earlier stage of a chain made new data) is refused in one line whose advice is what `mtkit run` takes:
    ``--restart LABEL``."""
    from mtkit.training.resume import ResumeRefused
    from mtkit.training.trainer import run_training

    try:
        return run_training(cfg, out, reporter, restart=restart)
    except ResumeRefused as refused:
        advice = f"to train it again from the start, run `mtkit run` with --restart {label}"
        raise ResumeRefused(refused.problem, advice) from None


def decoding(device: str) -> dict[str, str]:
    """Where a chain's long translation is decoded and in what number format, ``auto`` resolved on this machine: the
    translation's parts are keyed with it, since bf16 and fp32 (or a GPU and a CPU) translate a line differently,
    and a run resumed on another machine must not join the parts of both."""
    from mtkit.runtime import pick_device, resolve_precision

    chosen = pick_device(device)
    return {"device": chosen.type, "precision": resolve_precision("auto", chosen).precision}


class Digests:
    """SHA-256 of files, each file read at most once per `mtkit run` unless this run rewrites it.

    The average's inputs are the weight files of K checkpoints: hashing costs one read of each, which
    is why none is read twice. Translating the average reuses the digest the average stage took.
    """

    def __init__(self) -> None:
        self._known: dict[Path, str] = {}

    def of(self, path: Path) -> str:
        if path not in self._known:
            self._known[path] = file_sha256(path)
        return self._known[path]

    def rewritten(self, path: Path) -> str:
        """The digest of ``path`` as this run has just written it (any digest known before is stale)."""
        self._known.pop(path, None)
        return self.of(path)


class StageRecord:
    """RUN/stages.json: how each stage's output was made, so a re-run can tell whether it is up to date.

    ``{"format": 1, "stages": {STAGE: {"output": NAME, "inputs": {WHAT: SHA256}, "settings": {...},
    "output_sha256": SHA256}}}``, NAME relative to the run directory. The file is read as untrusted
    data: whatever it holds can only fail to match, which redoes the stage.
    """

    def __init__(self, out: Path, digests: Digests) -> None:
        self.out = out
        self.path = out / STAGE_RECORD
        self.digests = digests
        self._stages = _read_stages(self.path)

    def current(self, stage: str, output: Path, inputs: dict[str, str], settings: dict[str, Any]) -> dict | None:
        """The entry of ``stage`` if ``output`` is what it wrote from ``inputs`` with ``settings``, else None."""
        entry = self._stages.get(stage)
        if not isinstance(entry, dict) or "output_sha256" not in entry:
            return None
        made = {key: value for key, value in entry.items() if key != "output_sha256"}
        if made != self._made(output, inputs, settings) or not output.is_file():
            return None
        return entry if entry["output_sha256"] == self.digests.of(output) else None

    def write(self, stage: str, output: Path, inputs: dict[str, str], settings: dict[str, Any]) -> dict:
        """Record that ``stage`` has just written ``output`` from ``inputs`` with ``settings``; the new entry."""
        entry = {**self._made(output, inputs, settings), "output_sha256": self.digests.rewritten(output)}
        self._stages[stage] = entry
        atomic_write_text(self.path, json.dumps({"format": RECORD_FORMAT, "stages": self._stages}, indent=1) + "\n")
        return entry

    def _made(self, output: Path, inputs: dict[str, str], settings: dict[str, Any]) -> dict:
        """An entry less its output digest, as it reads back from JSON (tuples as lists), so it compares equal."""
        return json.loads(
            json.dumps({"output": str(output.relative_to(self.out)), "inputs": inputs, "settings": settings})
        )


def _read_stages(path: Path) -> dict:
    """The stages recorded in ``path``; none when it is missing, or not a record of this format."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_RECORD_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as err:
        log.warning("%s: unreadable (%s); redoing the stages it records", path, err.strerror)
        return {}
    try:
        record = json.loads(raw) if len(raw) <= _RECORD_MAX_BYTES else None
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError), or nested too deep
        record = None
    if isinstance(record, dict) and record.get("format") == RECORD_FORMAT and isinstance(record.get("stages"), dict):
        return record["stages"]
    log.warning("%s: not a stage record mtkit wrote; redoing the stages it records", path)
    return {}
