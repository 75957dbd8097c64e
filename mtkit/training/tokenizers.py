"""The run's tokenizers: rank 0 prepares them in the run directory, then every rank opens them from there.

Preparing reuses a tokenizer an earlier run left (after checking it is the one the config asks for),
copies the config's, or trains one on the training pairs. It writes files, so rank 0 alone does it,
once, before the other ranks open the result.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from mtkit import files
from mtkit.config import ConfigError, RunConfig
from mtkit.data.directions import CorpusFiles, reserved_symbols
from mtkit.data.parallel import DataError, iter_parallel
from mtkit.data.tokenizer import Tokenizer, train_spm
from mtkit.files import file_sha256
from mtkit.model import checkpoint
from mtkit.training.resume import ResumeRefused

log = logging.getLogger("mtkit")

Pairs = Callable[[], Iterable[tuple[str, str]]]  # a fresh pass over the training pairs


def prepare_tokenizers(
    cfg: RunConfig, out_dir: Path, pairs: Pairs, corpora: list[CorpusFiles] = ()
) -> tuple[Tokenizer, Tokenizer]:
    """Put the run's tokenizer(s) in ``out_dir`` (reused, copied from the config, or trained now) and open them.

    Training streams ``pairs()``, or with several ``corpora`` an equal sample of each language's sentences;
    SentencePiece keeps a sample of tokenizer.input_sentence_size sentences. The language tags the config
    needs are reserved symbols of a source tokenizer trained here, and must be pieces of one given.
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
            _train_tokenizer(cfg, side, target, pairs, corpora)
    return open_tokenizers(cfg, out_dir)


def open_tokenizers(cfg: RunConfig, out_dir: Path) -> tuple[Tokenizer, Tokenizer]:
    """The source and target tokenizers that ``prepare_tokenizers`` put in ``out_dir`` (one file when joint),
    the source one checked to hold the language tags the config needs."""
    names = checkpoint.tokenizer_files(cfg)
    src_tok = Tokenizer(out_dir / names["src"])
    if missing := src_tok.missing_symbols(reserved_symbols(cfg.data)):
        raise ConfigError(
            f"{src_tok.path} has no piece for {', '.join(missing)}, which these corpora put before their sources: "
            "train the tokenizer with them (leave tokenizer.model empty) or use another --out"
        )
    return src_tok, Tokenizer(out_dir / names["tgt"])


def _copy_tokenizer(source: Path, target: Path) -> None:
    if not source.is_file():
        raise DataError(f"{source}: tokenizer model not found")
    vocab = source.with_suffix(".vocab")
    if vocab.is_file():  # the .vocab first: a model in the run directory is always a whole pair
        files.copy_file(vocab, target.with_suffix(".vocab"))
    files.copy_file(source, target)


def _train_tokenizer(cfg: RunConfig, side: str, target: Path, pairs: Pairs, corpora: list[CorpusFiles]) -> None:
    tc = cfg.tokenizer
    if corpora:
        sentences = balanced_sentences(corpora, None if tc.joint else side, tc.input_sentence_size, tc.seed)
    elif tc.joint:
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
    if corpora:
        sources = ", ".join(c.name for c in corpora)
    else:
        sources = " and ".join(filter(None, (cfg.data.train_src, cfg.data.train_tgt)))
    symbols = reserved_symbols(cfg.data) if side == "src" or tc.joint else []
    train_spm(sentences, target.with_suffix(""), tc, source=sources, symbols=symbols)


def balanced_sentences(corpora: list[CorpusFiles], side: str | None, size: int, seed: int) -> list[str]:
    """An equal share of ``size`` sentences (0: no limit) for each language of ``corpora`` (of one ``side``, or
    both when None), each share a uniform sample of that language's distinct sentences, so a language that
    several corpora share (English in en->de, en->fr, en->cs) does not outweigh the others. A language with
    fewer distinct sentences than its share gives them all."""
    per_language: dict[str, list[tuple[CorpusFiles, int]]] = {}
    for c in corpora:
        for column, lang in enumerate((c.config.src_lang, c.config.tgt_lang)):
            if side is None or side == ("src", "tgt")[column]:
                per_language.setdefault(lang, []).append((c, column))
    share = size // len(per_language) if size else 0
    rng = np.random.default_rng(seed)
    sentences: list[str] = []
    for streams in per_language.values():
        sample: list[str] = []
        held: set[str] = set()
        seen = 0
        for c, column in streams:
            for pair in iter_parallel(c.train_src, c.train_tgt):
                sentence = pair[column]
                if not sentence.strip() or sentence in held:
                    continue
                seen += 1
                if not share or len(sample) < share:
                    sample.append(sentence)
                    held.add(sentence)
                elif (slot := int(rng.integers(seen))) < share:  # reservoir sampling (Vitter's algorithm R)
                    held.discard(sample[slot])
                    sample[slot] = sentence
                    held.add(sentence)
        sentences += sample
    return sentences


def _check_run_tokenizer(path: Path, given: str, vocab_size: int) -> None:
    """A tokenizer already in the run directory is reused, so it must be the one the config asks for."""
    if given:
        if Path(given).is_file() and file_sha256(Path(given)) != file_sha256(path):
            raise ResumeRefused(
                f"{path} differs from the config's tokenizer model {given}", "use a new --out or --restart"
            )
        return
    found = Tokenizer(path).vocab_size
    if found != vocab_size:
        raise ResumeRefused(
            f"{path} has {found} pieces but tokenizer.vocab_size is {vocab_size}", "use a new --out or --restart"
        )
