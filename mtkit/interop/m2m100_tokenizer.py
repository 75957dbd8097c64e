"""The tokenizer files of an ``M2M100ForConditionalGeneration`` export (m2m100_export.py): the SentencePiece model
written back in fairseq's layout, and NllbTokenizer's or M2M100Tokenizer's files giving each piece and token the
model's id.

An imported NLLB-200 or M2M100 keeps fairseq's ids but the first four (m2m100_vocabulary.py), so its tokenizer
holds mtkit's special pieces at ids 0 to 3, the text's pieces from id 4 (sentencepiece.bpe.model's shifted by one
for NLLB-200, vocab.json's for M2M100), then the tokens no text is segmented into, as control pieces (the
languages', <mask>, madeupwords), and the rows that pad the table. A model fine-tuned from one keeps that
tokenizer. The export writes back:

- sentencepiece.bpe.model in fairseq's layout (<unk> 0, <s> 1, </s> 2, no pad), each piece with its score and
  type. NLLB-200's pieces are in id order, which is the original's; M2M100's are those that segment text (vocab.json
  lacks a few) in the order of their scores, the original's for a BPE model, as sentencepiece orders the pieces
  it learns.
- NLLB-200 (language tokens ``{lang}``): tokenizer.json and tokenizer_config.json as NllbTokenizer writes them, each
  added token (language codes, <mask>) at the model's id.
- M2M100 (``__{lang}__``): vocab.json with the pieces' ids, and tokenizer_config.json naming M2M100Tokenizer's
  language list, which numbers the language tokens from len(vocab.json), and its madeupwords.

The files are loaded back with transformers and checked to give every language's token and every piece the model's
id. A vocabulary neither tokenizer numbers as the model does, such as one mtkit trained with language tokens of its
own among the text's pieces, is refused in one line.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtkit import untrusted
from mtkit.config import ConfigError, DataConfig
from mtkit.data.directions import default_languages, language_token
from mtkit.data.tokenizer import Tokenizer, model_proto
from mtkit.interop.m2m100_vocabulary import FAIRSEQ_SPECIALS, LANGUAGE_CODES, SPM_FILE

if TYPE_CHECKING:
    from sentencepiece import sentencepiece_model_pb2

NLLB_TOKEN, M2M100_TOKEN = "{lang}", "__{lang}__"  # data.language_token of the two tokenizers
MTKIT_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")  # an imported model's pieces at mtkit's ids 0 to 3
PADDING_ROW = re.compile(r"<mtkit:unused:\d+>")  # the name the import gives a row that only pads the table
MADEUP_WORD = "madeupword{:04d}"
FIRST_TEXT_ID = len(FAIRSEQ_SPECIALS)


@dataclass
class FairseqLayout:
    """An imported model's vocabulary as fairseq numbers it: the text's pieces at ids 4 to ``text_end`` - 1, then
    the tokens (by id) no text is segmented into."""

    proto: sentencepiece_model_pb2.ModelProto  # mtkit's tokenizer model
    vocab_size: int
    text_end: int
    tokens: dict[int, str]
    languages: dict[str, int]  # code -> the id of its token


def fairseq_layout(tok: Tokenizer, data: DataConfig) -> FairseqLayout:
    """The layout of ``tok``, the tokenizer of a model of ``data.languages``; ConfigError where it is not an
    imported NLLB-200's or M2M100's."""
    proto = model_proto(tok.sp)
    control = proto.SentencePiece.CONTROL
    pieces = proto.pieces[: tok.vocab_size]
    if tuple(p.piece for p in pieces[:FIRST_TEXT_ID]) != MTKIT_SPECIALS:
        raise ConfigError(f"{tok.path}: its first pieces are not {', '.join(MTKIT_SPECIALS)}, as an import's are")
    languages = {}
    for lang in data.languages:
        found = tok.sp.piece_to_id(language_token(data, lang))
        if found < FIRST_TEXT_ID or pieces[found].piece != language_token(data, lang) or pieces[found].type != control:
            raise ConfigError(
                f"{tok.path}: the token of {lang} is no control piece after the text's, as in an imported NLLB-200 "
                "or M2M100 (a model mtkit trained with language tokens of its own: export it to CTranslate2)"
            )
        languages[lang] = found
    text_end = next(i for i in range(FIRST_TEXT_ID, len(pieces)) if pieces[i].type == control)
    stray = next((p.piece for p in pieces[text_end:] if p.type != control), None)
    if stray is not None:
        raise ConfigError(
            f"{tok.path}: the piece {untrusted.shown(stray)} follows the language tokens; NllbTokenizer and "
            "M2M100Tokenizer number the text's pieces before them"
        )
    tokens = {i: pieces[i].piece for i in range(text_end, len(pieces)) if not PADDING_ROW.fullmatch(pieces[i].piece)}
    return FairseqLayout(proto, tok.vocab_size, text_end, tokens, languages)


# -- sentencepiece.bpe.model ----------------------------------------------------------------


def fairseq_spm(layout: FairseqLayout, by_score: bool) -> bytes:
    """sentencepiece.bpe.model in fairseq's layout: the text's pieces in id order (NLLB-200), or ``by_score`` those
    that segment text in the order of their scores (M2M100: see the module)."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto()
    proto.CopyFrom(layout.proto)
    Piece = proto.SentencePiece
    text = list(layout.proto.pieces[FIRST_TEXT_ID : layout.text_end])
    if by_score:
        kinds = (Piece.USER_DEFINED, Piece.BYTE, Piece.NORMAL)  # the order sentencepiece gives them
        text += layout.proto.pieces[layout.vocab_size :]
        text = sorted((p for p in text if p.type in kinds), key=lambda p: (kinds.index(p.type), -p.score))
    elif len(layout.proto.pieces) > layout.vocab_size:
        raise ConfigError("the tokenizer holds pieces beyond the model's ids, which NllbTokenizer cannot number")
    specials = [
        Piece(piece="<unk>", score=0.0, type=Piece.UNKNOWN),
        Piece(piece="<s>", score=0.0, type=Piece.CONTROL),
        Piece(piece="</s>", score=0.0, type=Piece.CONTROL),
    ]
    del proto.pieces[:]
    proto.pieces.extend(specials + text)
    for piece in proto.pieces:  # sentencepiece leaves a normal piece's type unset, as its default
        if piece.type == Piece.NORMAL:
            piece.ClearField("type")
    spec = proto.trainer_spec
    spec.vocab_size = len(proto.pieces)
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    for name in ("unk_piece", "bos_piece", "eos_piece", "pad_piece"):  # sentencepiece's own names, left unset
        if getattr(spec, name) == spec.DESCRIPTOR.fields_by_name[name].default_value:
            spec.ClearField(name)
    return proto.SerializeToString()


