"""The training pairs a run reads: token stores encoded once and kept between runs, one per corpus of
data.corpora, the SHA-256 of the files they came from (what a resume checks), and the mix that draws
each batch from one of several corpora."""

from __future__ import annotations

import logging
from pathlib import Path

from mtkit.config import RunConfig
from mtkit.data.directions import CorpusFiles, language_leads
from mtkit.data.parallel import DataError, file_digest, iter_parallel
from mtkit.data.sampling import CorpusMix, corpus_probabilities
from mtkit.data.token_store import TokenStore, default_cache_dir, open_or_build, store_key
from mtkit.data.tokenizer import Tokenizer

log = logging.getLogger("mtkit")


def open_training_data(cfg: RunConfig, src_tok: Tokenizer, tgt_tok: Tokenizer) -> TokenStore:
    """The training pairs as a memory-mapped token store, encoded now unless an earlier run did it."""
    data = cfg.data
    paths = [data.train_src, data.train_tgt] if data.train_tgt else [data.train_src]
    leads = language_leads(data, src_tok, tgt_tok, data.src_lang, data.tgt_lang)
    key = store_key(paths, src_tok, tgt_tok, data.max_tokens, data.max_ratio, leads=leads)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    return open_or_build(cache_dir, iter_parallel(data.train_src, data.train_tgt), key, src_tok, tgt_tok)


def open_corpus_data(cfg: RunConfig, corpus: CorpusFiles, src_tok: Tokenizer, tgt_tok: Tokenizer) -> TokenStore:
    """One corpus of data.corpora as a token store, its sources read after their tags; a DataError names it."""
    data = cfg.data
    paths = [corpus.train_src, corpus.train_tgt] if corpus.train_tgt else [corpus.train_src]
    leads = language_leads(data, src_tok, tgt_tok, corpus.config.src_lang, corpus.config.tgt_lang)
    key = store_key(paths, src_tok, tgt_tok, data.max_tokens, data.max_ratio, corpus.prefix, leads)
    cache_dir = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    prefix = corpus.prefix
    pairs = ((prefix + s if s.strip() else s, t) for s, t in iter_parallel(corpus.train_src, corpus.train_tgt))
    try:
        return open_or_build(cache_dir, pairs, key, src_tok, tgt_tok)
    except DataError as err:
        raise DataError(f"{corpus.name}: {err}") from None


def open_stores(cfg: RunConfig, corpora: list[CorpusFiles], src_tok: Tokenizer, tgt_tok: Tokenizer) -> list[TokenStore]:
    """The training pairs: one token store, or one per corpus of data.corpora."""
    if not corpora:
        return [open_training_data(cfg, src_tok, tgt_tok)]
    return [open_corpus_data(cfg, c, src_tok, tgt_tok) for c in corpora]


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


def corpus_mix(cfg: RunConfig, corpora: list[CorpusFiles], stores: list[TokenStore], multiple: int) -> CorpusMix | None:
    """The draw of each batch from one of data.corpora, by weight and data.temperature; None for one corpus."""
    if not corpora:
        return None
    shares = corpus_probabilities(
        [len(store) for store in stores], [c.config.weight for c in corpora], cfg.data.temperature
    )
    log.info(
        "batches drawn from %s",
        ", ".join(f"{c.name} {len(st):,} pairs {p:.1%}" for c, st, p in zip(corpora, stores, shares)),
    )
    return CorpusMix(stores, shares, cfg.train.batch_tokens, cfg.train.seed, multiple)
