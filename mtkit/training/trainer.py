"""Training: set-up in named steps, the optimisation loop, one update, validation.

Re-running on a run directory that holds a checkpoint resumes from the newest one: model, optimizer,
scaler, progress, every rank's RNG state and the position in the data, so the remaining updates see
the same batches; a run whose data files or tokenizers changed since is refused. A run with no
checkpoint starts from random weights, or from a trained model's with train.init_from. Under
torchrun each rank trains on its share of every update's batches and rank 0 alone validates and
writes files; ranks agree after each update on anything that could make them part ways (a rank out
of memory, a stop signal, a non-finite loss).

``Trainer`` has a recipe's shape: ``__init__`` is a list of named ``_setup_*`` steps, ``run()`` trains
to the budget and ends with ``cleanup()``. Beside it: the learning-rate schedule (schedule.py), the
model a run starts from (init_from.py), the parts it holds still (freezing.py), the tokenizers rank 0
prepares (tokenizers.py), the batches made ahead of the loop (feeding.py), the validation set
(validation_set.py), what a checkpoint must hold to resume from (resume.py), what a skipped update
leads to (skip_policy.py), what the run writes to RUN/ (run_directory.py) and what it reports
(reporting.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import signal
import time
from collections.abc import Generator, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mtkit.config import ConfigError, RunConfig
from mtkit.data.directions import CorpusFiles, corpus_files
from mtkit.data.parallel import Batch, DataError, ShapeBuckets, check_input_file, file_digest, iter_parallel
from mtkit.data.sampling import CorpusMix, corpus_probabilities
from mtkit.data.token_store import TokenStore, default_cache_dir, open_or_build, store_key
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from mtkit.decoding.translate import Translator
from mtkit.model import checkpoint
from mtkit.model.loss import TrainingObjective
from mtkit.model.transformer import build_model, count_parameters
from mtkit.progress import StageProgress
from mtkit.runtime import autocast, hardware, pick_device, require, resolve_precision, seed_everything, set_threads
from mtkit.scoring.metrics import bleu
from mtkit.training.distributed import Distributed
from mtkit.training.feeding import Feed, Group
from mtkit.training.freezing import freeze
from mtkit.training.init_from import InitialModel, import_once, read_initial_model, settle_config
from mtkit.training.reporting import Reporter, TrainingReport, epoch_text
from mtkit.training.resume import (
    Progress,
    TrainingState,
    check_optimizer_state,
    check_resumable,
    restore_rng_state,
    rng_state,
)
from mtkit.training.run_directory import RunDirectory
from mtkit.training.schedule import lr_at
from mtkit.training.skip_policy import SkipPolicy
from mtkit.training.stop_signals import StopSignals, TrainingStopped
from mtkit.training.tokenizers import open_tokenizers, prepare_tokenizers
from mtkit.training.validation_set import ValidationSet, loss_batches, read_validation_sets

log = logging.getLogger("mtkit")


def open_training_data(cfg: RunConfig, src_tok: Tokenizer, tgt_tok: Tokenizer) -> TokenStore:
    """The training pairs as a memory-mapped token store, encoded now unless an earlier run did it."""
    data = cfg.data
    paths = [data.train_src, data.train_tgt] if data.train_tgt else [data.train_src]
    key = store_key(paths, src_tok, tgt_tok, data.max_tokens, data.max_ratio)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    return open_or_build(cache_dir, iter_parallel(data.train_src, data.train_tgt), key, src_tok, tgt_tok)


def open_corpus_data(cfg: RunConfig, corpus: CorpusFiles, src_tok: Tokenizer, tgt_tok: Tokenizer) -> TokenStore:
    """One corpus of data.corpora as a token store, its sources read after their tags; a DataError names it."""
    data = cfg.data
    paths = [corpus.train_src, corpus.train_tgt] if corpus.train_tgt else [corpus.train_src]
    key = store_key(paths, src_tok, tgt_tok, data.max_tokens, data.max_ratio, corpus.prefix)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    prefix = corpus.prefix
    pairs = ((prefix + s if s.strip() else s, t) for s, t in iter_parallel(corpus.train_src, corpus.train_tgt))
    try:
        return open_or_build(cache_dir, pairs, key, src_tok, tgt_tok)
    except DataError as err:
        raise DataError(f"{corpus.name}: {err}") from None


def data_sha256(cfg: RunConfig, stores: list[TokenStore], corpora: list[CorpusFiles]) -> dict[str, str]:
    """The SHA-256 of each data file, by data.* key (``corpora[I].train_src`` for a corpus of data.corpora): the
    training files' as their token store recorded them, the validation files' read now (they are small)."""
    digests = {}
    for store, files, key in zip(stores, corpora or [cfg.data], [f"corpora[{c.index}]." for c in corpora] or [""]):
        train = [name for name in ("train_src", "train_tgt") if getattr(files, name)]
        recorded = store.file_sha256s
        if recorded is None or len(recorded) != len(train):  # a store built before it recorded them
            recorded = [file_digest(getattr(files, name)) for name in train]
        digests |= {key + name: digest for name, digest in zip(train, recorded)}
        for name in ("valid_src", "valid_tgt"):
            if getattr(files, name):
                digests[key + name] = file_digest(getattr(files, name))
    return digests


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
        self.run_dir = RunDirectory(out_dir)
        self._setup_runtime()
        self.report = TrainingReport(self.run_dir, reporter, self.is_main, self.device, cfg.train.log_every)
        check_trainable(cfg)
        self.corpora = corpus_files(cfg.data)
        self.valid_sets = read_validation_sets(cfg, self.corpora)
        if self.is_main:
            self.run_dir.claim(restart)
        self._setup_start()
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        self.progress, self.skips = Progress(), SkipPolicy(replace(cfg.train, precision=self.precision.precision))
        resumed = self._resume()
        if self.is_main:  # only now: a refused resume leaves the config that describes the checkpoints
            self.run_dir.start_log(self.cfg, self.progress.step, self.progress.validated)
            self.report.write_start(self.progress.step, self.hardware, self.precision, self.init)
        self._setup_forward()
        if cfg.train.tensorboard and self.is_main:
            self.run_dir.open_tensorboard()
        self._signals: StopSignals | None = None
        self._feed: Feed | None = None
        self._clock = time.perf_counter()
        self._saved = self.progress.step if resumed else -1  # the update of the newest checkpoint

    # -- set-up -------------------------------------------------------------------------------

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

    def _setup_start(self) -> None:
        """With train.init_from, the model and tokenizer settings of the model the run starts from, read now, or
        of the newest checkpoint once the run has one (and ``init``, the record of where it started)."""
        self.initial: InitialModel | None = None
        self.init: dict | None = None
        if not self.cfg.train.init_from:
            return
        self.dist.barrier()  # rank 0 has tidied the run directory
        latest = self.run_dir.latest()
        if latest is None:
            if self.is_main:  # an import an earlier start left may be of another model
                import_once(self.cfg.train.init_from, self.run_dir.path, afresh=True)
            self.dist.barrier()  # the other ranks read the model rank 0 imported
            self.initial = initial = read_initial_model(import_once(self.cfg.train.init_from, self.run_dir.path))
            source = f"{self.cfg.train.init_from} (train.init_from)"
            records, self.init = initial.checkpoint.meta["tokenizer"], initial.record
            self.cfg = settle_config(self.cfg, initial.cfg, records, source)
        else:
            try:
                meta, theirs = checkpoint.read_meta(latest)
            except checkpoint.UnreadableCheckpoint as err:
                raise self._unreadable(err, latest) from None
            self.init = meta.get("init")
            self.cfg = settle_config(self.cfg, theirs, meta["tokenizer"], f"{latest}, which this run resumes from")
        check_lengths(self.cfg)

    def _setup_data(self) -> None:
        """Tokenizers and the encoded training pairs, made (or found) by rank 0 first; validation batches."""
        cfg, out_dir = self.cfg, self.run_dir.path
        if self.is_main:
            pairs = functools.partial(iter_parallel, cfg.data.train_src, cfg.data.train_tgt)
            if cfg.train.init_from and self.initial is None:  # resuming: RUN/ has the tokenizers, checked on loading
                self.src_tok, self.tgt_tok = open_tokenizers(cfg, out_dir)
            else:
                self.src_tok, self.tgt_tok = prepare_tokenizers(cfg, out_dir, pairs, self.corpora)
            self.stores = self._open_stores()
        self.dist.barrier()  # the other ranks read the tokenizer and the encoded pairs rank 0 made (or found)
        if not self.is_main:
            self.src_tok, self.tgt_tok = open_tokenizers(cfg, out_dir)
            self.stores = self._open_stores()
        self.corpus = self.stores[0]
        self.buckets = ShapeBuckets(cfg.train.pad_to_multiple, cfg.train.batch_tokens, cfg.model.max_positions)
        self.data_sha256 = data_sha256(cfg, self.stores, self.corpora)
        self.mix: CorpusMix | None = None
        if self.corpora:
            shares = corpus_probabilities(
                [len(store) for store in self.stores], [c.config.weight for c in self.corpora], cfg.data.temperature
            )
            log.info(
                "batches drawn from %s",
                ", ".join(f"{c.name} {len(st):,} pairs {p:.1%}" for c, st, p in zip(self.corpora, self.stores, shares)),
            )
            self.mix = CorpusMix(self.stores, shares, cfg.train.batch_tokens, cfg.train.seed, self.buckets.multiple)
        if self.is_main:
            self.valid_batches = loss_batches(cfg, self.src_tok, self.tgt_tok, self.valid_sets)
        else:
            self.valid_batches = []
        self._epoch_indices: tuple[int, list[np.ndarray]] = (0, [])

    def _open_stores(self) -> list[TokenStore]:
        """The training pairs: one token store, or one per corpus of data.corpora."""
        if not self.corpora:
            return [open_training_data(self.cfg, self.src_tok, self.tgt_tok)]
        return [open_corpus_data(self.cfg, c, self.src_tok, self.tgt_tok) for c in self.corpora]

    def _setup_model(self) -> None:
        """The model and its loss; then dropout seeded per rank, so masks differ between ranks."""
        tc = self.cfg.train
        self.model = build_model(self.cfg.model, self.src_tok.vocab_size, self.tgt_tok.vocab_size, PAD_ID)
        if self.initial is not None:
            checkpoint.load_weights(self.model, self.initial.checkpoint.weights, self.initial.checkpoint.path)
            self.initial = None  # its weights are the model's now: not held twice
        self.model.to(self.device)
        log.info("model: %s parameters", f"{count_parameters(self.model):,}")
        self.objective = TrainingObjective(self.model, tc.label_smoothing, self.dtype)
        if self.dist.enabled:
            torch.manual_seed(tc.seed + 1_000_003 * self.dist.rank)

    def _setup_optimizer(self) -> None:
        tc = self.cfg.train
        # fused: one kernel steps every parameter, rather than one kernel per tensor (docs/benchmarks.md)
        self.optimizer = torch.optim.Adam(
            freeze(self.model, tc.freeze),
            lr=tc.lr,
            betas=(0.9, 0.98),
            eps=1e-9,
            weight_decay=tc.weight_decay,
            fused=True,
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
            raise self._unreadable(err, latest) from None
        log.info("resuming from %s at update %d (%s)", latest, self.progress.step, epoch_text(self.progress))
        return True

    def _unreadable(self, err: checkpoint.UnreadableCheckpoint, latest: Path) -> checkpoint.CheckpointError:
        """The error for a newest checkpoint that cannot be read: deleting it resumes from the one before, if any."""
        older = self.run_dir.checkpoints()[:-1]
        if not older:
            return err
        return checkpoint.CheckpointError(f"{err}; delete {latest} to resume from {older[-1]}")

    def _setup_forward(self) -> None:
        """What a training step calls: the loss, wrapped for data parallelism under torchrun, compiled if asked."""
        self.forward = self._data_parallel() if self.dist.enabled else self.objective
        if self.cfg.train.compile:
            self.objective.compile_features(self._shape_count())

    def _shape_count(self) -> int | None:
        """How many batch shapes training can meet, from the longest pair the data allows (and the one-token batch
        of a data-parallel update); None when every batch has its own (train.pad_to_multiple 1), which the
        compiler then covers with symbolic sizes."""
        multiple = self.buckets.multiple
        if multiple == 1:
            return None
        widths = -(-self.buckets.width(self.cfg.data.max_tokens + 1) // multiple)
        shapes = widths * widths + 1
        log.info(
            "train.compile: at most %d batch shapes (train.pad_to_multiple %d), each compiled once", shapes, multiple
        )
        return shapes

    def _data_parallel(self) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers (the sinusoidal table) never change, so there is nothing to broadcast before each forward.
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
        return DistributedDataParallel(self.objective, device_ids=device_ids, **no_buffer_sync)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> dict:
        """Train to the configured budget; returns the last validation result, with "stop": what ended training
        (``stopped_by`` the setting, the ``reason`` in words, and ``max_steps``).

        A checkpoint is saved before the validation of the same update, so a validation that fails
        or is killed costs no training; a run resumed from a checkpoint whose validation did not
        finish does it first.
        """
        self.report.show_start(self.cfg.train.max_steps, self.progress.step)
        try:
            with StopSignals() as signals:
                self._signals = signals
                return self._train()
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Give up the run directory and the progress display; ``run`` ends with this, however it ends."""
        self._signals = None
        self._close_feed()
        self.run_dir.close()
        self.report.finish()

    def _train(self) -> dict:
        """Updates, with checkpoints and validations at their cadence, then the last checkpoint and validation."""
        tc = self.cfg.train
        last_result: dict = {}
        self.report.restart_window()
        self._clock = time.perf_counter()
        if self.progress.step and self._validation_due():
            last_result = self._validate_and_log()
        for group in self.update_groups():
            stats = self.train_step(group.batches, group.tokens)
            if stats["skipped"]:
                if self.skips.skipped(stats, self.progress):
                    self._roll_back()
            else:
                self.skips.reset()
                self.progress.step += 1
                self.report.update(self.progress, stats)
                if tc.save_every and self.progress.step % tc.save_every == 0:
                    self.save_last()
                if tc.valid_every and self.progress.step % tc.valid_every == 0:
                    last_result = self._validate_and_log()
                    self.report.restart_window()
            if stats["stop"]:
                self.save_last()
                raise TrainingStopped(self._signals.received or signal.SIGTERM, self.progress.step)
        setting, reason = self.stop_condition()
        (log.warning if setting == "max_time" else log.info)("training done: %s", reason)
        self.save_last()
        if self._validation_due():
            last_result = self._validate_and_log()
        stop = {"stopped_by": setting, "reason": reason, "max_steps": tc.max_steps}
        self.report.write({"event": "done", "step": self.progress.step, **stop})
        return {**last_result, "stop": stop}

    def update_groups(self) -> Iterator[Group]:
        """This rank's batches of each remaining update, from the feed, with the run's data position moved past
        each group as it is taken. A rollback closes the feed: the next group comes from a new one, which walks
        from the position the rollback restored."""
        try:
            while self.stop_condition() is None:
                if self._feed is None:
                    self._feed = self._open_feed()
                group, p = self._feed.next(), self.progress
                if self.mix is not None:
                    p.mix = group.mix
                elif not group.batches:  # the epoch has run out: a budget of epochs may end training here
                    p.epoch, p.batch_in_epoch = group.epoch, 0
                    continue
                else:
                    p.epoch, p.batch_in_epoch = group.epoch, group.batch_in_epoch
                yield group
        finally:  # also when the caller stops taking groups: no thread walks on for nobody
            self._close_feed()

    def _open_feed(self) -> Feed:
        p = self.progress
        walk = self._mixed_walk(p.mix) if self.mix is not None else self._walk(p.epoch, p.batch_in_epoch)
        return Feed(walk, self.cfg.train.prefetch, pin=self.device.type == "cuda")

    def _close_feed(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    def _walk(self, epoch: int, batch_in_epoch: int) -> Generator[Group, None, None]:
        """The groups of batches from a position on, endlessly; an empty group marks the start of each next epoch.

        An update takes ``accum`` batches per rank; rank r gets every N-th batch of the group. A tail of an
        epoch too short to give every rank a batch is left out.
        """
        tc, world = self.cfg.train, self.dist.world_size
        while True:
            batches = self._epoch_batches(epoch)
            if len(batches) - batch_in_epoch < world:
                epoch, batch_in_epoch = epoch + 1, 0
                yield Group([], 0, epoch, 0)
                continue
            group = batches[batch_in_epoch : batch_in_epoch + tc.accum * world]
            batch_in_epoch += len(group)
            mine = [self.corpus.collate(indices, self.buckets) for indices in group[self.dist.rank :: world]]
            yield Group(mine, sum(map(self.corpus.target_tokens, group)), epoch, batch_in_epoch)

    def _mixed_walk(self, position: list[int]) -> Generator[Group, None, None]:
        """``_walk`` over several corpora: each batch of a group drawn from one of them (CorpusMix)."""
        tc, world = self.cfg.train, self.dist.world_size
        position = list(position) or self.mix.start()
        while True:
            group = [self.mix.next(position) for _ in range(tc.accum * world)]
            mine = [self.stores[c].collate(indices, self.buckets) for c, indices in group[self.dist.rank :: world]]
            tokens = sum(self.stores[corpus].target_tokens(indices) for corpus, indices in group)
            yield Group(mine, tokens, mix=list(position))

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches as corpus indices, identical on every rank (the shuffle is seeded by epoch)."""
        held = self._epoch_indices
        if held[0] != epoch:
            tc = self.cfg.train
            seed = tc.seed * 100_003 + epoch
            held = self._epoch_indices = (
                epoch,
                self.corpus.batch_indices(tc.batch_tokens, seed, self.buckets.multiple),
            )
        return held[1]

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

    def _roll_back(self) -> None:
        """Return to the newest checkpoint with a lower learning rate, if the skip policy allows it."""
        self._close_feed()
        before = self.progress
        self._load(self.skips.rollback_target(before, self.run_dir.latest()))
        self.progress = self.skips.rolled_back(before, self.progress)
        self.report.write({"event": "rollback", "step": self.progress.step, "lr_scale": self.progress.lr_scale})

    # -- the step -----------------------------------------------------------------------------

    def train_step(self, batches: list[Batch], group_tokens: int) -> dict:
        """One update from this rank's ``batches``, part of a group holding ``group_tokens`` target tokens.

        The loss is normalised by the whole group's tokens, so N ranks with one batch each make the
        same update as one process accumulating the N batches. ``stats["skipped"]`` says why an
        update was not applied (oom, overflow, nonfinite); ``stats["stop"]`` that some rank got a
        stop signal. Both are agreed by all ranks.

        The host reads the device once per update: the losses with what the skip decision needs (the
        gradient norm in one process; under torchrun, whether this rank's gradients are finite, before the
        ranks agree). Until then the update's work is queued on a GPU without waiting for it.
        """
        tc, p = self.cfg.train, self.progress
        self.model.train()
        lr = lr_at(p.step + 1, tc) * p.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, nll_sum, oom = self._accumulate_gradients(batches, group_tokens)
        if self.dist.enabled:
            return self._finish_distributed(loss_sum, nll_sum, oom, lr, group_tokens)
        stats = {"lr": lr, "tokens": group_tokens, "stop": self._stop_received(), "skipped": None}
        p.seconds += self._lap()
        if oom:
            self.optimizer.zero_grad(set_to_none=True)
            return {**stats, "loss": 0.0, "nll": 0.0, "grad_norm": math.nan, "skipped": "oom", "oom_ranks": 1}
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        norm = self._clip_gradients()
        loss_sum, nll_sum, grad_norm = torch.stack([loss_sum, nll_sum, norm.double()]).tolist()  # the one read
        stats.update(loss=loss_sum / group_tokens, nll=nll_sum / group_tokens, grad_norm=grad_norm)
        # with loss scaling only the gradients decide (overflow); without it, a non-finite loss skips too
        finite = math.isfinite(grad_norm) and (self.scaler.is_enabled() or math.isfinite(loss_sum))
        return self._step(stats, finite)

    def _finish_distributed(self, loss_sum: Tensor, nll_sum: Tensor, oom: bool, lr: float, group_tokens: int) -> dict:
        """``train_step`` under torchrun, once this rank's gradients are accumulated: the ranks agree in one
        collective on the losses, out of memory, stop signals and non-finite gradients, then all-reduce the
        gradients and step alike. The sum over ranks of finite fp32 gradients is finite short of overflowing
        fp32, and a non-finite one makes it non-finite, so the decision is taken before the all-reduce, and the
        clipped norm stays on the device until a metrics line shows it."""
        checked = [loss_sum, nll_sum, torch.zeros((), dtype=torch.float64, device=self.device)]
        if not oom:
            local = self._parameters_with_gradients()
            checked[2] = torch.nn.utils.get_total_norm([q.grad for q in local]).double()
            if not self.scaler.is_enabled():  # with loss scaling, only the gradients decide (overflow)
                checked[2] = checked[2] + loss_sum * 0.0
        loss_sum, nll_sum, local_norm = torch.stack(checked).tolist()  # the one read
        agreed = self.dist.sum(
            [
                loss_sum,
                nll_sum,
                float(oom),
                float(self._stop_received()),
                self._lap(),
                float(not math.isfinite(local_norm)),
            ]
        )
        loss_sum, nll_sum, ooms, stops, seconds, nonfinite = agreed
        self.progress.seconds += seconds / self.dist.world_size
        stats = {"loss": loss_sum / group_tokens, "nll": nll_sum / group_tokens, "lr": lr, "tokens": group_tokens}
        stats.update(grad_norm=math.nan, stop=stops > 0, skipped=None)
        if ooms:
            self.optimizer.zero_grad(set_to_none=True)
            return {**stats, "skipped": "oom", "oom_ranks": int(ooms)}
        self._synchronise_gradients()
        self.scaler.unscale_(self.optimizer)
        stats["grad_norm"] = self._clip_gradients()  # read when a metrics line shows it
        return self._step(stats, finite=not nonfinite)

    def _step(self, stats: dict, finite: bool) -> dict:
        """Apply the update if its gradients (and, without loss scaling, its loss) are ``finite``, which all ranks
        agree on; ``stats`` with why it was skipped otherwise: fp16 "overflow", which the scaler skips and backs
        off from itself, or "nonfinite"."""
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        if not finite:
            stats["skipped"] = "overflow" if self.scaler.is_enabled() else "nonfinite"
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _parameters_with_gradients(self) -> list[torch.nn.Parameter]:
        return [q for q in self.model.parameters() if q.grad is not None]

    def _clip_gradients(self) -> Tensor:
        """The gradients' global norm (a device tensor), after clipping them to train.clip_norm if it is set."""
        parameters, clip = self._parameters_with_gradients(), self.cfg.train.clip_norm
        if clip > 0:
            return torch.nn.utils.clip_grad_norm_(parameters, clip)
        return torch.nn.utils.get_total_norm([q.grad for q in parameters])

    def _stop_received(self) -> bool:
        return self._signals is not None and self._signals.received is not None

    def _lap(self) -> float:
        """Seconds since the last lap (or since training resumed)."""
        now = time.perf_counter()
        lap, self._clock = now - self._clock, now
        return lap

    def _accumulate_gradients(self, batches: list[Batch], group_tokens: int) -> tuple[Tensor, Tensor, bool]:
        """Forward and backward over this rank's batches with gradients kept local: the summed loss and NLL
        (float64 scalars on the device, not read here) and whether the device ran out of memory."""
        scale = self.dist.world_size  # DDP averages over ranks; this makes the update a sum over the group
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        nll_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        local = self.forward.no_sync() if self.dist.enabled else contextlib.nullcontext()
        try:
            with local:
                for batch in batches:
                    loss, nll = self.forward(*batch.to(self.device).tensors())
                    self.scaler.scale(loss * scale / group_tokens).backward()
                    loss_sum += loss.detach().double()
                    nll_sum += nll.double()
        except torch.OutOfMemoryError:
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return zero, zero, True
        return loss_sum, nll_sum, False

    def _synchronise_gradients(self) -> None:
        """DDP's bucketed all-reduce of the gradients accumulated so far, run by a backward that adds nothing.

        Micro-batches run under ``no_sync`` so that a rank out of memory can drop out of an update
        before any communication (peers would otherwise wait for it in the all-reduce). Once all
        ranks agree the update is good, a one-token batch weighted by zero drives DDP's all-reduce.
        The price is that communication no longer overlaps the last backward pass.
        """
        one = torch.ones(1, 1, dtype=torch.long, device=self.device)
        first = torch.zeros(1, dtype=torch.long, device=self.device)
        loss, _ = self.forward(one * EOS_ID, one == PAD_ID, one * BOS_ID, one * EOS_ID, first)
        (loss * 0.0).backward()

    # -- validation ---------------------------------------------------------------------------

    def _validation_due(self) -> bool:
        """Whether this update is one to validate at (train.valid_every, or the last) and has not been yet."""
        p, every = self.progress, self.cfg.train.valid_every
        return p.validated < p.step and ((every and p.step % every == 0) or self.stop_condition() is not None)

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
            self.report.validation(p, result)
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
        """The loss over every validation set; BLEU of each, and their mean when there are several
        (``valid_bleu_by_direction``), which best/ and early stopping follow."""
        self.model.eval()
        if not self.valid_sets:
            return {}
        result = self._valid_loss()
        if self.cfg.train.valid_bleu:
            scores = {v.direction: bleu(self._valid_translations(v), v.references) for v in self.valid_sets}
            if len(scores) == 1:
                score = next(iter(scores.values()))
                result.update(valid_bleu=score.value, bleu_signature=score.signature)
            else:
                result.update(
                    valid_bleu=sum(score.value for score in scores.values()) / len(scores),
                    valid_bleu_by_direction={direction: score.value for direction, score in scores.items()},
                    bleu_signature=next(iter(scores.values())).signature,
                )
        return result

    def _valid_loss(self) -> dict:
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.valid_batches:
            sums += torch.stack(self.objective(*batch.to(self.device).tensors())).double()
        loss_sum, nll_sum = sums.tolist()
        tokens = sum(batch.target_tokens for batch in self.valid_batches)
        return {
            "valid_loss": loss_sum / tokens,
            "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 50)),
        }

    def _valid_translations(self, valid: ValidationSet) -> list[str]:
        """A validation set decoded with train.valid_beam, a progress bar counting the sentences done."""
        decode = replace(self.cfg.decode, beam=self.cfg.train.valid_beam)
        what = "validation decoding" + (f" {valid.direction}" if len(self.valid_sets) > 1 else "")
        progress = StageProgress(what, total=len(valid.sources), unit="sentences")
        with autocast(self.device, self.dtype), progress as bar:
            translator = Translator(self.model, self.src_tok, self.tgt_tok, decode, self.device, on_batch=bar.advance)
            translator.source_prefix = valid.prefix
            return translator.translate(valid.sources)

    # -- checkpoints --------------------------------------------------------------------------

    def save_last(self) -> None:
        """Write the full training state; every rank calls this, since rank 0 stores all ranks' RNG states.

        Nothing is written when the newest checkpoint already holds this update.
        """
        if self._saved == self.progress.step:  # agreed by all ranks: they count updates alike
            return
        rng = self.dist.gather(rng_state(self.device))
        if not self.is_main:
            self._saved = self.progress.step
            return
        state = TrainingState(self.optimizer.state_dict(), self.scaler.state_dict(), rng, self.progress)
        self.run_dir.save_checkpoint(
            self.progress.step, self.model.state_dict(), self._meta(), state.to_dict(), self.cfg.train.keep_last
        )
        self._saved = self.progress.step

    def _meta(self) -> dict:
        names = checkpoint.tokenizer_files(self.cfg)
        tokenizer = {
            "src": {"file": names["src"], "sha256": self.src_tok.sha256},
            "tgt": {"file": names["tgt"], "sha256": self.tgt_tok.sha256},
        }
        meta = {"config": self.cfg.to_dict(), "tokenizer": tokenizer, "step": self.progress.step}
        return {**meta, "data_sha256": self.data_sha256, **({"init": self.init} if self.init else {})}

    def _load(self, path: Path) -> None:
        """Weights, optimizer, scaler, RNG and progress from the checkpoint at ``path``, checked to fit this run."""
        saved = checkpoint.read_checkpoint(path)
        check_resumable(path, saved, self.cfg, (self.src_tok, self.tgt_tok), self.data_sha256, self.run_dir.path)
        checkpoint.load_weights(self.model, saved.weights, path)
        state = TrainingState.read(path, saved.state, saved.meta["step"])
        try:
            self.optimizer.load_state_dict(state.optimizer)
            check_optimizer_state(self.optimizer)
            self.scaler.load_state_dict(state.scaler)
            reseed = self.cfg.train.seed + 1_000_003 * self.dist.rank + state.progress.step
            restore_rng_state(state.rng, self.dist, self.device, reseed)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
            raise checkpoint.CheckpointError(
                f"{path}: its training state does not fit this model and optimizer "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
            ) from None
        self.progress = state.progress


def check_trainable(cfg: RunConfig) -> None:
    """ConfigError or DataError for what every training would fail on (settings, missing files), before any work.

    ``mtkit train --nproc-per-node N`` calls it before starting the ranks, so such an error is one
    line from one process.
    """
    data, tok = cfg.data, cfg.tokenizer
    if data.corpora:
        if cfg.train.max_epochs:
            raise ConfigError(
                "train.max_epochs counts passes over one corpus; with data.corpora, budget by train.max_steps"
            )
        for corpus in corpus_files(data):
            for path in (corpus.train_src, corpus.train_tgt, corpus.valid_src, corpus.valid_tgt):
                if path:
                    check_input_file(path)
    elif not data.train_src:
        hint = f"; `mtkit run` prepares recipe.corpus {cfg.recipe.corpus} for it" if cfg.recipe.corpus else ""
        raise ConfigError(f"data.train_src is not set: training needs a parallel corpus{hint}")
    if not cfg.train.init_from:  # else the model's positions are the initial model's, checked once it is read
        check_lengths(cfg)
        # Two tokenizers trained now have two vocabularies; given ones may share one (an imported Marian model's)
        if cfg.model.tie_embeddings and not tok.joint and not (tok.src_model and tok.tgt_model):
            raise ConfigError(
                "model.tie_embeddings needs a joint vocabulary: set tokenizer.joint: true or "
                "model.tie_embeddings: false"
            )
    for path in (data.train_src, data.train_tgt, data.valid_src, data.valid_tgt):
        if path:
            check_input_file(path)
    for path in (tok.model, tok.src_model, tok.tgt_model):
        if path and not Path(path).is_file():
            raise DataError(f"{path}: tokenizer model not found")
    if cfg.train.tensorboard:
        require("tensorboard", "train.tensorboard", "tensorboard")


def check_lengths(cfg: RunConfig) -> None:
    """ConfigError unless the longest training sentence fits the model's positions."""
    data, model = cfg.data, cfg.model
    if data.max_tokens >= model.max_positions:
        raise ConfigError(
            f"data.max_tokens {data.max_tokens} must be below model.max_positions {model.max_positions}: "
            "a training sentence of data.max_tokens pieces and its bos or eos must fit the model's positions"
        )


def run_training(
    cfg: RunConfig,
    out_dir: Path,
    reporter: Reporter | None = None,
    restart: bool = False,
    dist: Distributed | None = None,
) -> dict:
    """Train ``cfg`` into ``out_dir`` (resuming from its newest checkpoint, unless ``restart``)."""
    return Trainer(cfg, Path(out_dir), reporter, dist, restart).run()