# -- the tokenizer files ----------------------------------------------------------------------


def save_tokenizer(directory: Path, tok: Tokenizer, data: DataConfig, max_positions: int, transformers: Any) -> None:
    """The tokenizer files of a model of ``data.languages`` in ``directory``: NllbTokenizer's or M2M100Tokenizer's,
    as its language tokens are written; checked to load with every id the model's."""
    layout = fairseq_layout(tok, data)
    defaults = default_languages(data)
    src_lang = defaults[0] or data.languages[0]
    if data.language_token == NLLB_TOKEN:
        _save_nllb(directory, layout, src_lang, defaults[1], max_positions, transformers)
    elif data.language_token == M2M100_TOKEN:
        _save_m2m100(directory, layout, src_lang, defaults[1] or src_lang, max_positions, transformers)
    else:
        raise ConfigError(
            f"its language tokens are {untrusted.shown(data.language_token)}; transformers' tokenizers of "
            f"M2M100ForConditionalGeneration write them as {NLLB_TOKEN} (NllbTokenizer) or {M2M100_TOKEN} "
            "(M2M100Tokenizer)"
        )


def _save_nllb(
    directory: Path, layout: FairseqLayout, src_lang: str, tgt_lang: str | None, max_positions: int, transformers: Any
) -> None:
    """NllbTokenizer's files, built from the SentencePiece model as transformers builds them, with each added
    token moved to the model's id."""
    spm = fairseq_spm(layout, by_score=False)
    languages = list(layout.languages)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SPM_FILE).write_bytes(spm)
        built = transformers.NllbTokenizer.from_pretrained(
            tmp, extra_special_tokens=languages, src_lang=src_lang, tgt_lang=tgt_lang, model_max_length=max_positions
        )
        built.save_pretrained(str(directory))
    tokenizer_json = directory / "tokenizer.json"
    saved = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    ids = {token: i for i, token in layout.tokens.items()} | {piece: i for i, piece in enumerate(FAIRSEQ_SPECIALS)}
    added = saved["added_tokens"]
    for entry in added:
        if entry["content"] not in ids:
            raise ConfigError(f"NllbTokenizer adds the token {entry['content']}, which the model's vocabulary lacks")
        entry["id"] = ids.pop(entry["content"])
    template = next(entry for entry in added if entry["content"] == languages[0])
    added += [template | {"id": i, "content": token} for token, i in ids.items()]  # tokens NllbTokenizer lacks
    tokenizer_json.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
    # loaded and saved again, so that the files transformers derives from the ids (the template that puts the
    # language's token first) agree with them
    transformers.NllbTokenizer.from_pretrained(str(directory)).save_pretrained(str(directory))
    (directory / SPM_FILE).write_bytes(spm)
    loaded = transformers.NllbTokenizer.from_pretrained(str(directory))
    pieces = [p.piece for p in layout.proto.pieces[FIRST_TEXT_ID : layout.text_end]]
    theirs = loaded.convert_tokens_to_ids(pieces + list(layout.tokens.values()))
    ours = list(range(FIRST_TEXT_ID, layout.text_end)) + list(layout.tokens)
    _check_ids(theirs, ours, pieces + list(layout.tokens.values()), "NllbTokenizer")


