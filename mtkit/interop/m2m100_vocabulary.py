"""The vocabulary of an NLLB-200 or M2M100 model as mtkit's ids, and its SentencePiece model rewritten to match.

Both number ids as fairseq's dictionary does: <s> 0, <pad> 1, </s> 2, <unk> 3, the text's pieces, then tokens no
text is segmented into (the language tokens, <mask>, fairseq's madeupwords) and rows that pad the table. mtkit's
special ids are pad 0, unk 1, bos 2, eos 3, so mtkit's id 0 is fairseq's 1, 1 is 3, 2 is 0 and 3 is 2, and every
other id is fairseq's own (``FAIRSEQ_ORDER``): the vocabulary is exactly the model's, and only the first four rows
of its embeddings move. Where the ids of the pieces come from:

- NLLB-200 (``NllbTokenizer``): piece i of sentencepiece.bpe.model, from its fourth, is id i + 1; the language
  codes (``eng_Latn``) and <mask> have the ids tokenizer.json's ``added_tokens`` give (else tokenizer_config.json's
  ``added_tokens_decoder``), as transformers reads them: they differ between the versions that wrote a folder.
  tokenizer.json's own vocabulary, where it has one, must give the pieces the same ids.
- M2M100 (``M2M100Tokenizer``): vocab.json gives the pieces' ids, sentencepiece.bpe.model segments the text, and
  a piece vocab.json lacks is unk; the language tokens (``__en__``) follow at len(vocab.json) + i, in the order of
  M2M100Tokenizer's list that tokenizer_config.json's ``language_codes`` names (m2m100 or wmt21), then
  ``num_madeup_words`` madeupwords.

The SentencePiece model is rewritten with its pieces at these ids (pieces keep their type and score, so text
segments as before): tokens that are no text are control pieces, never produced from text and decoded as nothing;
vocab.json's pieces the SentencePiece model lacks are unused; its pieces vocab.json lacks come after the model's
ids and encode as unk (``mtkit.data.tokenizer.vocabulary_size``). mtkit adds the language token and eos itself.
Every file is read within bounds that config.json's vocab_size sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtkit import untrusted
from mtkit.config import LANGUAGE_CODE
from mtkit.hub_folders import ModelImportError, config_field, read_json, read_mapping
from mtkit.interop.marian_vocabulary import MAX_VOCAB_BYTES, MAX_VOCAB_ENTRY_BYTES
from mtkit.interop.spm_rewrite import read_model, rewritten, segmenting_pieces

SPM_FILE = "sentencepiece.bpe.model"
TOKENIZER_FILES = (SPM_FILE, "tokenizer.json", "vocab.json")  # and tokenizer_config.json, a config file
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's ids 0 to 3
FAIRSEQ_OF_MTKIT = (1, 3, 0, 2)  # the fairseq id of mtkit's pad, unk, bos and eos
NLLB_TOKENIZERS = ("NllbTokenizer", "NllbTokenizerFast")
M2M100_TOKENIZERS = ("M2M100Tokenizer",)
MAX_TOKENIZER_JSON_BYTES = 64 << 20  # NLLB-200's tokenizer.json takes 17 MB
# tokenizer.json's bytes: 160 for each id config.json gives (a vocabulary entry and a merge, written out with
# indents, take about 70 in NLLB-200's), and this much besides (its normalizer's table takes 320 kB)
TOKENIZER_JSON_ENTRY_BYTES = 160
TOKENIZER_JSON_BYTES = 1 << 20
MAX_PIECE_CHARS = 256  # a piece of vocab.json or tokenizer.json: SentencePiece's pieces are 16 characters at most
MAX_TOKEN_CHARS = 64  # an added token (a language code, <mask>): NLLB-200's longest has 8 characters
MAX_MADEUP_WORDS = 1024  # fairseq's madeupwords, which round the table up: M2M100 has 8
# M2M100Tokenizer's language lists (its FAIRSEQ_LANGUAGE_CODES), by the name tokenizer_config.json's language_codes
# gives: the order that numbers the language tokens
LANGUAGE_CODES = {
    "m2m100": (
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi hr ht hu "
        "hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or pa pl ps pt "
        "ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu"
    ).split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}


def fairseq_order(size: int) -> Tensor:
    """The fairseq id at each mtkit id of a table of ``size`` rows: the first four differ (``FAIRSEQ_OF_MTKIT``),
    the others are the same."""
    return torch.cat([torch.tensor(FAIRSEQ_OF_MTKIT), torch.arange(len(FAIRSEQ_OF_MTKIT), size)])


@dataclass
class FairseqVocabulary:
    """The model's ids as fairseq numbers them, what each is, and the languages its tokens name."""

    size: int  # config.json's vocab_size
    text: dict[int, str]  # id -> a piece text is segmented into, for the ids from 4
    tokens: dict[int, str]  # id -> a token no text is segmented into: a language's, <mask>, a madeupword
    languages: tuple[str, ...]  # the codes of the languages, in the order of their tokens' ids
    language_token: str  # a language's token, {lang} standing for its code
    spm_path: Path
    ids_from: str  # the file that gives the ids, named in errors

    @property
    def order(self) -> Tensor:
        """The fairseq id at each mtkit id: embedding rows and logits in mtkit's order are ``table[order]``."""
        return fairseq_order(self.size)


