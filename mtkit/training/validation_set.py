"""The validation sets, read once per run (one per direction), and the pairs their loss is computed on,
encoded and batched once."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mtkit.config import RunConfig
from mtkit.data.directions import CorpusFiles, language_leads, source_prefix
from mtkit.data.parallel import Batch, DataError, collate, read_parallel, token_batches
from mtkit.data.tokenizer import Tokenizer

log = logging.getLogger("mtkit")


@dataclass(frozen=True)
class ValidationSet:
    """One direction's validation pairs; ``prefix`` (its language tag) goes before each source."""

    direction: str  # SRC-TGT
    languages: tuple[str, str]  # (SRC, TGT)
    sources: list[str]
    references: list[str]
    prefix: str = ""
    where: str = ""  # its files, for messages

    def tagged_sources(self) -> list[str]:
        """The sources as the model reads them: with the prefix, except blank lines (which stay blank)."""
        return [self.prefix + s if self.prefix and s.strip() else s for s in self.sources]


def read_validation_sets(cfg: RunConfig, corpora: list[CorpusFiles]) -> list[ValidationSet]:
    """The validation set of each direction that has one: data.valid_src's, or each corpus's; none without."""
    data = cfg.data
    if not corpora:
        if not data.valid_src:
            return []
        where = " and ".join(filter(None, (data.valid_src, data.valid_tgt)))
        sources, references = read_parallel(data.valid_src, data.valid_tgt)
        langs = (data.src_lang, data.tgt_lang)
        return [ValidationSet(f"{data.src_lang}-{data.tgt_lang}", langs, sources, references, where=where)]
    sets = []
    for c in corpora:
        if c.valid_src:
            where = " and ".join(filter(None, (c.valid_src, c.valid_tgt)))
            sources, references = read_parallel(c.valid_src, c.valid_tgt)
            prefix = source_prefix(data, c.config.tgt_lang)  # real text: never <BT>
            langs = (c.config.src_lang, c.config.tgt_lang)
            sets.append(ValidationSet(c.config.direction, langs, sources, references, prefix, where))
    return sets


def loss_batches(cfg: RunConfig, src_tok: Tokenizer, tgt_tok: Tokenizer, sets: list[ValidationSet]) -> list[Batch]:
    """The validation pairs the loss can be computed on, encoded and batched for the whole run.

    A pair with an empty side, or one longer than the model's positions, is left out of the loss
    and counted (BLEU still translates every line, truncating as ``translate`` does). A set with
    no such pair is refused now, before any update, rather than at the first validation.
    """
    src: list[list[int]] = []
    tgt: list[list[int]] = []
    for valid in sets:
        limit = cfg.model.max_positions - 1  # each side gets an eos or bos
        src_lead, tgt_lead = language_leads(cfg.data, src_tok, tgt_tok, *valid.languages)
        src_ids = src_tok.encode(valid.tagged_sources())
        tgt_ids = tgt_tok.encode(valid.references)
        pairs = [
            ([*src_lead, *s], [*tgt_lead, *t])
            for s, t in zip(src_ids, tgt_ids)
            if s and t and len(s) + len(src_lead) <= limit and len(t) + len(tgt_lead) <= limit
        ]
        empty = sum(1 for s, t in zip(src_ids, tgt_ids) if not s or not t)
        too_long = len(src_ids) - len(pairs) - empty
        if not pairs:
            raise DataError(
                f"{valid.where}: no validation pair to compute a loss on ({empty} with an empty side, "
                f"{too_long} longer than model.max_positions {cfg.model.max_positions} allows)"
            )
        if empty or too_long:
            log.warning(
                "validation loss leaves out %d of %d pairs of %s: %d with an empty side, %d longer than %d tokens",
                empty + too_long, len(src_ids), valid.where, empty, too_long, limit,
            )  # fmt: skip
        src += [s for s, _ in pairs]
        tgt += [t for _, t in pairs]
    if not src:
        return []
    batches = token_batches([len(s) for s in src], [len(t) for t in tgt], cfg.train.batch_tokens, seed=0)
    return [collate([src[i] for i in b], [tgt[i] for i in b]) for b in batches]
