"""A ``MarianMTModel``'s vocabularies renumbered as mtkit's ids, and its SentencePiece models rewritten to match.

Marian numbers pieces by vocab.json, not by its SentencePiece models, and has no padding id apart from
its decoder start; mtkit's tokenizer gives the ids itself. So each side's vocab.json is read (bounded
by the size config.json gives it) and renumbered, and its SentencePiece model rewritten with the
pieces in that order, then loaded once to check it gives mtkit's special ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from mtkit import untrusted
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtkit.hub_folders import ModelImportError, read_json, read_mapping
from mtkit.interop.marian_config import MarianConfig
from mtkit.interop.spm_rewrite import read_model, rewritten, segmenting_pieces

MAX_VOCAB_BYTES = 64 << 20  # vocab.json: OPUS-MT's 58,101 pieces take 1.2 MB
# bytes a vocab.json entry may take on average: a 14-character piece written as six-character escapes (MarianTokenizer
# writes each non-ASCII character as a backslash, u and four hex digits), its id, quotes and indent; OPUS-MT's take 21
MAX_VOCAB_ENTRY_BYTES = 96
PAD_PIECE = "<mtkit:pad>"  # mtkit's padding id, which Marian has no piece for
START_PIECE = "<s>"  # what the piece at mtkit's bos id is called: Marian's pad, its decoder start
_LANGUAGE_TAG = re.compile(r">>[^<>\s]+<<")


@dataclass
class Vocabulary:
    """One side's vocab.json (piece -> Marian id) with the names of its special pieces."""

    ids: dict[str, int]
    unk: str
    eos: str
    pad: str
    exported: int = 0  # mtkit's own export (``mtkit_layout``): how many of its ids are the model's, else 0
    order: list[int] = field(default_factory=list)  # Marian ids in mtkit id order; order[PAD_ID] is -1 (new)

    def __post_init__(self) -> None:
        if self.exported:  # mtkit's ids, kept: the padding rows and the appended start are dropped
            self.order = list(range(self.exported))
            return
        special = {self.ids[self.unk], self.ids[self.pad], self.ids[self.eos]}
        rest = sorted(i for i in self.ids.values() if i not in special)
        self.order = [-1, self.ids[self.unk], self.ids[self.pad], self.ids[self.eos], *rest]

    def pieces(self) -> list[str]:
        """The pieces in mtkit id order, the specials named as mtkit's tokenizer models name them."""
        by_id = {i: piece for piece, i in self.ids.items()}
        return [PAD_PIECE, self.unk, START_PIECE, self.eos, *(by_id[i] for i in self.order[4:])]


def read_vocabularies(folder: Path, marian: MarianConfig) -> tuple[Vocabulary, Vocabulary]:
    """The source and target vocabularies: vocab.json for both, unless target_vocab.json gives the target's
    (for embeddings not shared); the same object twice when they are one."""
    special = special_pieces(folder)
    separate = (folder / "target_vocab.json").is_file() and not marian.shared
    src = read_vocabulary(folder / "vocab.json", marian.vocab_size, special, marian, target=not separate)
    if separate:
        tgt = read_vocabulary(folder / "target_vocab.json", marian.decoder_vocab_size, special, marian, target=True)
        if bool(src.exported) != bool(tgt.exported):
            raise ModelImportError(
                f"{folder}: one of vocab.json and target_vocab.json is laid out as mtkit's export, the other not"
            )
        return src, tgt
    if marian.decoder_vocab_size != marian.vocab_size:
        raise ModelImportError(f"{folder}: two vocabulary sizes in config.json, and no target_vocab.json")
    return src, src


def read_vocabulary(path: Path, size: int, special: dict[str, str], marian: MarianConfig, target: bool) -> Vocabulary:
    """vocab.json: exactly ``size`` pieces with the ids 0..size-1, holding the special pieces at Marian's ids."""
    limit = min(MAX_VOCAB_BYTES, 1024 + size * MAX_VOCAB_ENTRY_BYTES)
    ids = read_json(path, limit, f"config.json's {size:,} pieces may take")
    if not isinstance(ids, dict) or len(ids) != size:
        found = f"{len(ids):,} entries" if isinstance(ids, dict) else untrusted.shown(ids)
        raise ModelImportError(f"{path}: must map {size:,} pieces (config.json's vocabulary size) to ids, got {found}")
    if sorted(v if isinstance(v, int) and not isinstance(v, bool) else -1 for v in ids.values()) != list(range(size)):
        raise ModelImportError(f"{path}: its ids must be 0 to {size - 1}, each once")
    for role, piece in special.items():
        if piece not in ids:
            raise ModelImportError(f"{path}: has no {role} piece {untrusted.shown(piece)}")
    exported = mtkit_layout(ids, special, marian)
    for piece in (PAD_PIECE, START_PIECE):
        if piece in ids and not (exported and piece == START_PIECE):
            raise ModelImportError(f"{path}: holds a piece named {piece}, the name mtkit gives a special id")
    vocab = Vocabulary(ids, special["unk"], special["eos"], special["pad"], exported)
    if target and (ids[vocab.pad], ids[vocab.eos]) != (marian.pad_id, marian.eos_id):
        raise ModelImportError(
            f"{path}: pad and eos are ids {ids[vocab.pad]} and {ids[vocab.eos]}, config.json says "
            f"{marian.pad_id} and {marian.eos_id}"
        )
    return vocab