def read_vocabulary(folder: Path, size: int) -> FairseqVocabulary:
    """The vocabulary of the folder's tokenizer (NllbTokenizer or M2M100Tokenizer), ``size`` ids in all."""
    _check_special_names(folder)
    if _tokenizer_class(folder) in NLLB_TOKENIZERS:
        return _nllb(folder, size)
    return _m2m100(folder, size)


def _tokenizer_class(folder: Path) -> str:
    """tokenizer_class, as tokenizer_config.json or else config.json gives it; where neither does, the one the files
    are for (M2M100Tokenizer's vocab.json)."""
    for name in ("tokenizer_config.json", "config.json"):
        path = folder / name
        value = read_mapping(path).get("tokenizer_class") if path.is_file() else None
        if value is None:
            continue
        if value not in (*NLLB_TOKENIZERS, *M2M100_TOKENIZERS):
            raise ModelImportError(
                f"{path}: tokenizer_class {untrusted.shown(value)}; mtkit reads the folders of NllbTokenizer and "
                "M2M100Tokenizer"
            )
        return value
    return M2M100_TOKENIZERS[0] if (folder / "vocab.json").is_file() else NLLB_TOKENIZERS[0]


def _check_special_names(folder: Path) -> None:
    """tokenizer_config.json names fairseq's special tokens as fairseq does, where it names them."""
    path = folder / "tokenizer_config.json"
    config = read_mapping(path) if path.is_file() else {}
    for role, expected in zip(("bos", "pad", "eos", "unk"), FAIRSEQ_SPECIALS):
        value = _content(config.get(f"{role}_token", expected))
        if value != expected:
            raise ModelImportError(
                f"{path}: {role}_token is {untrusted.shown(value)}; these models' is fairseq's {expected}"
            )


def _content(token: Any) -> Any:
    """A token as tokenizer files write it: the string, or an AddedToken's content."""
    return token.get("content") if isinstance(token, dict) else token


