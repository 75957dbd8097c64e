"""Training: data and tokenizer set-up, the optimisation loop, validation and checkpoints.

Re-running on a run directory that holds a checkpoint resumes from the newest one: model, optimizer,
scaler, progress, every rank's RNG state and the position in the data, so the remaining updates see
the same batches. Under torchrun each rank trains on its share of every update's batches and rank 0
alone validates and writes files; ranks agree after each update on anything that could make them
part ways (a rank out of memory, a stop signal, a non-finite loss).

``Trainer`` has a recipe's shape: ``__init__`` is a list of named ``_setup_*`` steps, ``run()`` trains
to the budget and ends with ``cleanup()``. What it writes goes through ``RunDirectory``; what a
skipped update leads to is decided by ``SkipPolicy``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
import signal
import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mtkit import files, untrusted
from mtkit.config import ConfigError, RunConfig, TrainConfig
from mtkit.data.parallel import Batch, DataError, check_input_file, collate, iter_parallel, read_parallel, token_batches
from mtkit.data.token_store import TokenStore, default_cache_dir, open_or_build, store_key
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_spm
from mtkit.decoding.translate import Translator
from mtkit.errors import TrainingFailed
from mtkit.files import file_sha256
from mtkit.model import checkpoint
from mtkit.model.loss import TrainingObjective
from mtkit.model.transformer import build_model, count_parameters
from mtkit.progress import StageProgress
from mtkit.runtime import autocast, hardware, pick_device, require, resolve_precision, seed_everything, set_threads
from mtkit.scoring.metrics import bleu
from mtkit.training.distributed import Distributed
from mtkit.training.run_directory import RunDirectory

log = logging.getLogger("mtkit")

MAX_CONSECUTIVE_OOMS = 5  # out-of-memory skips in a row before training stops with advice
MAX_CONSECUTIVE_SKIPS = 25  # skipped updates of any kind in a row that mean training has diverged


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` updates, then inverse square-root decay (step >= 1)."""
    if warmup == 0:
        return peak
    return peak * min(step / warmup, math.sqrt(warmup / step))


