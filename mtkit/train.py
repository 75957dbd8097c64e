"""Training: data and tokenizer set-up, the optimisation loop, validation and checkpoints.

Re-running on a run directory that holds ``last.pt`` resumes from it: model, optimizer, scaler,
step, RNG state and position in the data, so the remaining updates see the same batches.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from mtkit import checkpoint
from mtkit.config import ConfigError, RunConfig, dump, from_dict
from mtkit.data import Batch, DataError, collate, filter_pairs, read_parallel, token_batches
from mtkit.loss import linear_cross_entropy
from mtkit.metrics import bleu
from mtkit.model import build_model, count_parameters
from mtkit.runtime import autocast, compute_dtype, pick_device, seed_everything, set_threads
from mtkit.tokenizer import PAD_ID, SpmOptions, Tokenizer, train_spm
from mtkit.translate import translate_lines

log = logging.getLogger("mtkit")


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
    A second signal aborts at once.
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
            raise KeyboardInterrupt
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
class Corpus:
    src: list[list[int]]
    tgt: list[list[int]]

    def batches(self, batch_tokens: int, seed: int) -> list[Batch]:
        indices = token_batches([len(s) for s in self.src], [len(t) for t in self.tgt], batch_tokens, seed)
        return [collate([self.src[i] for i in idx], [self.tgt[i] for i in idx]) for idx in indices]


@dataclass
class LogWindow:
    """Training statistics accumulated since the last metrics-log line."""

    tokens: int = 0
    loss: float = 0.0
    nll: float = 0.0
    updates: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, stats: dict) -> None:
        self.tokens += stats["tokens"]
        self.loss += stats["loss"]
        self.nll += stats["nll"]
        self.updates += 1

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)

    def summary(self, last: dict) -> dict:
        """Mean loss over the window, the last update's lr and gradient norm, and throughput."""
        return {
            "lr": last["lr"],
            "loss": self.loss / self.updates,
            "nll": self.nll / self.updates,
            "grad_norm": last["grad_norm"],
            "tgt_tokens_per_s": self.tokens_per_s(),
        }


@dataclass
class Progress:
    """The resumable position of a run."""

    step: int = 0  # updates done
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of this epoch already consumed
    best: float | None = None  # best validation metric so far (higher is better)
    stale: int = 0  # validations since the best one
    seconds: float = 0.0  # training wall clock so far, across resumed runs


def prepare_tokenizers(
    cfg: RunConfig, out_dir: Path, src_lines: list[str], tgt_lines: list[str]
) -> tuple[Tokenizer, Tokenizer]:
    """The run's tokenizer(s): already in the run directory, copied from the config, or trained now."""
    names = checkpoint.tokenizer_files(cfg)
    tc = cfg.tokenizer
    given = {"src": tc.model, "tgt": tc.model} if tc.joint else {"src": tc.src_model, "tgt": tc.tgt_model}
    options = SpmOptions(tc.vocab_size, tc.type, tc.character_coverage, tc.input_sentence_size, tc.seed)
    for side in ("src", "tgt"):
        target = out_dir / names[side]
        if target.is_file():
            continue
        if given[side]:
            source = Path(given[side])
            if not source.is_file():
                raise DataError(f"{source}: tokenizer model not found")
            shutil.copyfile(source, target)
            vocab = source.with_suffix(".vocab")
            if vocab.is_file():
                shutil.copyfile(vocab, target.with_suffix(".vocab"))
        else:
            sentences = src_lines + tgt_lines if tc.joint else (src_lines if side == "src" else tgt_lines)
            log.info(
                "training %s SentencePiece %s model (%d pieces) on %d sentences",
                "joint" if tc.joint else side,
                tc.type,
                tc.vocab_size,
                len(sentences),
            )
            train_spm(sentences, target.with_suffix(""), options)
    return Tokenizer(out_dir / names["src"]), Tokenizer(out_dir / names["tgt"])


def encode_corpus(
    cfg: RunConfig, src_lines: list[str], tgt_lines: list[str], src_tok: Tokenizer, tgt_tok: Tokenizer
) -> Corpus:
    src, tgt, report = filter_pairs(
        src_tok.encode(src_lines), tgt_tok.encode(tgt_lines), cfg.data.max_tokens, cfg.data.max_ratio
    )
    log.info("training data: %s", report.describe())
    if not src:
        raise DataError(f"{cfg.data.train_src}: no training pairs left after filtering")
    return Corpus(src, tgt)


