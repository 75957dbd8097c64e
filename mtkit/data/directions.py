"""The directions a model translates, the reserved tags that tell it which, and where each corpus's files are.

A model trained on one corpus translates one direction and needs no tag. A model whose corpora have
several target languages reads the target language from a tag before each source, ``<2de> A dog runs.``
(Johnson et al., 2017): the tag is a reserved symbol of the tokenizer, so it is one piece, never split,
and ``mtkit translate --tgt-lang de`` puts it there. Sources of a back-translated corpus also get
``<BT>`` (Caswell et al., 2019), in training only. Tags are prefixed to the text, with a space, before
encoding: the same text gives the same pieces in training, validation and translation, whichever
engine encodes it. In the text to translate, a tag's characters are text like any other: ``<2fr>``
typed there is encoded as the characters it is made of, never as the tag (``typed_tags``).

A model told its languages by tokens (``data.languages``: an imported NLLB-200 or M2M100) translates between any
two of its languages: each source begins with its language's token and each output with the target language's,
ids the engines put there themselves (``language_ids``), so no text can choose them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mtkit.config import LANGUAGE_CODE, ConfigError, CorpusConfig, DataConfig
from mtkit.data.parallel import DataError
from mtkit.data.tokenizer import Tokenizer

BT_TAG = "<BT>"


TAG = re.compile(rf"<2(?:{LANGUAGE_CODE.pattern})>|{re.escape(BT_TAG)}")  # target_tag's or BT_TAG


def target_tag(lang: str) -> str:
    return f"<2{lang}>"


def typed_tags(symbols: dict[str, int]) -> dict[str, int]:
    """Those of a tokenizer's reserved ``symbols`` (piece: id) that are tags mtkit puts before a source: text to
    translate encodes them as text, so that it cannot choose the target language or mark itself back-translated.
    Other reserved symbols (an imported Marian model's ``>>fr<<``, which its users type) stay whole."""
    return {piece: i for piece, i in symbols.items() if TAG.fullmatch(piece)}


def directions(data: DataConfig) -> list[tuple[str, str]]:
    """The (source, target) language pairs a model of ``data`` is trained on, in the order the config names them."""
    if not data.corpora:
        return [(data.src_lang, data.tgt_lang)]
    return list(dict.fromkeys((c.src_lang, c.tgt_lang) for c in data.corpora))


def tags_targets(data: DataConfig) -> bool:
    """Whether sources carry a target-language tag: they do when the corpora have several target languages (and
    the model is not told its languages by tokens)."""
    return not data.languages and len({tgt for _, tgt in directions(data)}) > 1


def language_token(data: DataConfig, lang: str) -> str:
    """The piece of ``lang``'s token in a model of ``data.languages``."""
    return data.language_token.replace("{lang}", lang)


def language_leads(
    data: DataConfig, src_tok: Tokenizer, tgt_tok: Tokenizer, src_lang: str, tgt_lang: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids before each source (its language's token) and each target (the target language's) of a model told
    its languages by tokens; none for other models. ConfigError for a language that is not one of the model's, or
    whose token a tokenizer lacks."""
    if not data.languages:
        return (), ()
    leads = []
    for tok, lang, side in ((src_tok, src_lang, "source"), (tgt_tok, tgt_lang, "target")):
        choose_language(data, lang or None, side)
        piece = language_token(data, lang)
        found = tok.sp.piece_to_id(piece)
        if tok.sp.id_to_piece(found) != piece:
            raise ConfigError(f"{tok.path}: no token {piece!r}, which the model's config names for {lang}")
        leads.append((found,))
    return leads[0], leads[1]


def default_languages(data: DataConfig) -> tuple[str | None, str | None]:
    """The source and target languages a model told its languages by tokens translates when none are named: its
    config's data.src_lang and data.tgt_lang, each where it is one of its languages (None where not)."""
    return tuple(lang if lang in data.languages else None for lang in (data.src_lang, data.tgt_lang))


def choose_language(data: DataConfig, lang: str | None, side: str) -> str:
    """The ``side`` ("source" or "target") language of a model of ``data.languages``: ``lang``, which must be one of
    them, or the model's default (data.src_lang/tgt_lang) when that is one. ConfigError otherwise."""
    flag = "--src-lang" if side == "source" else "--tgt-lang"
    default = data.src_lang if side == "source" else data.tgt_lang
    shown = ", ".join(data.languages[:8]) + (", ..." if len(data.languages) > 8 else "")
    if not lang:
        if default not in data.languages:
            raise ConfigError(
                f"this model translates between {len(data.languages):,} languages ({shown}): say the {side} "
                f"language with {flag}"
            )
        return default
    if lang not in data.languages:
        raise ConfigError(f"{lang!r} is not one of this model's {len(data.languages):,} languages ({shown})")
    return lang


def reserved_symbols(data: DataConfig) -> list[str]:
    """The tags a tokenizer for ``data`` must hold as single pieces."""
    targets = dict.fromkeys(tgt for _, tgt in directions(data))
    symbols = [target_tag(tgt) for tgt in targets] if tags_targets(data) else []
    return symbols + ([BT_TAG] if any(c.back_translated for c in data.corpora) else [])


def source_prefix(data: DataConfig, tgt_lang: str, back_translated: bool = False) -> str:
    """The text put before each source sentence for ``tgt_lang``: its tag and <BT> as the model needs them."""
    tags = [target_tag(tgt_lang)] if tags_targets(data) else []
    tags += [BT_TAG] if back_translated else []
    return " ".join(tags) + " " if tags else ""


def choose_target(data: DataConfig, tgt_lang: str | None) -> str:
    """The target language to translate into: ``tgt_lang``, which must be one the model was trained for, or
    the model's only one. ConfigError naming the directions otherwise."""
    if data.languages:
        return choose_language(data, tgt_lang, "target")
    pairs = directions(data)
    targets = list(dict.fromkeys(tgt for _, tgt in pairs))
    trained = ", ".join(f"{src}->{tgt}" for src, tgt in pairs)
    if tgt_lang is None or tgt_lang == "":
        if len(targets) > 1:
            raise ConfigError(f"this model translates into {', '.join(targets)}: say which with --tgt-lang ({trained})")
        return targets[0]
    if tgt_lang not in targets:
        raise ConfigError(f"this model was not trained to translate into {tgt_lang!r}; it translates {trained}")
    return tgt_lang


def choose_source(data: DataConfig, src_lang: str | None, tgt_lang: str) -> str:
    """The source language of a translation into ``tgt_lang``: ``src_lang`` (checked against the model's
    directions into ``tgt_lang``, or its languages) or, where one is needed and none given, the model's default."""
    if data.languages:
        return choose_language(data, src_lang, "source")
    sources = [src for src, tgt in directions(data) if tgt == tgt_lang]
    if src_lang and src_lang not in sources:
        trained = ", ".join(f"{src}->{tgt}" for src, tgt in directions(data))
        raise ConfigError(
            f"this model was not trained to translate {src_lang!r} into {tgt_lang!r}; it translates {trained}"
        )
    return src_lang or sources[0]


def data_of(pairs: list[tuple[str, str]]) -> DataConfig:
    """A data section naming just these directions: what an export records of its model's."""
    if len(pairs) == 1:
        return DataConfig(src_lang=pairs[0][0], tgt_lang=pairs[0][1])
    return DataConfig(corpora=tuple(CorpusConfig(src, tgt) for src, tgt in pairs))


@dataclass(frozen=True)
class CorpusFiles:
    """One corpus of data.corpora with its files found: what training reads."""

    index: int
    name: str  # data.corpora[INDEX] (SRC-TGT), for messages
    config: CorpusConfig
    train_src: str
    train_tgt: str
    valid_src: str
    valid_tgt: str
    prefix: str  # put before each training and validation source


def corpus_files(data: DataConfig) -> list[CorpusFiles]:
    """Each corpus of ``data.corpora`` with its training and validation files, checked against its languages.

    A prepared folder gives train.SRC and train.TGT (valid.* when there); a file whose name ends in the code
    of another language of the config than the side it is given for is refused, as swapped files would be.
    """
    langs = {lang for c in data.corpora for lang in (c.src_lang, c.tgt_lang)}
    found = []
    for i, c in enumerate(data.corpora):
        name = f"data.corpora[{i}] ({c.direction})"
        if c.corpus:
            raise ConfigError(
                f"{name}: corpus {c.corpus} is prepared by `mtkit run`; for training, prepare it "
                f"(`mtkit prepare {c.corpus} DIR`) and give prepared: DIR"
            )
        train_src, train_tgt, valid_src, valid_tgt = c.train_src, c.train_tgt, c.valid_src, c.valid_tgt
        if c.prepared:
            train_src, train_tgt, valid_src, valid_tgt = _prepared_files(name, Path(c.prepared), c)
        if not train_src:
            raise ConfigError(f"{name}: no training data: give train_src (and train_tgt) or prepared")
        for side, path, lang in (("source", train_src, c.src_lang), ("target", train_tgt, c.tgt_lang),
                                 ("source", valid_src, c.src_lang), ("target", valid_tgt, c.tgt_lang)):  # fmt: skip
            named = _named_language(path)
            if named in langs and named != lang:
                raise ConfigError(f"{name}: {path} is named as {named} text, but the {side} language is {lang}")
        prefix = source_prefix(data, c.tgt_lang, c.back_translated)
        found.append(CorpusFiles(i, name, c, train_src, train_tgt, valid_src, valid_tgt, prefix))
    return found


def _prepared_files(name: str, folder: Path, c: CorpusConfig) -> tuple[str, str, str, str]:
    if not folder.is_dir():
        raise DataError(f"{name}: {folder} is not a folder (prepared: a folder laid out as `mtkit prepare` writes)")
    present = sorted(p.suffix[1:] for p in folder.glob("train.*"))
    for lang in (c.src_lang, c.tgt_lang):
        if not (folder / f"train.{lang}").is_file():
            raise DataError(
                f"{name}: {folder} has no train.{lang}: its languages ({', '.join(present) or 'none'}) "
                f"are not {c.src_lang} and {c.tgt_lang}"
            )
    valid = all((folder / f"valid.{lang}").is_file() for lang in (c.src_lang, c.tgt_lang))
    valid_src, valid_tgt = (str(folder / f"valid.{lang}") for lang in (c.src_lang, c.tgt_lang)) if valid else ("", "")
    return str(folder / f"train.{c.src_lang}"), str(folder / f"train.{c.tgt_lang}"), valid_src, valid_tgt


def _named_language(path: str) -> str | None:
    """The language code a file's name ends in (``train.de``, ``train.de.gz``), if it ends in one."""
    name = Path(path).name.removesuffix(".gz")
    suffix = Path(name).suffix[1:]
    return suffix or None
