"""SentencePiece training and a thin wrapper that knows the special ids.

Every model mtkit trains uses the same special ids (pad 0, unk 1, bos 2, eos 3), so source and
target models of a separate-vocabulary run agree on them and search needs no per-side ids.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm

from mtkit.config import TokenizerConfig
from mtkit.data.clean import strip_invisible
from mtkit.errors import MtkitError
from mtkit.files import atomic_write, atomic_write_text, file_sha256
from mtkit.progress import StageProgress

if TYPE_CHECKING:
    from sentencepiece import sentencepiece_model_pb2

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
CHARS_PER_TOKEN = 32  # twice SentencePiece's longest piece (max_sentencepiece_length 16)
PARALLEL_LINES = 256  # fewer lines than this are encoded and decoded one by one, on one thread


class TokenizerError(MtkitError, ValueError):
    """A tokenizer model that cannot be trained or used."""


def train_spm(
    sentences: Iterable[str],
    out_prefix: Path,
    options: TokenizerConfig,
    source: str = "the input",
    threads: int = 2,
    symbols: Iterable[str] = (),
) -> Path:
    """Train a SentencePiece model on ``sentences``; writes PREFIX.model and PREFIX.vocab.

    The model is built in memory, so the same sentences and options give a byte-identical file
    (SentencePiece records the path it writes to inside a model it writes itself). Both files are
    written atomically, the .model last, so a crash never leaves a torn model that a resumed run
    would pick up. ``source`` names the text in errors. ``symbols`` are reserved: each is one piece, never
    split, wherever it stands (language tags).

    Progress shows in two stages: the sentences SentencePiece reads (it takes them all before it
    learns anything), then its training, which says nothing until it is done.
    """
    spm.set_random_generator_seed(options.seed)
    failures: list[Exception] = []
    given = 0
    path = out_prefix.with_name(out_prefix.name + ".model")  # not with_suffix: "spm.src" would lose ".src"
    stages = contextlib.ExitStack()

    def nonblank() -> Iterator[str]:
        """The sentences to learn from, remembering an input error that SentencePiece would swallow."""
        nonlocal given
        try:
            with StageProgress(f"reading sentences for {path.name}", unit="sentences") as reading:
                for sentence in sentences:
                    if sentence.strip():
                        given += 1
                        reading.advance()
                        yield sentence
        except Exception as err:
            failures.append(err)
            raise
        stages.enter_context(StageProgress(f"training {path.name} ({options.vocab_size:,} pieces)", unit=None))

    sampling = {}
    if options.input_sentence_size:
        sampling = {"input_sentence_size": options.input_sentence_size, "shuffle_input_sentence": True}
    model = io.BytesIO()
    feed = nonblank()
    try:
        with stages, contextlib.closing(feed):
            spm.SentencePieceTrainer.train(
                sentence_iterator=feed,
                model_writer=model,
                vocab_size=options.vocab_size,
                model_type=options.type,
                character_coverage=options.character_coverage,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                num_threads=threads,
                minloglevel=2,
                **({"user_defined_symbols": list(symbols)} if symbols else {}),
                **sampling,
            )
    except RuntimeError as err:
        if failures:  # the input was at fault (unreadable, misaligned): its own error says where
            raise failures[0] from None
        if not given:
            raise TokenizerError(f"{source}: no text to learn a tokenizer from (every line is empty)") from None
        # e.g. "Vocabulary size too high (8000). Please set it to a value <= 1234."
        raise TokenizerError(f"SentencePiece training failed: {str(err).strip().splitlines()[-1]}") from None
    trained = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{trained.id_to_piece(i)}\t{trained.get_score(i):g}\n" for i in range(trained.get_piece_size()))
    atomic_write_text(path.with_suffix(".vocab"), vocab)
    atomic_write(path, lambda f: f.write(model.getvalue()))
    return path


def is_sentencepiece_model(path: Path) -> bool:
    try:
        spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError):
        return False
    return True


def model_proto(sp: spm.SentencePieceProcessor) -> sentencepiece_model_pb2.ModelProto:
    """The model ``sp`` was loaded from, as SentencePiece's ModelProto message."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    return proto


def vocabulary_size(sp: spm.SentencePieceProcessor) -> int:
    """The ids a model of this tokenizer has: the model's ``trainer_spec.vocab_size`` first pieces.

    SentencePiece writes that many pieces, but a model converted from another toolkit's vocabulary
    (mtkit/interop/marian_vocabulary.py) may keep pieces after them that only segment: Marian splits text with
    its SentencePiece model and maps a piece its vocabulary lacks to unk, as ``Tokenizer.encode`` does.
    """
    proto = model_proto(sp)
    pieces = sp.get_piece_size()
    return min(proto.trainer_spec.vocab_size, pieces) if proto.trainer_spec.vocab_size > 0 else pieces