def _required(folder: Path, name: str, why: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise ModelImportError(f"{folder}: no {name}; {why}")
    return path


# -- NLLB-200 -------------------------------------------------------------------------------


def _nllb(folder: Path, size: int) -> FairseqVocabulary:
    """NllbTokenizer's ids: sentencepiece.bpe.model's pieces shifted by one, the added tokens at theirs."""
    spm_path = _required(folder, SPM_FILE, "NllbTokenizer segments text with it")
    proto = read_model(spm_path)
    Piece = proto.SentencePiece
    first = [(p.piece, p.type) for p in proto.pieces[:3]]
    if first != [("<unk>", Piece.UNKNOWN), ("<s>", Piece.CONTROL), ("</s>", Piece.CONTROL)]:
        raise ModelImportError(
            f"{spm_path}: its first pieces are not <unk>, <s> and </s>, which NllbTokenizer's ids assume"
        )
    if len(proto.pieces) + 1 > size:
        raise ModelImportError(
            f"{spm_path}: {len(proto.pieces):,} pieces, and config.json's vocab_size {size:,} has ids for "
            f"{size - 1:,} of them"
        )
    text = {i + 1: p.piece for i, p in enumerate(proto.pieces) if i >= 3}
    tokens, ids_from = _added_tokens(folder, size, text)
    languages = tuple(token for token in tokens.values() if LANGUAGE_CODE.fullmatch(token))
    if not languages:
        raise ModelImportError(f"{folder / ids_from}: gives no language token (NLLB-200's are eng_Latn, fra_Latn, ...)")
    _check_listed(folder, set(tokens.values()) | set(FAIRSEQ_SPECIALS), ids_from)
    return FairseqVocabulary(size, text, tokens, languages, "{lang}", spm_path, ids_from)


def _added_tokens(folder: Path, size: int, text: dict[int, str]) -> tuple[dict[int, str], str]:
    """The added tokens beyond fairseq's four, by id, from tokenizer.json (whose vocabulary must give the pieces the
    ids ``text`` gives them) or else tokenizer_config.json's added_tokens_decoder; and the file's name."""
    path = folder / "tokenizer.json"
    if path.is_file():
        limit = min(MAX_TOKENIZER_JSON_BYTES, TOKENIZER_JSON_BYTES + size * TOKENIZER_JSON_ENTRY_BYTES)
        data = read_json(path, limit, f"config.json's {size:,} ids may take")
        if not isinstance(data, dict) or not isinstance(data.get("added_tokens"), list):
            raise ModelImportError(f"{path}: holds no list of added_tokens, as a tokenizer's tokenizer.json does")
        entries = [
            (entry.get("id"), entry.get("content")) if isinstance(entry, dict) else (None, None)
            for entry in data["added_tokens"]
        ]
        _check_text_ids(data.get("model"), text, path)
    else:
        path = folder / "tokenizer_config.json"
        decoder = read_mapping(path).get("added_tokens_decoder") if path.is_file() else None
        if not isinstance(decoder, dict):
            raise ModelImportError(
                f"{folder}: no tokenizer.json, nor added_tokens_decoder in tokenizer_config.json, to give the ids of "
                "its language tokens"
            )
        entries = [(_decimal(key), _content(value)) for key, value in decoder.items()]
    return _checked_tokens(entries, size, text, path), path.name


def _decimal(key: str) -> int | str:
    """A key of added_tokens_decoder as the id it names (ASCII digits), or as it is, which the checks refuse."""
    return int(key) if key.isascii() and key.isdecimal() and len(key) <= 12 else key


def _text(value: Any, most: int = MAX_PIECE_CHARS) -> bool:
    """Whether ``value`` is a string of 1 to ``most`` characters that UTF-8 can write (no lone surrogate, which
    JSON's escapes can make and a SentencePiece model cannot hold)."""
    if not isinstance(value, str) or not 0 < len(value) <= most:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _checked_tokens(entries: list[tuple[Any, Any]], size: int, text: dict[int, str], path: Path) -> dict[int, str]:
    """The added tokens (id, content) beyond fairseq's four: ids within ``size``, none twice nor a piece's, each
    token a short string given once, fairseq's four at their own ids."""
    if len(entries) > size:
        raise ModelImportError(f"{path}: {len(entries):,} added tokens, more than config.json's {size:,} ids")
    tokens: dict[int, str] = {}
    given: set[str] = set()
    for token_id, content in entries:
        shown = f"added token {untrusted.shown(content)} (id {untrusted.shown(token_id)})"
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < size:
            raise ModelImportError(f"{path}: {shown}: ids are 0 to {size - 1:,} (config.json's vocab_size)")
        if not _text(content, MAX_TOKEN_CHARS) or content != content.strip():
            raise ModelImportError(
                f"{path}: {shown}: a token is a string of 1 to {MAX_TOKEN_CHARS} characters, no space around it"
            )
        if token_id < len(FAIRSEQ_SPECIALS) or content in FAIRSEQ_SPECIALS:
            if token_id >= len(FAIRSEQ_SPECIALS) or FAIRSEQ_SPECIALS[token_id] != content:
                raise ModelImportError(f"{path}: {shown}: fairseq's ids 0 to 3 are {', '.join(FAIRSEQ_SPECIALS)}")
            continue
        if token_id in text:
            raise ModelImportError(f"{path}: {shown}: that id is the piece {untrusted.shown(text[token_id])}")
        if token_id in tokens:
            raise ModelImportError(f"{path}: {shown}: {untrusted.shown(tokens[token_id])} has that id too")
        if content in given:
            raise ModelImportError(f"{path}: added token {untrusted.shown(content)} has two ids")
        tokens[token_id] = content
        given.add(content)
    return dict(sorted(tokens.items()))


def _check_text_ids(model: Any, text: dict[int, str], path: Path) -> None:
    """tokenizer.json's vocabulary (transformers segments text with it, mtkit with sentencepiece.bpe.model) gives
    each piece the id the SentencePiece model gives it: a folder of two tokenizers' files is refused."""
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, list):  # a unigram model's [piece, score] pairs, in id order
        vocab = {entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry and _text(entry[0])}
    if not isinstance(vocab, dict):
        return
    first, last = min(text), max(text)
    theirs = {i: piece for piece, i in vocab.items() if isinstance(i, int) and first <= i <= last}
    differs = next((i for i in text if theirs.get(i) != text[i]), None)
    if differs is not None:
        raise ModelImportError(
            f"{path}: id {differs} is {untrusted.shown(theirs.get(differs))}, and {SPM_FILE} makes it "
            f"{untrusted.shown(text[differs])}: the files of two tokenizers"
        )