def _save_m2m100(
    directory: Path, layout: FairseqLayout, src_lang: str, tgt_lang: str, max_positions: int, transformers: Any
) -> None:
    """M2M100Tokenizer's files: vocab.json, the language list that numbers the language tokens after it, the
    madeupwords."""
    languages = list(layout.languages)
    name = next((name for name, codes in LANGUAGE_CODES.items() if codes == languages), None)
    if name is None:
        raise ConfigError(
            f"M2M100Tokenizer numbers the languages of its own lists ({', '.join(LANGUAGE_CODES)}), and this model's "
            f"{len(languages):,} are another"
        )
    first = layout.text_end
    madeup = 0
    while layout.tokens.get(first + len(languages) + madeup) == MADEUP_WORD.format(madeup):
        madeup += 1
    expected = {first + i: M2M100_TOKEN.replace("{lang}", code) for i, code in enumerate(languages)}
    expected |= {first + len(languages) + i: MADEUP_WORD.format(i) for i in range(madeup)}
    if layout.tokens != expected:
        raise ConfigError(
            "M2M100Tokenizer numbers its language tokens from the first id after the text's pieces, in its list's "
            "order, then its madeupwords; this model's tokens are not so numbered"
        )
    vocab = {piece: i for i, piece in enumerate(FAIRSEQ_SPECIALS)}
    vocab |= {p.piece: FIRST_TEXT_ID + i for i, p in enumerate(layout.proto.pieces[FIRST_TEXT_ID:first])}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1), encoding="utf-8")
        (Path(tmp) / SPM_FILE).write_bytes(fairseq_spm(layout, by_score=True))
        built = transformers.M2M100Tokenizer(
            vocab_file=str(Path(tmp) / "vocab.json"),
            spm_file=str(Path(tmp) / SPM_FILE),
            src_lang=src_lang,
            tgt_lang=tgt_lang,
            language_codes=name,
            num_madeup_words=madeup,
            model_max_length=max_positions,
        )
        built.save_pretrained(str(directory))
    loaded = transformers.M2M100Tokenizer.from_pretrained(str(directory))
    _check_ids([loaded.get_lang_id(code) for code in languages], list(layout.languages.values()), languages,
               "M2M100Tokenizer")  # fmt: skip


def _check_ids(theirs: list[int], ours: list[int], names: list[str], tokenizer: str) -> None:
    """ConfigError naming the first token the written tokenizer numbers otherwise than the model does."""
    differs = next((k for k, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if differs is not None:
        raise ConfigError(
            f"{tokenizer} gives {untrusted.shown(names[differs])} the id {theirs[differs]}, and the model "
            f"{ours[differs]}"
        )
