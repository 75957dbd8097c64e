"""The validation set, read once per run, and the pairs its loss is computed on, encoded and batched once."""

from __future__ import annotations

import logging

from mtkit.config import RunConfig
from mtkit.data.parallel import Batch, DataError, collate, read_parallel, token_batches
from mtkit.data.tokenizer import Tokenizer

log = logging.getLogger("mtkit")


def read_validation_set(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """The validation sources and references as lines; none without data.valid_src."""
    data = cfg.data
    if not data.valid_src:
        return [], []
    return read_parallel(data.valid_src, data.valid_tgt)


def loss_batches(
    cfg: RunConfig, src_tok: Tokenizer, tgt_tok: Tokenizer, sources: list[str], references: list[str]
) -> list[Batch]:
    """The validation pairs the loss can be computed on, encoded and batched for the whole run.

    A pair with an empty side, or one longer than the model's positions, is left out of the loss
    and counted (BLEU still translates every line, truncating as ``translate`` does). A set with
    no such pair is refused now, before any update, rather than at the first validation.
    """
    if not sources:
        return []
    limit = cfg.model.max_positions - 1  # each side gets an eos or bos
    src_ids, tgt_ids = src_tok.encode(sources), tgt_tok.encode(references)
    pairs = [(s, t) for s, t in zip(src_ids, tgt_ids) if s and t and len(s) <= limit and len(t) <= limit]
    empty = sum(1 for s, t in zip(src_ids, tgt_ids) if not s or not t)
    too_long = len(src_ids) - len(pairs) - empty
    where = " and ".join(filter(None, (cfg.data.valid_src, cfg.data.valid_tgt)))
    if not pairs:
        raise DataError(
            f"{where}: no validation pair to compute a loss on ({empty} with an empty side, "
            f"{too_long} longer than model.max_positions {cfg.model.max_positions} allows)"
        )
    if empty or too_long:
        log.warning(
            "validation loss leaves out %d of %d pairs of %s: %d with an empty side, %d longer than %d tokens",
            empty + too_long, len(src_ids), where, empty, too_long, limit,
        )  # fmt: skip
    src, tgt = [s for s, _ in pairs], [t for _, t in pairs]
    batches = token_batches([len(s) for s in src], [len(t) for t in tgt], cfg.train.batch_tokens, seed=0)
    return [collate([src[i] for i in b], [tgt[i] for i in b]) for b in batches]