class TrainingStopped(Exception):
    """Training ended early on SIGINT/SIGTERM, after saving the last checkpoint."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at update {step}")
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM become a request that the loop honours between updates.

    So the checkpoint written on the way out always holds a whole number of updates (an interrupt
    in the middle of a step could otherwise save updated weights with the old step count).
    A second Ctrl-C (SIGINT) aborts at once. Repeated SIGTERMs do not: a scheduler and torchrun
    may both pass one on, and the checkpoint must still be written.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            log.warning("%s received again", signal.Signals(signum).name)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signum
        log.warning("%s received: saving a checkpoint after this update", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Reporter(Protocol):
    """Where progress goes; the CLI draws it with Rich, tests and scripts can log it."""

    def start(self, total_steps: int, done_steps: int) -> None: ...
    def update(self, step: int, stats: dict) -> None: ...
    def finish(self) -> None: ...


class LogReporter:
    def start(self, total_steps: int, done_steps: int) -> None:
        log.info("training from update %d to %d", done_steps, total_steps)

    def update(self, step: int, stats: dict) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass
class LogWindow:
    """Target tokens since a clock start, for throughput; the loss sums live in Progress, to survive a resume."""

    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)


@dataclass
class Progress:
    """The resumable position of a run."""

    step: int = 0  # updates applied
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of this epoch already consumed, by all ranks together
    best: float | None = None  # best validation metric so far (higher is better)
    stale: int = 0  # validations since the best one
    seconds: float = 0.0  # training wall clock so far, across resumed runs
    lr_scale: float = 1.0  # lowered by each rollback after a non-finite loss
    rollbacks: int = 0
    oom_skips: int = 0  # updates skipped because a rank ran out of memory
    overflow_skips: int = 0  # fp16 updates the loss scaler skipped (gradient overflow)
    nonfinite_skips: int = 0  # fp32/bf16 updates skipped under train.nonfinite: skip
    validated: int = 0  # the update of the newest validation whose outcome best and stale hold
    # Sums over the updates since the last metrics line, so the first line after a resume is the same
    # mean an uninterrupted run logs.
    log_loss: float = 0.0
    log_nll: float = 0.0
    log_updates: int = 0

    def counters(self) -> dict:
        return {
            "oom_skips": self.oom_skips,
            "overflow_skips": self.overflow_skips,
            "nonfinite_skips": self.nonfinite_skips,
            "rollbacks": self.rollbacks,
        }


class SkipPolicy:
    """What a skipped update leads to: counted while training goes on, a rollback, or TrainingFailed.

    Runs of skips end training: MAX_CONSECUTIVE_OOMS out-of-memory skips in a row (the batches are
    too big for the device) or MAX_CONSECUTIVE_SKIPS skips of any kind (training has diverged). A
    non-finite loss is skipped, rolled back or fatal as train.nonfinite says.
    """

    def __init__(self, tc: TrainConfig) -> None:
        self.tc = tc
        self.in_a_row = 0  # updates skipped since the last applied update or rollback

    def reset(self) -> None:
        """An update went through, or training rolled back: a run of skips is over."""
        self.in_a_row = 0

    def skipped(self, stats: dict, progress: Progress) -> bool:
        """Count the update ``stats`` says was skipped in ``progress``; whether it calls for a rollback."""
        kind, p, tc = stats["skipped"], progress, self.tc
        self.in_a_row += 1
        if kind == "oom":
            p.oom_skips += 1
            log.warning(
                "update %d: out of memory on %d rank(s); its batches are skipped (%d so far)",
                p.step + 1,
                stats["oom_ranks"],
                p.oom_skips,
            )
            if self.in_a_row >= MAX_CONSECUTIVE_OOMS:
                raise TrainingFailed(
                    f"out of memory in {self.in_a_row} updates in a row: lower train.batch_tokens "
                    f"(now {tc.batch_tokens}) and raise train.accum to keep the effective batch"
                )
        elif kind == "overflow":
            p.overflow_skips += 1
        elif tc.nonfinite == "skip":
            p.nonfinite_skips += 1
            log.warning("update %d: non-finite loss or gradient; update skipped (train.nonfinite: skip)", p.step + 1)
        else:
            return True
        if self.in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise TrainingFailed(
                f"{self.in_a_row} updates in a row skipped ({kind}) at update {p.step + 1}: "
                "training has diverged; lower train.lr or use precision fp32"
            )
        return False

    def rollback_target(self, progress: Progress, latest: Path | None) -> Path:
        """The checkpoint to roll back to from a non-finite loss; TrainingFailed where no rollback is allowed."""
        tc, p = self.tc, progress
        if tc.nonfinite == "stop" or latest is None or p.rollbacks >= tc.max_rollbacks:
            if tc.nonfinite == "stop":
                why = "train.nonfinite is stop"
            elif latest is None:
                why = "no checkpoint to roll back to yet"
            else:
                why = f"already rolled back {p.rollbacks} times (train.max_rollbacks)"
            kept = f"; last good checkpoint: {latest}" if latest is not None else ""
            raise TrainingFailed(
                f"{_nonfinite_at(p.step + 1, tc.precision)}; {why}{kept}; lower train.lr or use precision fp32"
            )
        return latest


def _nonfinite_at(step: int, precision: str) -> str:
    return f"non-finite loss or gradient at update {step} (precision {precision})"


def prepare_tokenizers(
    cfg: RunConfig, out_dir: Path, pairs: Callable[[], Iterable[tuple[str, str]]]
) -> tuple[Tokenizer, Tokenizer]:
    """The run's tokenizer(s): already in the run directory, copied from the config, or trained now.

    Training streams ``pairs()``; SentencePiece keeps a sample of tokenizer.input_sentence_size sentences.
    """
    names = checkpoint.tokenizer_files(cfg)
    tc = cfg.tokenizer
    given = {"src": tc.model, "tgt": tc.model} if tc.joint else {"src": tc.src_model, "tgt": tc.tgt_model}
    for side in ("src", "tgt"):
        target = out_dir / names[side]
        if target.is_file():
            _check_run_tokenizer(target, given[side], tc.vocab_size)
            continue
        if given[side]:
            _copy_tokenizer(Path(given[side]), target)
        else:
            _train_tokenizer(cfg, side, target, pairs)
    return Tokenizer(out_dir / names["src"]), Tokenizer(out_dir / names["tgt"])


def _copy_tokenizer(source: Path, target: Path) -> None:
    if not source.is_file():
        raise DataError(f"{source}: tokenizer model not found")
    vocab = source.with_suffix(".vocab")
    if vocab.is_file():  # the .vocab first: a model in the run directory is always a whole pair
        files.copy_file(vocab, target.with_suffix(".vocab"))
    files.copy_file(source, target)


def _train_tokenizer(cfg: RunConfig, side: str, target: Path, pairs: Callable[[], Iterable[tuple[str, str]]]) -> None:
    tc = cfg.tokenizer
    if tc.joint:
        sentences = itertools.chain.from_iterable(pairs())
    else:
        sentences = (pair[0 if side == "src" else 1] for pair in pairs())
    sample = f"a sample of {tc.input_sentence_size:,}" if tc.input_sentence_size else "all"
    log.info(
        "training %s SentencePiece %s model (%d pieces) on %s training sentences",
        "joint" if tc.joint else side,
        tc.type,
        tc.vocab_size,
        sample,
    )
    sources = " and ".join(filter(None, (cfg.data.train_src, cfg.data.train_tgt)))
    train_spm(sentences, target.with_suffix(""), tc, source=sources)


def _check_run_tokenizer(path: Path, given: str, vocab_size: int) -> None:
    """A tokenizer already in the run directory is reused, so it must be the one the config asks for."""
    if given:
        if Path(given).is_file() and file_sha256(Path(given)) != file_sha256(path):
            raise ConfigError(f"{path} differs from the config's tokenizer model {given}; use a new --out or --restart")
        return
    found = Tokenizer(path).vocab_size
    if found != vocab_size:
        raise ConfigError(
            f"{path} has {found} pieces but tokenizer.vocab_size is {vocab_size}; use a new --out or --restart"
        )


def open_training_data(cfg: RunConfig, src_tok: Tokenizer, tgt_tok: Tokenizer) -> TokenStore:
    """The training pairs as a memory-mapped token store, encoded now unless an earlier run did it."""
    data = cfg.data
    paths = [data.train_src, data.train_tgt] if data.train_tgt else [data.train_src]
    key = store_key(paths, src_tok, tgt_tok, data.max_tokens, data.max_ratio)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    return open_or_build(cache_dir, iter_parallel(data.train_src, data.train_tgt), key, src_tok, tgt_tok)


class Trainer:
    """One training run (one rank's share of it): set up by named steps, then ``run()`` to the budget."""

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: Path,
        reporter: Reporter | None = None,
        dist: Distributed | None = None,
        restart: bool = False,
    ) -> None:
        """Set up data, tokenizer, model and optimizer; resume from the newest checkpoint unless ``restart``."""
        self.cfg = cfg
        self.dist = dist or Distributed(timeout_s=cfg.train.ddp_timeout)
        self.is_main = self.dist.is_main
        self.reporter = (reporter if self.is_main else None) or LogReporter()
        self.run_dir = RunDirectory(out_dir)
        self._setup_runtime()
        check_trainable(cfg)
        self.valid_src, self.valid_tgt = self._read_valid()
        if self.is_main:
            self.run_dir.claim(restart)
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        self.progress, self.skips = Progress(), SkipPolicy(replace(cfg.train, precision=self.precision.precision))
        resumed = self._resume()
        if self.is_main:  # only now: a refused resume leaves the config that describes the checkpoints
            self.run_dir.start_log(cfg, self.progress.step, self.progress.validated)
            self._log_metrics(self._start_record())
        self._setup_forward()
        if cfg.train.tensorboard and self.is_main:
            self.run_dir.open_tensorboard()
        self._signals: StopSignals | None = None
        self._clock = time.perf_counter()
        self._saved = self.progress.step if resumed else -1  # the update of the newest checkpoint

    # -- set-up -----------------------------------------------------------------------------

    def _setup_runtime(self) -> None:
        """Threads, device and compute dtype; the same seed on every rank, so the same initial weights."""
        tc = self.cfg.train
        set_threads(tc.threads)
        self.device = self.dist.device(tc.device) or pick_device(tc.device)
        self.precision = resolve_precision(tc.precision, self.device)
        self.dtype = self.precision.dtype
        self.hardware = hardware(self.device)
        log.info("precision %s on %s", self.precision, self.hardware)
        seed_everything(tc.seed)

    def _start_record(self) -> dict:
        """What metrics.jsonl says of each start: the update it starts from, the machine, and the precision
        (``auto`` resolved), which report.md shows."""
        return {
            "event": "start",
            "step": self.progress.step,
            "device": str(self.device),
            "hardware": self.hardware,
            **self.precision.to_dict(),
        }

    def _setup_data(self) -> None:
        """Tokenizers and the encoded training pairs, made (or found) by rank 0 first; validation batches."""
        cfg, out_dir = self.cfg, self.run_dir.path

        def pairs() -> Iterator[tuple[str, str]]:
            return iter_parallel(cfg.data.train_src, cfg.data.train_tgt)

        if self.is_main:
            src_tok, tgt_tok = prepare_tokenizers(cfg, out_dir, pairs)
            self.corpus = open_training_data(cfg, src_tok, tgt_tok)
        self.dist.barrier()  # the other ranks read the tokenizer and the encoded pairs rank 0 made (or found)
        self.src_tok, self.tgt_tok = prepare_tokenizers(cfg, out_dir, pairs)
        if not self.is_main:
            self.corpus = open_training_data(cfg, self.src_tok, self.tgt_tok)
        self.valid_batches = self._valid_loss_batches() if self.is_main else []
        self._epoch_indices: tuple[int, list[np.ndarray]] = (0, [])

    def _setup_model(self) -> None:
        """The model and its loss; then dropout seeded per rank, so masks differ between ranks."""
        tc = self.cfg.train
        self.model = build_model(self.cfg.model, self.src_tok.vocab_size, self.tgt_tok.vocab_size, PAD_ID)
        self.model.to(self.device)
        log.info("model: %s parameters", f"{count_parameters(self.model):,}")
        self.objective = TrainingObjective(self.model, tc.label_smoothing, self.dtype)
        if self.dist.enabled:
            torch.manual_seed(tc.seed + 1_000_003 * self.dist.rank)

    def _setup_optimizer(self) -> None:
        tc = self.cfg.train
        # fused: one kernel for all parameters; 4.5 ms instead of 12.4 ms per update on the Multi30k model (CPU)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=tc.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=tc.weight_decay, fused=True
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.precision == "fp16")

    def _resume(self) -> bool:
        """Load the newest checkpoint of the run directory, if there is one; whether there was."""
        latest = self.run_dir.latest()
        if latest is None:
            return False
        try:
            self._load(latest)
        except checkpoint.UnreadableCheckpoint as err:
            older = self.run_dir.checkpoints()[:-1]
            if not older:
                raise
            raise checkpoint.CheckpointError(f"{err}; delete {latest} to resume from {older[-1]}") from None
        log.info("resuming from %s at update %d (epoch %d)", latest, self.progress.step, self.progress.epoch)
        return True

    def _setup_forward(self) -> None:
        """What a training step calls: the loss, wrapped for data parallelism under torchrun, compiled if asked."""
        self.forward = self._data_parallel() if self.dist.enabled else self.objective
        if self.cfg.train.compile:
            self.objective.compile_features()

    def _read_valid(self) -> tuple[list[str], list[str]]:
        data = self.cfg.data
        if not data.valid_src:
            return [], []
        return read_parallel(data.valid_src, data.valid_tgt)

    def _valid_loss_batches(self) -> list[Batch]:
        """The validation pairs the loss can be computed on, encoded and batched once for the whole run.

        A pair with an empty side, or one longer than the model's positions, is left out of the loss
        and counted (BLEU still translates every line, truncating as ``translate`` does). A set with
        no such pair is refused now, before any update, rather than at the first validation.
        """
        if not self.valid_src:
            return []
        limit = self.cfg.model.max_positions - 1  # each side gets an eos or bos
        src_ids, tgt_ids = self.src_tok.encode(self.valid_src), self.tgt_tok.encode(self.valid_tgt)
        pairs = [(s, t) for s, t in zip(src_ids, tgt_ids) if s and t and len(s) <= limit and len(t) <= limit]
        empty = sum(1 for s, t in zip(src_ids, tgt_ids) if not s or not t)
        too_long = len(src_ids) - len(pairs) - empty
        where = " and ".join(filter(None, (self.cfg.data.valid_src, self.cfg.data.valid_tgt)))
        if not pairs:
            raise DataError(
                f"{where}: no validation pair to compute a loss on ({empty} with an empty side, "
                f"{too_long} longer than model.max_positions {self.cfg.model.max_positions} allows)"
            )
        if empty or too_long:
            log.warning(
                "validation loss leaves out %d of %d pairs of %s: %d with an empty side, %d longer than %d tokens",
                empty + too_long, len(src_ids), where, empty, too_long, limit,
            )  # fmt: skip
        src, tgt = [s for s, _ in pairs], [t for _, t in pairs]
        batches = token_batches([len(s) for s in src], [len(t) for t in tgt], self.cfg.train.batch_tokens, seed=0)
        return [collate([src[i] for i in b], [tgt[i] for i in b]) for b in batches]

    def _data_parallel(self) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers (the sinusoidal table) never change, so there is nothing to broadcast before each forward.
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
        return DistributedDataParallel(self.objective, device_ids=device_ids, **no_buffer_sync)

    # -- checkpoints ------------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        saved = checkpoint.read_checkpoint(path)
        if saved.cfg.model != self.cfg.model:
            raise checkpoint.CheckpointError(
                f"{path}: model settings differ from this config; use a new --out or --restart"
            )
        if saved.state is None:
            raise checkpoint.CheckpointError(f"{path}: holds weights only, not the training state to resume from")
        mine = {"src": self.src_tok.sha256, "tgt": self.tgt_tok.sha256}
        if {side: record["sha256"] for side, record in saved.meta["tokenizer"].items()} != mine:
            raise checkpoint.CheckpointError(
                f"{path}: trained with another tokenizer than the one in {self.run_dir.path}; "
                "use a new --out or --restart"
            )
        checkpoint.load_weights(self.model, saved.weights, path)
        progress = resumed_progress(path, saved.state, saved.meta["step"])
        try:
            self.optimizer.load_state_dict(saved.state["optimizer"])
            _check_optimizer_state(self.optimizer)
            self.scaler.load_state_dict(saved.state["scaler"])
            self._set_rng_state(saved.state["rng"], progress.step)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
            raise checkpoint.CheckpointError(
                f"{path}: its training state does not fit this model and optimizer "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
            ) from None
        self.progress = progress

    def _rng_state(self) -> dict:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def _set_rng_state(self, per_rank: list[dict], step: int) -> None:
        if len(per_rank) != self.dist.world_size:
            log.warning(
                "checkpoint saved by %d rank(s), resuming on %d: dropout draws differ from an uninterrupted run",
                len(per_rank),
                self.dist.world_size,
            )
            torch.manual_seed(self.cfg.train.seed + 1_000_003 * self.dist.rank + step)
            return
        state = per_rank[self.dist.rank]
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def _meta(self) -> dict:
        names = checkpoint.tokenizer_files(self.cfg)
        tokenizer = {
            "src": {"file": names["src"], "sha256": self.src_tok.sha256},
            "tgt": {"file": names["tgt"], "sha256": self.tgt_tok.sha256},
        }
        return {"config": self.cfg.to_dict(), "tokenizer": tokenizer, "step": self.progress.step}

    def save_last(self) -> None:
        """Write the full training state; every rank calls this, since rank 0 stores all ranks' RNG states.

        Nothing is written when the newest checkpoint already holds this update.
        """
        if self._saved == self.progress.step:  # agreed by all ranks: they count updates alike
            return
        rng = self.dist.gather(self._rng_state())
        if not self.is_main:
            self._saved = self.progress.step
            return
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng,
            "progress": asdict(self.progress),
        }
        self.run_dir.save_checkpoint(
            self.progress.step, self.model.state_dict(), self._meta(), state, self.cfg.train.keep_last
        )
        self._saved = self.progress.step

    def _log_metrics(self, record: dict) -> None:
        if self.is_main:
            self.run_dir.log(record)

    # -- the step ---------------------------------------------------------------------------

    def train_step(self, batches: list[Batch], group_tokens: int) -> dict:
        """One update from this rank's ``batches``, part of a group holding ``group_tokens`` target tokens.

        The loss is normalised by the whole group's tokens, so N ranks with one batch each make the
        same update as one process accumulating the N batches. ``stats["skipped"]`` says why an
        update was not applied (oom, overflow, nonfinite); ``stats["stop"]`` that some rank got a
        stop signal. Both are agreed by all ranks.
        """
        tc, p = self.cfg.train, self.progress
        self.model.train()
        lr = lr_at(p.step + 1, tc.lr, tc.warmup) * p.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, nll_sum, oom = self._accumulate_gradients(batches, group_tokens)
        now = time.perf_counter()
        stop = self._signals is not None and self._signals.received is not None
        loss_sum, nll_sum, ooms, stops, seconds = self.dist.sum(
            [loss_sum, nll_sum, float(oom), float(stop), now - self._clock]
        )
        self._clock = now
        p.seconds += seconds / self.dist.world_size
        stats = {"loss": loss_sum / group_tokens, "nll": nll_sum / group_tokens, "lr": lr, "tokens": group_tokens}
        stats.update(grad_norm=math.nan, stop=stops > 0, skipped=None)
        if ooms:
            self.optimizer.zero_grad(set_to_none=True)
            return {**stats, "skipped": "oom", "oom_ranks": int(ooms)}
        if self.dist.enabled:
            self._synchronise_gradients()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if tc.clip_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, tc.clip_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in parameters]))
        stats["grad_norm"] = grad_norm
        if self.scaler.is_enabled():
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
            self.scaler.update()
            if self.scaler.get_scale() < scale:
                stats["skipped"] = "overflow"
        elif math.isfinite(loss_sum) and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            stats["skipped"] = "nonfinite"
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _accumulate_gradients(self, batches: list[Batch], group_tokens: int) -> tuple[float, float, bool]:
        """Forward and backward over this rank's batches with gradients kept local: (loss, nll, out of memory)."""
        scale = self.dist.world_size  # DDP averages over ranks; this makes the update a sum over the group
        loss_sum = nll_sum = 0.0
        local = self.forward.no_sync() if self.dist.enabled else contextlib.nullcontext()
        try:
            with local:
                for batch in batches:
                    b = batch.to(self.device)
                    loss, nll = self.forward(b.src, b.src_pad_mask, b.tgt_in, b.tgt_out)
                    self.scaler.scale(loss * scale / group_tokens).backward()
                    loss_sum += loss.item()
                    nll_sum += nll.item()
        except torch.OutOfMemoryError:
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return 0.0, 0.0, True
        return loss_sum, nll_sum, False

    def _synchronise_gradients(self) -> None:
        """DDP's bucketed all-reduce of the gradients accumulated so far, run by a backward that adds nothing.

        Micro-batches run under ``no_sync`` so that a rank out of memory can drop out of an update
        before any communication (peers would otherwise wait for it in the all-reduce). Once all
        ranks agree the update is good, a one-token batch weighted by zero drives DDP's all-reduce.
        The price is that communication no longer overlaps the last backward pass.
        """
        one = torch.ones(1, 1, dtype=torch.long, device=self.device)
        loss, _ = self.forward(one * EOS_ID, one == PAD_ID, one * BOS_ID, one * EOS_ID)
        (loss * 0.0).backward()

    # -- skipped updates --------------------------------------------------------------------

    def _roll_back(self) -> None:
        """Return to the newest checkpoint with a lower learning rate, if the skip policy allows it."""
        tc, p = self.cfg.train, self.progress
        latest = self.skips.rollback_target(p, self.run_dir.latest())
        what = _nonfinite_at(p.step + 1, self.precision.precision)
        lr_scale = p.lr_scale * tc.rollback_lr_factor
        carried = {**p.counters(), "seconds": p.seconds, "rollbacks": p.rollbacks + 1, "lr_scale": lr_scale}
        self._load(latest)
        self.progress = replace(self.progress, **carried)
        self.skips.reset()
        log.warning(
            "%s: rolled back to update %d, learning rate x%g (rollback %d of %d)",
            what,
            self.progress.step,
            lr_scale,
            self.progress.rollbacks,
            tc.max_rollbacks,
        )
        self._log_metrics({"event": "rollback", "step": self.progress.step, "lr_scale": lr_scale})

    # -- validation -------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss and (with train.valid_bleu) BLEU on the validation set; {} without one.

        Out of memory skips this validation with a warning: training goes on, and best/ keeps the
        last model validated.
        """
        try:
            return self._validate()
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning(
                "validation at update %d ran out of memory and is skipped: lower decode.batch_tokens "
                "or train.valid_beam", self.progress.step,
            )  # fmt: skip
            return {}

    def _validate(self) -> dict:
        self.model.eval()
        if not self.valid_src:
            return {}
        result = self._valid_loss()
        if self.cfg.train.valid_bleu:
            score = bleu(self._valid_translations(), self.valid_tgt)
            result.update(valid_bleu=score.value, bleu_signature=score.signature)
        return result

    def _valid_loss(self) -> dict:
        loss_sum = nll_sum = tokens = 0.0
        for batch in self.valid_batches:
            b = batch.to(self.device)
            loss, nll = self.objective(b.src, b.src_pad_mask, b.tgt_in, b.tgt_out)
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.target_tokens
        return {
            "valid_loss": loss_sum / tokens,
            "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 50)),
        }

    def _valid_translations(self) -> list[str]:
        """The validation set decoded with train.valid_beam, a progress bar counting the sentences done."""
        decode = replace(self.cfg.decode, beam=self.cfg.train.valid_beam)
        progress = StageProgress("validation decoding", total=len(self.valid_src), unit="sentences")
        with autocast(self.device, self.dtype), progress as bar:
            translator = Translator(self.model, self.src_tok, self.tgt_tok, decode, self.device, on_batch=bar.advance)
            return translator.translate(self.valid_src)

    def _validate_and_log(self) -> dict:
        """Rank 0 validates and tells the others, so best-checkpoint and patience decisions agree.

        The checkpoint of this update, when there is one, was saved before: the validation's
        outcome is added to it, so a run resumed from it knows this validation was done.
        """
        start = time.perf_counter()
        result = self.dist.broadcast(self.validate() if self.is_main else None)
        p = self.progress
        if result:
            self._after_validation(result)
            result["valid_seconds"] = time.perf_counter() - start
            self._log_metrics({"event": "valid", "step": p.step, "epoch": p.epoch, **result})
            log.info("validation at update %d: %s", p.step, _describe(result))
        p.validated = p.step
        if self.is_main and self._saved == p.step:
            self.run_dir.record_validation(p.step, {"best": p.best, "stale": p.stale})
        return result

    def _after_validation(self, result: dict) -> None:
        p = self.progress
        metric = result["valid_bleu"] if self.cfg.train.best_metric == "bleu" else -result["valid_loss"]
        if p.best is None or metric > p.best:
            p.best, p.stale = metric, 0
            if self.is_main:
                self.run_dir.save_best(self.model.state_dict(), {**self._meta(), "validation": result})
            result["new_best"] = True
        else:
            p.stale += 1

    def _validation_due(self) -> bool:
        """Whether this update is one to validate at (train.valid_every, or the last) and has not been yet."""
        p, every = self.progress, self.cfg.train.valid_every
        return p.validated < p.step and ((every and p.step % every == 0) or self.stop_condition() is not None)

    # -- the loop ---------------------------------------------------------------------------

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches as corpus indices, identical on every rank (the shuffle is seeded by epoch)."""
        if self._epoch_indices[0] != epoch:
            tc = self.cfg.train
            self._epoch_indices = (epoch, self.corpus.batch_indices(tc.batch_tokens, seed=tc.seed * 100_003 + epoch))
        return self._epoch_indices[1]

    def stop_condition(self) -> tuple[str, str] | None:
        """The setting that ends training and why, in words; None while every budget has some left."""
        tc, p = self.cfg.train, self.progress
        if p.step >= tc.max_steps:
            return "max_steps", f"reached train.max_steps {tc.max_steps}"
        if tc.max_epochs and p.epoch > tc.max_epochs:
            return "max_epochs", f"reached train.max_epochs {tc.max_epochs}"
        if tc.max_time and p.seconds >= tc.max_time * 60:
            return "max_time", f"stopped by train.max_time ({tc.max_time:g} min) at update {p.step} of {tc.max_steps}"
        if tc.patience and p.stale >= tc.patience:
            return "patience", f"no better validation {tc.best_metric} in {tc.patience} validations (train.patience)"
        return None

    def _update_groups(self) -> Iterator[tuple[list[Batch], int]]:
        """This rank's batches of each remaining update and the target tokens of the whole group.

        An update takes ``accum`` batches per rank; rank r gets every N-th batch of the group. A
        tail of an epoch too short to give every rank a batch is left out. The position is re-read
        each time, since a rollback may have moved it.
        """
        tc, world = self.cfg.train, self.dist.world_size
        while self.stop_condition() is None:
            p = self.progress
            batches = self._epoch_batches(p.epoch)
            if len(batches) - p.batch_in_epoch < world:
                p.epoch, p.batch_in_epoch = p.epoch + 1, 0
                continue
            group = batches[p.batch_in_epoch : p.batch_in_epoch + tc.accum * world]
            p.batch_in_epoch += len(group)
            mine = [self.corpus.collate(indices) for indices in group[self.dist.rank :: world]]
            yield mine, sum(map(self.corpus.target_tokens, group))

    def run(self) -> dict:
        """Train to the configured budget; returns the last validation result, with "stop": what ended training
        (``stopped_by`` the setting, the ``reason`` in words, and ``max_steps``).

        A checkpoint is saved before the validation of the same update, so a validation that fails
        or is killed costs no training; a run resumed from a checkpoint whose validation did not
        finish does it first.
        """
        self.reporter.start(self.cfg.train.max_steps, self.progress.step)
        try:
            with StopSignals() as signals:
                self._signals = signals
                return self._train()
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Give up the run directory and the progress display; ``run`` ends with this, however it ends."""
        self._signals = None
        self.run_dir.close()
        self.reporter.finish()

    def _train(self) -> dict:
        """Updates, with checkpoints and validations at their cadence, then the last checkpoint and validation."""
        tc = self.cfg.train
        last_result: dict = {}
        window = LogWindow()
        self._clock = time.perf_counter()
        if self.progress.step and self._validation_due():
            last_result = self._validate_and_log()
        for batches, group_tokens in self._update_groups():
            stats = self.train_step(batches, group_tokens)
            if stats["skipped"]:
                if self.skips.skipped(stats, self.progress):
                    self._roll_back()
            else:
                self.skips.reset()
                window = self._after_update(stats, window)
                if tc.save_every and self.progress.step % tc.save_every == 0:
                    self.save_last()
                if tc.valid_every and self.progress.step % tc.valid_every == 0:
                    last_result = self._validate_and_log()
                    window = LogWindow()  # throughput counts training time only
            if stats["stop"]:
                self.save_last()
                raise TrainingStopped(self._signals.received or signal.SIGTERM, self.progress.step)
        setting, reason = self.stop_condition()
        (log.warning if setting == "max_time" else log.info)("training done: %s", reason)
        self.save_last()
        if self._validation_due():
            last_result = self._validate_and_log()
        stop = {"stopped_by": setting, "reason": reason, "max_steps": tc.max_steps}
        self._log_metrics({"event": "done", "step": self.progress.step, **stop})
        return {**last_result, "stop": stop}

    def _after_update(self, stats: dict, window: LogWindow) -> LogWindow:
        """Count an applied update, report it, and write a metrics line every ``log_every`` updates."""
        p = self.progress
        p.step += 1
        p.log_loss, p.log_nll, p.log_updates = p.log_loss + stats["loss"], p.log_nll + stats["nll"], p.log_updates + 1
        window.tokens += stats["tokens"]
        # The mean loss since the last line, as in metrics.jsonl: one update's loss swings with its batch's lengths.
        shown = {**stats, "loss": p.log_loss / p.log_updates, "tok_s": window.tokens_per_s(), "epoch": p.epoch}
        self.reporter.update(p.step, shown)
        if p.step % self.cfg.train.log_every:
            return window
        record = {
            "event": "train",
            "step": p.step,
            "epoch": p.epoch,
            "lr": stats["lr"],
            "loss": p.log_loss / p.log_updates,
            "nll": p.log_nll / p.log_updates,
            "grad_norm": stats["grad_norm"],
            "tgt_tokens_per_s": window.tokens_per_s(),
            **p.counters(),
        }
        if self.device.type == "cuda":
            record["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._log_metrics(record)
        p.log_loss, p.log_nll, p.log_updates = 0.0, 0.0, 0
        return LogWindow()


def _describe(result: dict) -> str:
    parts = [f"loss {result['valid_loss']:.3f}", f"ppl {result['valid_ppl']:.2f}"]
    if "valid_bleu" in result:
        parts.append(f"BLEU {result['valid_bleu']:.2f}")
    if result.get("new_best"):
        parts.append("(new best)")
    return ", ".join(parts)


def schedule_preview(cfg: RunConfig) -> list[tuple[int, float]]:
    """(update, learning rate) at a few telling points, for ``--dry-run``."""
    tc = cfg.train
    steps = sorted({1, max(tc.warmup // 2, 1), max(tc.warmup, 1), 2 * max(tc.warmup, 1), tc.max_steps})
    return [(s, lr_at(s, tc.lr, tc.warmup)) for s in steps if s <= tc.max_steps]


def check_trainable(cfg: RunConfig) -> None:
    """ConfigError or DataError for what every training would fail on (settings, missing files), before any work.

    ``mtkit train --nproc-per-node N`` calls it before starting the ranks, so such an error is one
    line from one process.
    """
    data, model, tok = cfg.data, cfg.model, cfg.tokenizer
    if not data.train_src:
        hint = f"; `mtkit run` prepares recipe.corpus {cfg.recipe.corpus} for it" if cfg.recipe.corpus else ""
        raise ConfigError(f"data.train_src is not set: training needs a parallel corpus{hint}")
    if data.max_tokens >= model.max_positions:
        raise ConfigError(
            f"data.max_tokens {data.max_tokens} must be below model.max_positions {model.max_positions}: "
            "a training sentence of data.max_tokens pieces and its bos or eos must fit the model's positions"
        )
    for path in (data.train_src, data.train_tgt, data.valid_src, data.valid_tgt):
        if path:
            check_input_file(path)
    for path in (tok.model, tok.src_model, tok.tgt_model):
        if path and not Path(path).is_file():
            raise DataError(f"{path}: tokenizer model not found")
    if cfg.train.tensorboard:
        require("tensorboard", "train.tensorboard", "tensorboard")


def resumed_progress(path: Path, state: Any, step: int) -> Progress:
    """The Progress a checkpoint's training state holds, each field checked, plus the outcome of a
    validation recorded after the checkpoint was saved."""
    hints = typing.get_type_hints(Progress)
    try:
        state = untrusted.mapping(state, "its training state", required=("optimizer", "scaler", "rng", "progress"))
        values = untrusted.mapping(state["progress"], "progress", optional=list(hints))
        for name, value in values.items():
            what = f"progress.{name}"
            if hints[name] is int:
                untrusted.integer(value, what)
            elif value is not None or hints[name] is float:
                untrusted.number(value, what)
        if values.get("step", 0) != step:
            raise untrusted.Malformed(f"progress.step {values.get('step', 0)} is not the header's step {step}")
    except untrusted.Malformed as err:
        raise checkpoint.CheckpointError(f"{path}: malformed checkpoint: {err}") from None
    progress = Progress(**values)
    if "validated" not in values:  # saved before this field existed, and after its own validation
        progress.validated = progress.step
    outcome = checkpoint.read_validation(path)
    if outcome is not None:
        try:
            untrusted.mapping(outcome, "validation outcome", required=("best", "stale"), optional=())
            best = None if outcome["best"] is None else untrusted.number(outcome["best"], "best")
            stale = untrusted.integer(outcome["stale"], "stale")
        except untrusted.Malformed as err:
            log.warning("%s: %s; validating update %d again", path, err, step)
        else:
            progress.best, progress.stale, progress.validated = best, stale, step
    return progress


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's optimizer state has the parameter's shape (a misfit would fail only at the next step)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                    raise ValueError(f"optimizer {name} is {tuple(value.shape)}, its parameter {tuple(param.shape)}")


def run_training(
    cfg: RunConfig,
    out_dir: Path,
    reporter: Reporter | None = None,
    restart: bool = False,
    dist: Distributed | None = None,
) -> dict:
    """Train ``cfg`` into ``out_dir`` (resuming from its newest checkpoint, unless ``restart``)."""
    return Trainer(cfg, Path(out_dir), reporter, dist, restart).run()
