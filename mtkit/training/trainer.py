"""Training: set-up in named steps, and the optimisation loop that decides when to step, validate, save and stop.

Re-running on a run directory that holds a checkpoint resumes from the newest one: model, optimizer,
scaler, progress, every rank's RNG state and the position in the data, so the remaining updates see
the same batches; a run whose data files or tokenizers changed since is refused. A run with no
checkpoint starts from random weights, or from a trained model's with train.init_from. Under
torchrun each rank trains on its share of every update's batches and rank 0 alone validates and
writes files; ranks agree after each update on anything that could make them part ways (a rank out
of memory, a stop signal, a non-finite loss).

``Trainer`` has a recipe's shape: ``__init__`` is a list of named ``_setup_*`` steps, ``run()`` trains
to the budget and ends with ``cleanup()``; it holds the run's state and decides when each thing happens.
Beside it: the learning-rate schedule (schedule.py), the model a run starts from (init_from.py), the
parts it holds still (freezing.py), the optimizer and the data-parallel loss (build.py), the tokenizers
rank 0 prepares (tokenizers.py), the encoded training pairs (training_data.py), the batches of each
update (data_walk.py) made ahead of the loop (feeding.py), one update's arithmetic (step.py), the
validation set (validation_set.py) and validating on it (validation.py), what a checkpoint holds and
gives back (checkpointing.py, resume.py), what a skipped update leads to (skip_policy.py), what the run
writes to RUN/ (run_directory.py) and what it reports (reporting.py).
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from mtkit.config import ConfigError, RunConfig
from mtkit.data.directions import corpus_files
from mtkit.data.parallel import Batch, DataError, ShapeBuckets, check_input_file, iter_parallel
from mtkit.data.tokenizer import PAD_ID
from mtkit.model import checkpoint
from mtkit.model.lora import adapter_weights
from mtkit.model.loss import TrainingObjective
from mtkit.model.transformer import build_model, count_parameters
from mtkit.runtime import hardware, pick_device, require, resolve_precision, seed_everything, set_threads
from mtkit.training import adapters
from mtkit.training.build import batch_shape_count, build_optimizer, data_parallel
from mtkit.training.checkpointing import checkpoint_meta, restore_training_state, unreadable_error
from mtkit.training.data_walk import DataWalk
from mtkit.training.distributed import Distributed
from mtkit.training.feeding import Feed, Group
from mtkit.training.init_from import InitialModel, import_once, read_initial_model, settle_config
from mtkit.training.reporting import Reporter, TrainingReport, epoch_text
from mtkit.training.resume import Progress, TrainingState, check_resumable, rng_state
from mtkit.training.run_directory import RunDirectory
from mtkit.training.schedule import lr_at
from mtkit.training.skip_policy import SkipPolicy
from mtkit.training.step import accumulate_gradients, apply_update, clip_gradients, local_outcome, synchronise_gradients
from mtkit.training.stop_signals import StopSignals, TrainingStopped
from mtkit.training.tokenizers import open_tokenizers, prepare_tokenizers
from mtkit.training.training_data import corpus_mix, data_sha256, open_stores
from mtkit.training.validation import Validator, tracked_metric, validation_comet
from mtkit.training.validation_set import loss_batches, read_validation_sets

log = logging.getLogger("mtkit")


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
        self._setup_validation()
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
                raise unreadable_error(err, latest, self.run_dir.checkpoints()) from None
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
            self.stores = open_stores(cfg, self.corpora, self.src_tok, self.tgt_tok)
        self.dist.barrier()  # the other ranks read the tokenizer and the encoded pairs rank 0 made (or found)
        if not self.is_main:
            self.src_tok, self.tgt_tok = open_tokenizers(cfg, out_dir)
            self.stores = open_stores(cfg, self.corpora, self.src_tok, self.tgt_tok)
        self.corpus = self.stores[0]
        self.buckets = ShapeBuckets(cfg.train.pad_to_multiple, cfg.train.batch_tokens, cfg.model.max_positions)
        self.data_sha256 = data_sha256(cfg, self.stores, self.corpora)
        self.mix = corpus_mix(cfg, self.corpora, self.stores, self.buckets.multiple)
        self.walk = DataWalk(self.stores, self.mix, self.buckets, cfg.train, self.dist.rank, self.dist.world_size)
        if self.is_main:
            self.valid_batches = loss_batches(cfg, self.src_tok, self.tgt_tok, self.valid_sets)
        else:
            self.valid_batches = []

    def _setup_model(self) -> None:
        """The model and its loss; then dropout seeded per rank, so masks differ between ranks. With train.lora,
        the base model with new adapters (their values are the checkpoint's, once resumed)."""
        tc = self.cfg.train
        self.model = build_model(self.cfg.model, self.src_tok.vocab_size, self.tgt_tok.vocab_size, PAD_ID)
        self.lora_base: adapters.LoraBase | None = None
        if tc.lora.rank:  # the base is read again on resuming: the checkpoints hold the adapters alone
            if self.initial is not None:
                base, weights = adapters.base_of(self.initial.checkpoint), self.initial.checkpoint.weights
            else:
                base, weights = adapters.read_base(self.init)
            adapters.adapt(self.model, weights, base, tc.lora)
            self.lora_base = base
        elif self.initial is not None:
            checkpoint.load_weights(self.model, self.initial.checkpoint.weights, self.initial.checkpoint.path)
        self.initial = None  # its weights are the model's now: not held twice
        self.model.to(self.device)
        log.info("model: %s parameters", f"{count_parameters(self.model):,}")
        self.objective = TrainingObjective(self.model, tc.label_smoothing, self.dtype)
        if self.dist.enabled:
            torch.manual_seed(tc.seed + 1_000_003 * self.dist.rank)

    def _setup_validation(self) -> None:
        """What validates the model: on rank 0, the loss batches ``_setup_data`` made, the sets to translate and the
        COMET model of train.valid_comet."""
        tokenizers = (self.src_tok, self.tgt_tok)
        comet = validation_comet(self.cfg, self.device) if self.is_main and self.valid_sets else None
        self.validator = Validator(
            self.objective, tokenizers, self.valid_sets, self.valid_batches, self.cfg, self.device, comet
        )

    def _setup_optimizer(self) -> None:
        """The optimizer, and a loss scaler that is enabled in fp16 alone (a disabled one keeps one code path)."""
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.precision == "fp16")

    def _resume(self) -> bool:
        """Load the newest checkpoint of the run directory, if there is one; whether there was."""
        latest = self.run_dir.latest()
        if latest is None:
            return False
        try:
            self._load(latest)
        except checkpoint.UnreadableCheckpoint as err:
            raise unreadable_error(err, latest, self.run_dir.checkpoints()) from None
        log.info("resuming from %s at update %d (%s)", latest, self.progress.step, epoch_text(self.progress))
        return True

    def _setup_forward(self) -> None:
        """What a training step calls: the loss, wrapped for data parallelism under torchrun, compiled if asked."""
        self.forward = data_parallel(self.objective, self.device) if self.dist.enabled else self.objective
        if self.cfg.train.compile:
            longest = self.cfg.data.max_tokens + (1 if self.cfg.data.languages else 0)  # and a language's token
            self.objective.compile_features(batch_shape_count(self.buckets, longest))

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
        return Feed(self.walk.groups(self.progress), self.cfg.train.prefetch, pin=self.device.type == "cuda")

    def _close_feed(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None

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
        loss_sum, nll_sum, oom = accumulate_gradients(
            self.forward, self.scaler, self.optimizer, batches, group_tokens, self.dist, self.device
        )
        if self.dist.enabled:
            return self._finish_distributed(loss_sum, nll_sum, oom, lr, group_tokens)
        stats = {"lr": lr, "tokens": group_tokens, "stop": self._stop_received(), "skipped": None}
        p.seconds += self._lap()
        if oom:
            self.optimizer.zero_grad(set_to_none=True)
            return {**stats, "loss": 0.0, "nll": 0.0, "grad_norm": math.nan, "skipped": "oom", "oom_ranks": 1}
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        norm = clip_gradients(self.model, tc.clip_norm)
        loss_sum, nll_sum, grad_norm = torch.stack([loss_sum, nll_sum, norm.double()]).tolist()  # the one read
        stats.update(loss=loss_sum / group_tokens, nll=nll_sum / group_tokens, grad_norm=grad_norm)
        # with loss scaling only the gradients decide (overflow); without it, a non-finite loss skips too
        finite = math.isfinite(grad_norm) and (self.scaler.is_enabled() or math.isfinite(loss_sum))
        return apply_update(self.optimizer, self.scaler, stats, finite)

    def _finish_distributed(self, loss_sum: Tensor, nll_sum: Tensor, oom: bool, lr: float, group_tokens: int) -> dict:
        """``train_step`` under torchrun, once this rank's gradients are accumulated: the ranks agree in one
        collective on the losses, out of memory, stop signals and non-finite gradients, then all-reduce the
        gradients and step alike. The sum over ranks of finite fp32 gradients is finite short of overflowing
        fp32, and a non-finite one makes it non-finite, so the decision is taken before the all-reduce, and the
        clipped norm stays on the device until a metrics line shows it."""
        loss_sum, nll_sum, local_norm = local_outcome(loss_sum, nll_sum, oom, self.model, self.scaler)  # the one read
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
        synchronise_gradients(self.forward, self.device)
        self.scaler.unscale_(self.optimizer)
        stats["grad_norm"] = clip_gradients(self.model, self.cfg.train.clip_norm)  # read when a metrics line shows it
        return apply_update(self.optimizer, self.scaler, stats, finite=not nonfinite)

    def _stop_received(self) -> bool:
        return self._signals is not None and self._signals.received is not None

    def _lap(self) -> float:
        """Seconds since the last lap (or since training resumed)."""
        now = time.perf_counter()
        lap, self._clock = now - self._clock, now
        return lap

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
        metric = tracked_metric(result, self.cfg.train.best_metric)
        if p.best is None or metric > p.best:
            p.best, p.stale = metric, 0
            if self.is_main:
                weights, header = self._weights()
                self.run_dir.save_best(weights, {**self._meta(), "validation": result}, header)
            result["new_best"] = True
        else:
            p.stale += 1

    def validate(self) -> dict:
        """Loss and (with train.valid_bleu) BLEU on the validation set; {} without one, or when validating ran
        out of memory (training goes on, and best/ keeps the last model validated)."""
        return self.validator.validate(self.progress.step)

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
        weights, header = self._weights()
        self.run_dir.save_checkpoint(
            self.progress.step, weights, self._meta(), state.to_dict(), self.cfg.train.keep_last, header
        )
        self._saved = self.progress.step

    def _meta(self) -> dict:
        return checkpoint_meta(self.cfg, (self.src_tok, self.tgt_tok), self.progress.step, self.data_sha256, self.init)

    def _weights(self) -> tuple[dict[str, Tensor], dict[str, str] | None]:
        """What a checkpoint's weights file holds: the model's weights, or with train.lora its adapters alone, with
        their record of the base they adapt for its header."""
        if self.lora_base is None:
            return self.model.state_dict(), None
        return adapter_weights(self.model), adapters.header(self.lora_base, self.cfg.train.lora)

    def _load(self, path: Path) -> None:
        """Weights, optimizer, scaler, RNG and progress from the checkpoint at ``path``, checked to fit this run."""
        saved = checkpoint.read_checkpoint(path)
        check_resumable(path, saved, self.cfg, (self.src_tok, self.tgt_tok), self.data_sha256, self.run_dir.path)
        if self.lora_base is not None:
            adapters.load_adapters(self.model, path, self.lora_base, self.cfg.train.lora)
        else:
            checkpoint.load_weights(self.model, saved.weights, path)
        self.progress = restore_training_state(
            path, saved, self.optimizer, self.scaler, self.cfg.train.seed, self.dist, self.device
        )


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
    lead = 1 if data.languages else 0  # a language's token before each sentence
    if data.max_tokens + lead >= model.max_positions:
        with_lead = " and its language's token" if lead else ""
        raise ConfigError(
            f"data.max_tokens {data.max_tokens} must be below model.max_positions {model.max_positions - lead}: "
            f"a training sentence of data.max_tokens pieces{with_lead} and its bos or eos must fit the model's "
            "positions"
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
