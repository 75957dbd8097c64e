"""Validating the model in training: its loss over the validation sets, and the BLEU (and, with train.valid_comet,
the COMET) of their translations decoded with train.valid_beam: one score per direction, and their mean, which
best/ and early stopping follow (train.best_metric).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch

from mtkit.config import RunConfig
from mtkit.data.directions import language_leads
from mtkit.data.parallel import Batch
from mtkit.data.tokenizer import Tokenizer
from mtkit.decoding.line_translator import Translator
from mtkit.model.loss import TrainingObjective
from mtkit.progress import StageProgress
from mtkit.runtime import autocast
from mtkit.scoring.comet import Comet
from mtkit.scoring.metrics import bleu
from mtkit.training.validation_set import ValidationSet

log = logging.getLogger("mtkit")


def validation_comet(cfg: RunConfig, device: torch.device) -> Comet | None:
    """The COMET model train.valid_comet names, loaded once for the run on its device; None without."""
    if not cfg.train.valid_comet:
        return None
    comet = Comet.load(cfg.train.valid_comet, device=str(device))
    log.info("validation COMET: %s", cfg.train.valid_comet)
    return comet


def tracked_metric(result: dict, best_metric: str) -> float:
    """The number best/ and early stopping follow, higher being better: BLEU, COMET, or the loss negated."""
    return -result["valid_loss"] if best_metric == "loss" else result[f"valid_{best_metric}"]


class Validator:
    """The loss of ``objective`` (the model's, in its compute dtype) on ``loss_batches`` and, with train.valid_bleu,
    the model's BLEU on ``valid_sets``; with ``comet``, the COMET of the same translations."""

    def __init__(
        self,
        objective: TrainingObjective,
        tokenizers: tuple[Tokenizer, Tokenizer],
        valid_sets: list[ValidationSet],
        loss_batches: list[Batch],
        cfg: RunConfig,
        device: torch.device,
        comet: Comet | None = None,
    ) -> None:
        self.objective, self.model, self.dtype = objective, objective.model, objective.dtype
        self.src_tok, self.tgt_tok = tokenizers
        self.valid_sets, self.loss_batches = valid_sets, loss_batches
        self.with_bleu, self.comet = cfg.train.valid_bleu, comet
        self.decode = replace(cfg.decode, beam=cfg.train.valid_beam)
        self.device = device
        self.data = cfg.data

    @torch.no_grad()
    def validate(self, step: int) -> dict:
        """Loss and BLEU at update ``step``; {} without a validation set.

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
                "or train.valid_beam", step,
            )  # fmt: skip
            return {}

    def _validate(self) -> dict:
        """The loss over every validation set; BLEU and COMET of each, and their means when there are several
        (``valid_bleu_by_direction``, ``valid_comet_by_direction``)."""
        self.model.eval()
        if not self.valid_sets:
            return {}
        result = self._loss()
        if not (self.with_bleu or self.comet):
            return result
        translations = {v.direction: self._translations(v) for v in self.valid_sets}
        if self.with_bleu:
            scores = {v.direction: bleu(translations[v.direction], v.references) for v in self.valid_sets}
            result.update(_by_direction("bleu", {d: (s.value, s.signature) for d, s in scores.items()}))
        if self.comet is not None:
            comet = self.comet
            scored = {}
            for v in self.valid_sets:
                references = [v.references] if comet.needs_references else None
                scored[v.direction] = comet.score(v.sources, [translations[v.direction]], references)[0]
            result.update(_by_direction("comet", {d: (r.system, r.signature) for d, r in scored.items()}))
        return result

    def _loss(self) -> dict:
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.loss_batches:
            sums += torch.stack(self.objective(*batch.to(self.device).tensors())).double()
        loss_sum, nll_sum = sums.tolist()
        tokens = sum(batch.target_tokens for batch in self.loss_batches)
        return {
            "valid_loss": loss_sum / tokens,
            "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 50)),
        }

    def _translations(self, valid: ValidationSet) -> list[str]:
        """A validation set decoded, a progress bar counting the sentences done."""
        what = "validation decoding" + (f" {valid.direction}" if len(self.valid_sets) > 1 else "")
        progress = StageProgress(what, total=len(valid.sources), unit="sentences")
        with autocast(self.device, self.dtype), progress as bar:
            translator = Translator(
                self.model, self.src_tok, self.tgt_tok, self.decode, self.device, on_batch=bar.advance
            )
            translator.source_prefix = valid.prefix
            translator.source_lead, translator.target_lead = language_leads(
                self.data, self.src_tok, self.tgt_tok, *valid.languages
            )
            return translator.translate(valid.sources)


def _by_direction(metric: str, scores: dict[str, tuple[float, str]]) -> dict:
    """``valid_METRIC`` (with several directions their mean, and each one's) and ``METRIC_signature``."""
    values = {direction: value for direction, (value, _) in scores.items()}
    result: dict = {f"valid_{metric}": sum(values.values()) / len(values)}
    if len(values) > 1:
        result[f"valid_{metric}_by_direction"] = values
    result[f"{metric}_signature"] = next(iter(scores.values()))[1]
    return result