def _check_listed(folder: Path, given: set[str], ids_from: str) -> None:
    """The special tokens tokenizer_config.json lists (the language codes, older folders' additional_special_tokens)
    each have an id in ``ids_from``: a language the tokenizer names has its token."""
    path = folder / "tokenizer_config.json"
    config = read_mapping(path) if path.is_file() else {}
    for key in ("extra_special_tokens", "additional_special_tokens"):
        listed = config.get(key) or []
        if not isinstance(listed, list):
            raise ModelImportError(f"{path}: {key} must be a list of tokens, got {untrusted.shown(listed)}")
        missing = next((t for t in map(_content, listed) if not isinstance(t, str) or t not in given), None)
        if missing is not None:
            raise ModelImportError(f"{path}: {key} lists {untrusted.shown(missing)}, which {ids_from} gives no id")


# -- M2M100 ---------------------------------------------------------------------------------


def _m2m100(folder: Path, size: int) -> FairseqVocabulary:
    """M2M100Tokenizer's ids: vocab.json's, then its list's language tokens and the madeupwords."""
    vocab_path = _required(folder, "vocab.json", "M2M100Tokenizer numbers the pieces by it")
    spm_path = _required(folder, SPM_FILE, "M2M100Tokenizer segments text with it")
    limit = min(MAX_VOCAB_BYTES, 1024 + size * MAX_VOCAB_ENTRY_BYTES)
    ids = read_json(vocab_path, limit, f"config.json's {size:,} ids may take")
    if not isinstance(ids, dict) or not len(FAIRSEQ_SPECIALS) <= len(ids) <= size:
        found = f"{len(ids):,} entries" if isinstance(ids, dict) else untrusted.shown(ids)
        raise ModelImportError(f"{vocab_path}: must map at most {size:,} pieces (config.json's) to ids, got {found}")
    if sorted(v if isinstance(v, int) and not isinstance(v, bool) else -1 for v in ids.values()) != list(
        range(len(ids))
    ):
        raise ModelImportError(f"{vocab_path}: its ids must be 0 to {len(ids) - 1:,}, each once")
    if strange := next((piece for piece in ids if not _text(piece, MAX_PIECE_CHARS)), None):
        raise ModelImportError(
            f"{vocab_path}: the piece {untrusted.shown(strange)} is not text of 1 to {MAX_PIECE_CHARS} characters"
        )
    for i, piece in enumerate(FAIRSEQ_SPECIALS):
        if ids.get(piece) != i:
            raise ModelImportError(f"{vocab_path}: {piece} must be id {i}, as fairseq's dictionary has it")
    codes, madeup = _language_list(folder)
    first = len(ids)
    if first + len(codes) > size:
        missing = f"__{codes[size - first]}__"
        raise ModelImportError(
            f"{folder / 'config.json'}: vocab_size {size:,} leaves no id for the language token {missing} "
            f"(M2M100Tokenizer numbers them from len(vocab.json), {first:,})"
        )
    tokens = {first + i: f"__{code}__" for i, code in enumerate(codes)}
    after = first + len(codes)
    tokens |= {after + i: f"madeupword{i:04d}" for i in range(min(madeup, size - after))}
    named = set(tokens.values())
    clash = next((piece for piece in ids if piece in named), None)
    if clash is not None:
        raise ModelImportError(f"{vocab_path}: holds {clash}, the token M2M100Tokenizer gives an id of its own")
    text = {i: piece for piece, i in ids.items() if i >= len(FAIRSEQ_SPECIALS)}
    _check_pieces_match(spm_path, set(text.values()))
    return FairseqVocabulary(size, text, tokens, tuple(codes), "__{lang}__", spm_path, vocab_path.name)


