"""Validating the model in training: its loss over the validation sets, and the BLEU of their translations
decoded with train.valid_beam (one score per direction, and their mean, which best/ and early stopping follow).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch

from mtkit.config import RunConfig
from mtkit.data.parallel import Batch
from mtkit.data.tokenizer import Tokenizer
from mtkit.decoding.line_translator import Translator
from mtkit.model.loss import TrainingObjective
from mtkit.progress import StageProgress
from mtkit.runtime import autocast
from mtkit.scoring.metrics import bleu
from mtkit.training.validation_set import ValidationSet

log = logging.getLogger("mtkit")


class Validator:
    """The loss of ``objective`` (the model's, in its compute dtype) on ``loss_batches`` and, with train.valid_bleu,
    the model's BLEU on ``valid_sets``."""

    def __init__(
        self,
        objective: TrainingObjective,
        tokenizers: tuple[Tokenizer, Tokenizer],
        valid_sets: list[ValidationSet],
        loss_batches: list[Batch],
        cfg: RunConfig,
        device: torch.device,
    ) -> None:
        self.objective, self.model, self.dtype = objective, objective.model, objective.dtype
        self.src_tok, self.tgt_tok = tokenizers
        self.valid_sets, self.loss_batches = valid_sets, loss_batches
        self.with_bleu = cfg.train.valid_bleu
        self.decode = replace(cfg.decode, beam=cfg.train.valid_beam)
        self.device = device

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
        """The loss over every validation set; BLEU of each, and their mean when there are several
        (``valid_bleu_by_direction``)."""
        self.model.eval()
        if not self.valid_sets:
            return {}
        result = self._loss()
        if self.with_bleu:
            scores = {v.direction: bleu(self._translations(v), v.references) for v in self.valid_sets}
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
            return translator.translate(valid.sources)