class Trainer:
    """Owns the model, optimizer and run directory for one training run."""

    def __init__(self, cfg: RunConfig, out_dir: Path, reporter: Reporter | None = None) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.reporter = reporter or LogReporter()
        tc = cfg.train
        set_threads(tc.threads)
        self.device = pick_device(tc.device)
        self.dtype = compute_dtype(tc.precision, self.device)
        seed_everything(tc.seed)

        if not cfg.data.train_src:
            raise ConfigError("data.train_src is not set: training needs a parallel corpus")
        src_lines, tgt_lines = read_parallel(cfg.data.train_src, cfg.data.train_tgt)
        self.valid_src, self.valid_tgt = self._read_valid()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.src_tok, self.tgt_tok = prepare_tokenizers(cfg, self.out_dir, src_lines, tgt_lines)
        self.corpus = encode_corpus(cfg, src_lines, tgt_lines, self.src_tok, self.tgt_tok)
        self.valid_batches = self._valid_loss_batches()
        checkpoint.atomic_write_text(self.out_dir / "config.yaml", dump(cfg))

        self.model = build_model(cfg.model, self.src_tok.vocab_size, self.tgt_tok.vocab_size, PAD_ID).to(self.device)
        log.info("model: %s parameters", f"{count_parameters(self.model):,}")
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=tc.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=tc.weight_decay
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=tc.precision == "fp16")
        self.progress = Progress()
        self._resume()

    def _read_valid(self) -> tuple[list[str], list[str]]:
        data = self.cfg.data
        if not data.valid_src:
            return [], []
        return read_parallel(data.valid_src, data.valid_tgt)

    def _valid_loss_batches(self) -> list[Batch]:
        """Validation pairs with both sides non-empty, encoded and batched once for the whole run."""
        pairs = [
            (s, t) for s, t in zip(self.src_tok.encode(self.valid_src), self.tgt_tok.encode(self.valid_tgt)) if s and t
        ]
        valid = Corpus([s for s, _ in pairs], [t for _, t in pairs])
        return valid.batches(self.cfg.train.batch_tokens, seed=0) if pairs else []

    def _resume(self) -> None:
        last = self.out_dir / checkpoint.LAST
        if not last.is_file():
            return
        state = checkpoint.load(last)
        if from_dict(state["config"]).model != self.cfg.model:
            raise checkpoint.CheckpointError(
                f"{last}: model settings differ from this config; use a new --out or --restart"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.progress = Progress(**state["progress"])
        log.info("resuming from %s at update %d (epoch %d)", last, self.progress.step, self.progress.epoch)

    # -- checkpoints ------------------------------------------------------------------------

    def _tokenizer_record(self) -> dict:
        names = checkpoint.tokenizer_files(self.cfg)
        return {
            "src": {"file": names["src"], "sha256": self.src_tok.sha256},
            "tgt": {"file": names["tgt"], "sha256": self.tgt_tok.sha256},
        }

    def _weights_payload(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "tokenizer": self._tokenizer_record(),
            "step": self.progress.step,
            "model": self.model.state_dict(),
        }

    def save_last(self) -> None:
        state = {
            **self._weights_payload(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "progress": asdict(self.progress),
        }
        checkpoint.save(self.out_dir / checkpoint.LAST, state)

    def _log_metrics(self, record: dict) -> None:
        with open(self.out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # -- the step ---------------------------------------------------------------------------

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed smoothed loss and summed NLL over the batch's real target tokens."""
        with autocast(self.device, self.dtype):
            features = self.model.features(batch.src, batch.src_pad_mask, batch.tgt_in)
        keep = batch.tgt_out != PAD_ID
        return linear_cross_entropy(
            features[keep], self.model.output.weight, batch.tgt_out[keep], self.cfg.train.label_smoothing, self.dtype
        )

    def train_step(self, batches: list[Batch]) -> dict:
        """One update from ``accum`` batches; the loss is normalised by their total target tokens."""
        tc = self.cfg.train
        self.model.train()
        lr = lr_at(self.progress.step + 1, tc.lr, tc.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tokens = sum(b.target_tokens for b in batches)
        loss_sum = nll_sum = 0.0
        for batch in batches:
            loss, nll = self._loss(batch.to(self.device))
            self.scaler.scale(loss / tokens).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if tc.clip_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm))
        else:
            grad_norm = float(
                torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
            )
        self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"non-finite loss at update {self.progress.step + 1}; lower train.lr or use fp32")
        return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "lr": lr, "grad_norm": grad_norm, "tokens": tokens}

    # -- validation -------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict:
        self.model.eval()
        result: dict = {}
        if not self.valid_src:
            return result
        loss_sum = nll_sum = tokens = 0.0
        for batch in self.valid_batches:
            loss, nll = self._loss(batch.to(self.device))
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.target_tokens
        result.update(
            valid_loss=loss_sum / tokens, valid_nll=nll_sum / tokens, valid_ppl=math.exp(min(nll_sum / tokens, 50))
        )
        if self.cfg.train.valid_bleu:
            decode = replace(self.cfg.decode, beam=self.cfg.train.valid_beam)
            with autocast(self.device, self.dtype):
                hyps = translate_lines(self.model, self.src_tok, self.tgt_tok, self.valid_src, decode, self.device)
            score = bleu(hyps, self.valid_tgt)
            result.update(valid_bleu=score.value, bleu_signature=score.signature)
        return result

    def _after_validation(self, result: dict) -> None:
        p = self.progress
        metric = result["valid_bleu"] if self.cfg.train.best_metric == "bleu" else -result["valid_loss"]
        if p.best is None or metric > p.best:
            p.best, p.stale = metric, 0
            checkpoint.save(self.out_dir / checkpoint.BEST, {**self._weights_payload(), "validation": result})
            result["new_best"] = True
        else:
            p.stale += 1

    # -- the loop ---------------------------------------------------------------------------

    def _epoch_batches(self) -> list[Batch]:
        tc = self.cfg.train
        return self.corpus.batches(tc.batch_tokens, seed=tc.seed * 100_003 + self.progress.epoch)

    def stop_reason(self) -> str | None:
        """Why training is over, or None while any budget is left."""
        tc, p = self.cfg.train, self.progress
        if p.step >= tc.max_steps:
            return f"reached train.max_steps {tc.max_steps}"
        if tc.max_epochs and p.epoch > tc.max_epochs:
            return f"reached train.max_epochs {tc.max_epochs}"
        if tc.max_time and p.seconds >= tc.max_time * 60:
            return f"reached train.max_time {tc.max_time:g} min"
        if tc.patience and p.stale >= tc.patience:
            return f"no better validation {tc.best_metric} in {tc.patience} validations (train.patience)"
        return None

    def _finished(self) -> bool:
        return self.stop_reason() is not None

    def _update_groups(self) -> Iterator[list[Batch]]:
        """The batches of each remaining update, advancing the data position as each is handed out."""
        tc, p = self.cfg.train, self.progress
        while not self._finished():
            batches = self._epoch_batches()
            while p.batch_in_epoch < len(batches) and not self._finished():
                group = batches[p.batch_in_epoch : p.batch_in_epoch + tc.accum]
                p.batch_in_epoch += len(group)
                yield group
            if p.batch_in_epoch >= len(batches):
                p.epoch, p.batch_in_epoch = p.epoch + 1, 0

    def run(self) -> dict:
        """Train to the configured budget; returns the last validation result."""
        tc, p = self.cfg.train, self.progress
        self.reporter.start(tc.max_steps, p.step)
        last_result: dict = {}
        window = LogWindow()
        clock = time.perf_counter()
        try:
            with StopSignals() as stop:
                for group in self._update_groups():
                    stats = self.train_step(group)
                    p.step += 1
                    window.add(stats)
                    self.reporter.update(p.step, {**stats, "tok_s": window.tokens_per_s(), "epoch": p.epoch})
                    if p.step % tc.log_every == 0:
                        self._log_metrics({"event": "train", "step": p.step, "epoch": p.epoch, **window.summary(stats)})
                        window = LogWindow()
                    if tc.valid_every and p.step % tc.valid_every == 0:
                        last_result = self._validate_and_log()
                        window.start = time.perf_counter()  # throughput counts training time only
                    if tc.save_every and p.step % tc.save_every == 0:
                        self.save_last()
                    now = time.perf_counter()
                    p.seconds, clock = p.seconds + now - clock, now
                    if stop.received is not None:
                        self.save_last()
                        raise TrainingStopped(stop.received, p.step)
                log.info("training done: %s", self.stop_reason())
                if not tc.valid_every or p.step % tc.valid_every:
                    last_result = self._validate_and_log()
                self.save_last()
        finally:
            self.reporter.finish()
        return last_result

    def _validate_and_log(self) -> dict:
        start = time.perf_counter()
        result = self.validate()
        if result:
            self._after_validation(result)
            result["valid_seconds"] = time.perf_counter() - start
            self._log_metrics({"event": "valid", "step": self.progress.step, "epoch": self.progress.epoch, **result})
            log.info("validation at update %d: %s", self.progress.step, _describe(result))
        return result


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


def train(cfg: RunConfig, out_dir: Path, reporter: Reporter | None = None, restart: bool = False) -> dict:
    """Train ``cfg`` into ``out_dir`` (resuming when it holds a last checkpoint, unless ``restart``)."""
    out_dir = Path(out_dir)
    if restart and out_dir.exists():
        produced = [checkpoint.LAST, checkpoint.BEST, "metrics.jsonl", "config.yaml"]
        for path in [*(out_dir / name for name in produced), *out_dir.glob("spm*.model"), *out_dir.glob("spm*.vocab")]:
            path.unlink(missing_ok=True)
    return Trainer(cfg, out_dir, reporter).run()