def _language_list(folder: Path) -> tuple[list[str], int]:
    """M2M100Tokenizer's language codes (tokenizer_config.json's language_codes names the list) and
    num_madeup_words."""
    path = folder / "tokenizer_config.json"
    config = read_mapping(path) if path.is_file() else {}
    name = config_field(config, "language_codes", path, str, "m2m100")
    if name not in LANGUAGE_CODES:
        raise ModelImportError(
            f"{path}: language_codes {untrusted.shown(name)} is not one of M2M100Tokenizer's lists "
            f"({', '.join(LANGUAGE_CODES)})"
        )
    madeup = config_field(config, "num_madeup_words", path, int, 8)
    if madeup > MAX_MADEUP_WORDS:
        raise ModelImportError(f"{path}: num_madeup_words {madeup:,} is beyond {MAX_MADEUP_WORDS:,}")
    return LANGUAGE_CODES[name], madeup


def _check_pieces_match(spm_path: Path, pieces: set[str]) -> None:
    """sentencepiece.bpe.model is vocab.json's: most pieces it segments text into are in vocab.json (M2M100's lacks a
    few, which encode as unk). Another model's would encode most text as unk."""
    known = segmenting_pieces(read_model(spm_path))
    lacking = sum(piece not in pieces for piece in known)
    if 2 * lacking > len(known):
        raise ModelImportError(
            f"{spm_path}: {lacking:,} of its {len(known):,} pieces are not in vocab.json: the SentencePiece model of "
            "another vocabulary"
        )


# -- the tokenizer model --------------------------------------------------------------------


def tokenizer_model(vocab: FairseqVocabulary) -> bytes:
    """The SentencePiece model with its pieces at mtkit's ids (see the module's docstring)."""
    proto = read_model(vocab.spm_path)
    Piece = proto.SentencePiece
    known = {name: (p.score, p.type) for name, p in segmenting_pieces(proto).items()}
    lowest = min(score for score, _ in known.values())
    pieces = [
        Piece(piece="<pad>", type=Piece.CONTROL),
        Piece(piece="<unk>", type=Piece.UNKNOWN),
        Piece(piece="<s>", type=Piece.CONTROL),
        Piece(piece="</s>", type=Piece.CONTROL),
    ]
    for i in range(len(pieces), vocab.size):
        if i in vocab.text:  # the text's piece, unused where the SentencePiece model lacks it
            score, kind = known.get(vocab.text[i], (lowest, Piece.UNUSED))
            pieces.append(Piece(piece=vocab.text[i], score=score, type=kind))
        else:  # a token, or a row that pads the table
            pieces.append(Piece(piece=vocab.tokens.get(i, f"<mtkit:unused:{i}>"), type=Piece.CONTROL))
    in_vocabulary = set(vocab.text.values())
    segmenting_only = (name for name in known if name not in in_vocabulary)
    pieces += [Piece(piece=name, score=known[name][0], type=known[name][1]) for name in segmenting_only]
    return rewritten(proto, pieces, vocab.size, vocab.spm_path, vocab.ids_from)