class Tokenizer:
    """A SentencePiece model: text <-> ids, with the shared special ids."""

    def __init__(self, model_path: Path) -> None:
        self.path = Path(model_path)
        if not self.path.is_file():
            raise TokenizerError(f"{self.path}: tokenizer model not found")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError):
            raise TokenizerError(f"{self.path}: not a SentencePiece model") from None
        ids = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TokenizerError(
                f"{self.path}: special ids pad/unk/bos/eos are {ids}, mtkit needs "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)} (train it with `mtkit tokenizer train`)"
            )
        self.sha256 = file_sha256(self.path)
        self.vocab_size = vocabulary_size(self.sp)
        # the user-defined pieces (reserved symbols such as language tags) and their ids: SentencePiece keeps each
        # whole, as its own piece, wherever it stands in a text
        proto = model_proto(self.sp)
        kind = proto.SentencePiece.USER_DEFINED
        self.user_defined = {p.piece: i for i, p in enumerate(proto.pieces) if p.type == kind}
        self._as_text: dict[frozenset[str], spm.SentencePieceProcessor] = {}

    def _processor(self, as_text: frozenset[str]) -> spm.SentencePieceProcessor:
        """The model, or a copy in which the user-defined pieces ``as_text`` are unused pieces, which SentencePiece
        never produces: a text holding one is segmented as any other text is (``<``, ``2``, ``fr``, ``>``)."""
        if not as_text:
            return self.sp
        if as_text not in self._as_text:
            proto = model_proto(self.sp)
            for piece in proto.pieces:
                if piece.piece in as_text and piece.type == piece.USER_DEFINED:
                    piece.type = piece.UNUSED
            self._as_text[as_text] = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        return self._as_text[as_text]

    def missing_symbols(self, symbols: Iterable[str]) -> list[str]:
        """Those of ``symbols`` that are not a piece of this model (text holding them would be split)."""
        return [s for s in symbols if self.sp.piece_to_id(s) == UNK_ID or self.sp.piece_to_id(s) >= self.vocab_size]

    def encode(self, lines: list[str], as_text: frozenset[str] = frozenset()) -> list[list[int]]:
        """Ids without bos/eos (the data and search code add them), of the text less the control and format
        characters `mtkit prepare` deletes from training data (a line of U+2060 alone is no text, not an unknown
        piece); the user-defined pieces ``as_text`` are text there, never their own piece (``_processor``).
        SentencePiece splits a list over all cores, starting threads at every call, which costs more than
        encoding a short line (docs/benchmarks.md, "Serving under load"), so a few lines are encoded one by one."""
        lines = [strip_invisible(line) for line in lines]
        sp = self._processor(as_text)
        if len(lines) < PARALLEL_LINES:
            seqs = [sp.encode(line, out_type=int) for line in lines]
        else:
            seqs = sp.encode(lines, out_type=int, num_threads=len(os.sched_getaffinity(0)))
        if self.vocab_size < self.sp.get_piece_size():  # pieces that only segment are unknown (``vocabulary_size``)
            return [[i if i < self.vocab_size else UNK_ID for i in seq] for seq in seqs]
        return seqs

    def encode_capped(self, lines: list[str], limit: int, as_text: frozenset[str] = frozenset()) -> list[list[int]]:
        """Ids of ``lines`` (``as_text`` as in ``encode``), each cut to at most ``limit + 1``: enough to tell a line
        over ``limit`` tokens.

        A line is encoded from its first ``limit * CHARS_PER_TOKEN`` characters: its first ``limit``
        tokens come from there (a piece has at most 16 characters), so a 26 MB line costs no more
        memory than a line just over the limit. Only a line whose start encodes to no more than
        ``limit`` tokens (runs of whitespace, which encode to nothing) is encoded whole.
        """
        cut = limit * CHARS_PER_TOKEN
        seqs = self.encode([line[:cut] for line in lines], as_text)
        for i, line in enumerate(lines):
            if len(line) > cut and len(seqs[i]) <= limit:
                seqs[i] = self.encode([line], as_text)[0]
        return [seq[: limit + 1] for seq in seqs]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text of each id list; a few one by one, as ``encode`` does."""
        if len(ids) < PARALLEL_LINES:
            return [self.sp.decode(one) for one in ids]
        return self.sp.decode(ids)