def mtkit_layout(ids: dict[str, int], special: dict[str, str], marian: MarianConfig) -> int:
    """How many ids are the model's when vocab.json is laid out as ``mtkit export --format hf`` writes it, else 0.

    That layout keeps mtkit's ids (unk 1, bos ``<s>`` 2, eos 3; pad 0 renamed ``<unused:0>``), pads the
    smaller of two vocabularies with ``<unused:N>`` rows and appends Marian's pad, its decoder start, as the
    last id; so its ``<s>`` is mtkit's own bos, not a piece whose name would make text to ids ambiguous.
    """
    size = len(ids)
    by_id = {i: piece for piece, i in ids.items()}
    start = size - 1
    if (ids[special["unk"]], ids[special["eos"]], ids[special["pad"]]) != (UNK_ID, EOS_ID, start):
        return 0
    if marian.pad_id != start or by_id[PAD_ID] != "<unused:0>" or by_id[BOS_ID] != START_PIECE:
        return 0
    exported = start
    while exported > EOS_ID + 1 and by_id[exported - 1] == f"<unused:{exported - 1}>":
        exported -= 1
    return exported


def special_pieces(folder: Path) -> dict[str, str]:
    """tokenizer_config.json's names for unk, eos and pad (MarianTokenizer's defaults when absent)."""
    path = folder / "tokenizer_config.json"
    config = read_mapping(path) if path.is_file() else {}
    names = {}
    for role, default in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>")):
        value = config.get(f"{role}_token", default)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if not isinstance(value, str) or not value or len(value) > 64:
            raise ModelImportError(f"{path}: {role}_token must be a short string, got {untrusted.shown(value)}")
        names[role] = value
    if len(set(names.values())) < len(names):
        raise ModelImportError(
            f"{path}: unk_token, eos_token and pad_token must be three pieces, got "
            + ", ".join(untrusted.shown(v) for v in names.values())
        )
    return names


def target_tags(*vocabularies: Vocabulary) -> list[str]:
    """The target-language tags (``>>fr<<``) the vocabularies hold, sorted."""
    return sorted({piece for vocab in vocabularies for piece in vocab.ids if _LANGUAGE_TAG.fullmatch(piece)})


def tokenizer_model(spm_path: Path, vocab: Vocabulary, vocab_name: str, language_tags: bool) -> bytes:
    """``spm_path`` rewritten with the vocabulary's pieces in mtkit id order (see hf_import.py's docstring).

    Pieces keep their SentencePiece type and score, so text segments as before; vocabulary pieces the
    model lacks are unused (never produced, decoded as written); the model's pieces the vocabulary lacks
    come after ``trainer_spec.vocab_size`` ids. With ``language_tags``, tags such as ``>>fr<<`` are
    user-defined pieces, which SentencePiece keeps whole. A model whose pieces the vocabulary
    (``vocab_name``) mostly lacks is refused: it is another model's, or the other side's, and would
    encode most text as unk.
    """
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    Piece = model_pb2.ModelProto.SentencePiece
    proto = read_model(spm_path)
    known = segmenting_pieces(proto)
    lowest = min(p.score for p in known.values())
    pieces = vocab.pieces()
    types = [Piece.CONTROL, Piece.UNKNOWN, Piece.CONTROL, Piece.CONTROL]
    rewritten_pieces = []
    for i, name in enumerate(pieces):
        if i < len(types):
            rewritten_pieces.append(Piece(piece=name, score=0.0, type=types[i]))
        elif name in known:
            rewritten_pieces.append(Piece(piece=name, score=known[name].score, type=known[name].type))
        elif language_tags and _LANGUAGE_TAG.fullmatch(name):
            rewritten_pieces.append(Piece(piece=name, score=0.0, type=Piece.USER_DEFINED))
        else:
            rewritten_pieces.append(Piece(piece=name, score=lowest, type=Piece.UNUSED))
    in_vocabulary = set(pieces)
    lacking = sum(piece not in in_vocabulary for piece in known)
    if 2 * lacking > len(known):
        raise ModelImportError(
            f"{spm_path}: {lacking:,} of its {len(known):,} pieces are not in {vocab_name}: the SentencePiece model "
            "of another vocabulary (another model's, or source and target swapped?)"
        )
    rewritten_pieces += [
        Piece(piece=p.piece, score=p.score, type=p.type) for p in known.values() if p.piece not in in_vocabulary
    ]
    return rewritten(proto, rewritten_pieces, len(pieces), spm_path, vocab_name)
