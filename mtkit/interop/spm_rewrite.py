"""A transformers folder's SentencePiece model read as untrusted, and written again with its pieces in an imported
model's id order.

transformers' tokenizers number pieces by a vocabulary of their own (Marian's vocab.json, fairseq's dictionary),
not by the SentencePiece model's order, while mtkit's tokenizer gives the ids itself, with mtkit's special ids
(pad 0, unk 1, bos 2, eos 3). So an import rewrites the model with its pieces at the imported model's ids, keeping
each piece's type and score so that text segments as before, and loads the result once to check it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mtkit import untrusted
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtkit.hub_folders import ModelImportError

if TYPE_CHECKING:
    from sentencepiece import sentencepiece_model_pb2

MAX_SPM_BYTES = 64 << 20  # a SentencePiece model: 32k pieces take 0.8 MB, NLLB-200's 256k 4.9 MB


def read_model(path: Path) -> sentencepiece_model_pb2.ModelProto:
    """The SentencePiece model at ``path``, its size bounded before it is read; ModelImportError if it is none."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    if path.stat().st_size > MAX_SPM_BYTES:
        raise ModelImportError(f"{path}: more than {MAX_SPM_BYTES:,} bytes for a SentencePiece model")
    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception:  # protobuf's DecodeError, or a RuntimeWarning-turned-error on odd input
        raise ModelImportError(f"{path}: not a SentencePiece model") from None
    if not any(p.type in _segmenting(proto) for p in proto.pieces):
        raise ModelImportError(f"{path}: not a SentencePiece model (no pieces)")
    return proto


def _segmenting(proto: sentencepiece_model_pb2.ModelProto) -> tuple[int, ...]:
    """The types of the pieces text is segmented into: normal, user-defined and byte pieces."""
    return proto.SentencePiece.NORMAL, proto.SentencePiece.USER_DEFINED, proto.SentencePiece.BYTE


def segmenting_pieces(
    proto: sentencepiece_model_pb2.ModelProto,
) -> dict[str, sentencepiece_model_pb2.ModelProto.SentencePiece]:
    """The pieces text is segmented into, by name."""
    kinds = _segmenting(proto)
    return {p.piece: p for p in proto.pieces if p.type in kinds}


def rewritten(
    proto: sentencepiece_model_pb2.ModelProto,
    pieces: list[sentencepiece_model_pb2.ModelProto.SentencePiece],
    vocab_size: int,
    spm_path: Path,
    vocab_name: str,
) -> bytes:
    """``proto`` holding ``pieces`` instead of its own: the first ``vocab_size`` are the model's ids, mtkit's four
    special ones first; any after them only segment (``mtkit.data.tokenizer.vocabulary_size``). Checked to load
    with each piece at its id; errors name ``spm_path`` and the vocabulary the ids come from, ``vocab_name``."""
    del proto.pieces[:]
    proto.pieces.extend(pieces)
    spec = proto.trainer_spec
    spec.vocab_size = vocab_size
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    spec.pad_piece, spec.unk_piece, spec.bos_piece, spec.eos_piece = (p.piece for p in pieces[:4])
    written = proto.SerializeToString()
    _check_loads(written, [p.piece for p in pieces[:vocab_size]], spm_path, vocab_name)
    return written


def _check_loads(model: bytes, pieces: list[str], spm_path: Path, vocab_name: str) -> None:
    """The rewritten model loads in SentencePiece with each vocabulary piece at its id and mtkit's special ids,
    so an import never reports success for a tokenizer that translate would refuse or misread."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(model)
    except (RuntimeError, OSError) as err:
        reason = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
        raise ModelImportError(
            f"{spm_path}: with {vocab_name}'s pieces, not a usable SentencePiece model ({reason})"
        ) from None
    specials = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    moved = next((i for i, piece in enumerate(pieces) if sp.id_to_piece(i) != piece), None)
    if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID) or moved is not None:
        at = f"{untrusted.shown(pieces[moved])} is not at id {moved}" if moved is not None else "special ids moved"
        raise ModelImportError(f"{spm_path}: with {vocab_name}'s pieces, not a usable SentencePiece model ({at})")
