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

from mtkit import files
from mtkit.config import ConfigError, RunConfig
from mtkit.data.parallel import DataError
from mtkit.data.tokenizer import Tokenizer, train_spm
from mtkit.files import file_sha256
from mtkit.model import checkpoint

log = logging.getLogger("mtkit")

Pairs = Callable[[], Iterable[tuple[str, str]]]  # a fresh pass over the training pairs


def prepare_tokenizers(cfg: RunConfig, out_dir: Path, pairs: Pairs) -> tuple[Tokenizer, Tokenizer]:
    """Put the run's tokenizer(s) in ``out_dir`` (reused, copied from the config, or trained now) and open them.

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
    return open_tokenizers(cfg, out_dir)


def open_tokenizers(cfg: RunConfig, out_dir: Path) -> tuple[Tokenizer, Tokenizer]:
    """The source and target tokenizers that ``prepare_tokenizers`` put in ``out_dir`` (one file when joint)."""
    names = checkpoint.tokenizer_files(cfg)
    return Tokenizer(out_dir / names["src"]), Tokenizer(out_dir / names["tgt"])


def _copy_tokenizer(source: Path, target: Path) -> None:
    if not source.is_file():
        raise DataError(f"{source}: tokenizer model not found")
    vocab = source.with_suffix(".vocab")
    if vocab.is_file():  # the .vocab first: a model in the run directory is always a whole pair
        files.copy_file(vocab, target.with_suffix(".vocab"))
    files.copy_file(source, target)


def _train_tokenizer(cfg: RunConfig, side: str, target: Path, pairs: Pairs) -> None:
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
