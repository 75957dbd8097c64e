"""Lines in, lines out: tokenize, batch by length, search, detokenize, restore input order.

Input is taken in chunks (up to ``CHUNK_LINES`` at a time), so memory stays bounded on inputs of
any length while each chunk is still sorted by length into batches that waste little padding.
Results come back in input order as each chunk finishes, which makes ``translate`` usable in a
pipeline.

Exactly one result per input line: empty and whitespace-only lines give an empty translation
without touching the model, and lines longer than the model's positions are truncated to fit
(with a warning naming the line), never split, so line alignment holds.

``score`` reads pairs of lines (a source and a given target) in step the same way, and gives every pair, empty
lines included, the log-probability the model gives its target (mtkit.decoding.forced).
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from itertools import islice
from typing import Any

import torch

from mtkit.config import MAX_BEAM, ConfigError, DataConfig, DecodeConfig, SamplingConfig
from mtkit.data.directions import choose_source, choose_target, language_leads, source_prefix, typed_tags
from mtkit.data.parallel import DataError, source_tensor
from mtkit.data.tokenizer import Tokenizer
from mtkit.decoding.alignment import align_batch
from mtkit.decoding.ensemble import Ensemble
from mtkit.decoding.forced import forced_log_probs
from mtkit.decoding.search import beam_search, sample_search
from mtkit.decoding.shortlist import Shortlist
from mtkit.model.transformer import Transformer

log = logging.getLogger("mtkit")

CHUNK_LINES = 10_000


@dataclass(frozen=True)
class Translation:
    """One hypothesis for one input line."""

    text: str
    score: float  # length-normalised log-probability, what the beam ranks by
    logprob: float  # log-probability of the whole output, eos included
    alignment: str = ""  # Pharaoh "i-j" source-target word pairs, when asked for


EMPTY = Translation("", 0.0, 0.0)


@dataclass(frozen=True)
class PairScore:
    """How probable a model finds a given target for a given source (``LineTranslator.score``)."""

    logprob: float  # total log-probability of the target given the source, eos included
    tokens: int  # target tokens scored, eos included
    token_logprobs: tuple[float, ...] | None = None  # each one, when asked for


class PrefixMismatch(ValueError):
    """Target prefixes that are not line-aligned with the input."""


class PairMismatch(DataError):
    """Sources and targets to score that are not line-aligned: ``shorter`` ("sources" or "targets") ran out first,
    with no line ``line``."""

    def __init__(self, shorter: str, line: int) -> None:
        self.shorter, self.line = shorter, line
        longer = "targets" if shorter == "sources" else "sources"
        super().__init__(f"the {shorter} end before line {line:,}, the {longer} go on")


def source_ids(
    tok: Tokenizer,
    lines: list[str],
    max_positions: int,
    first_line: int | None = None,
    prefix: str = "",
    lead: tuple[int, ...] = (),
) -> dict[int, list[int]]:
    """The token ids of each of ``lines`` that needs a search, by index: empty, blank and token-less lines
    (U+200B alone) need none. Each line is read after ``prefix`` (a language tag, mtkit.data.directions), and its
    ids follow ``lead`` (a source language's token id). Ids are truncated to leave the source eos a position, with
    a warning that names the line where lines are numbered (``first_line``: the number of ``lines[0]``). Every
    engine encodes its sources here."""
    todo = [i for i, line in enumerate(lines) if line.strip()]
    limit = max_positions - 1 - len(lead)
    seqs = tok.encode_capped([prefix + lines[i] for i in todo], limit)
    tag = tok.encode([prefix])[0] if prefix else []
    tags = typed_tags(tok.user_defined)
    ids = set(tags.values())
    if typed := [k for k, seq in enumerate(seqs) if not ids.isdisjoint(seq[len(tag) :])]:
        # a tag typed in a line is the characters it is made of, never the tag (mtkit.data.directions)
        as_text = tok.encode_capped([lines[todo[k]] for k in typed], limit, frozenset(tags))
        for k, seq in zip(typed, as_text):
            seqs[k] = (tag + seq)[: limit + 1]
    if prefix:  # a line of U+200B alone is still no text: its tag alone is not translated
        todo, seqs = [i for i, seq in zip(todo, seqs) if seq != tag], [seq for seq in seqs if seq != tag]
    for i, seq in zip(todo, seqs):
        if len(seq) > limit:
            where = "a text" if first_line is None else f"line {first_line + i}:"
            log.warning("%s over %d source tokens, truncated to %d (model.max_positions)", where, limit, limit)
    return {i: [*lead, *seq[:limit]] for i, seq in zip(todo, seqs) if seq}


def target_ids(
    tok: Tokenizer, lines: list[str], max_positions: int, first_line: int | None = None, lead: tuple[int, ...] = ()
) -> list[list[int]]:
    """The token ids of each of ``lines`` as a target to score, empty lines included (nothing before eos):
    truncated, with a warning that names the line, to leave bos (and ``lead``, the target language's token the
    decoder reads after it) positions before them."""
    limit = max_positions - 1 - len(lead)
    seqs = tok.encode_capped(lines, limit)
    for i, seq in enumerate(seqs):
        if len(seq) > limit:
            where = "a target" if first_line is None else f"line {first_line + i}:"
            log.warning("%s over %d target tokens, truncated to %d (model.max_positions)", where, limit, limit)
    return [seq[:limit] for seq in seqs]


def pair_ids(
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    sources: list[str],
    targets: list[str],
    max_positions: tuple[int, int],
    first_line: int,
    prefix: str = "",
    leads: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
) -> list[tuple[list[int], list[int]]]:
    """The (source, target) ids of each pair to score, every pair included: a source encoded as translation
    encodes it (``source_ids``, after ``prefix`` and the source lead), an empty one as those alone before its eos,
    as the model saw sources in training; a target by ``target_ids`` (without the target lead, which the decoder
    reads before it). ``max_positions``: the model's (source, target) positions."""
    found = source_ids(src_tok, sources, max_positions[0], first_line, prefix, leads[0])
    empty = [*leads[0], *(src_tok.encode([prefix])[0] if prefix else [])]
    tgt = target_ids(tgt_tok, targets, max_positions[1], first_line, leads[1])
    return [(found.get(i, empty), tgt[i]) for i in range(len(sources))]


def pair_score(token_logprobs: list[float], tokens: bool) -> PairScore:
    """The score of a target whose tokens (eos included) have these log-probabilities; each kept if ``tokens``."""
    return PairScore(sum(token_logprobs), len(token_logprobs), tuple(token_logprobs) if tokens else None)


def paired_chunks(
    sources: Iterable[str], targets: Iterable[str], size: int = CHUNK_LINES
) -> Iterator[tuple[list[str], list[str]]]:
    """Consecutive (sources, targets) of up to ``size`` lines each, read in step, without their ending newlines;
    PairMismatch as soon as one runs out before the other."""
    src_lines, tgt_lines, first_line = iter(sources), iter(targets), 1
    while True:
        src, tgt = list(islice(src_lines, size)), list(islice(tgt_lines, size))
        if len(src) != len(tgt):
            raise PairMismatch("sources" if len(src) < len(tgt) else "targets", first_line + min(len(src), len(tgt)))
        if not src:
            return
        yield [without_newline(line) for line in src], [without_newline(line) for line in tgt]
        first_line += len(src)


def without_newline(line: str) -> str:
    """``line`` without the newline (LF or CRLF) a file's line ends with."""
    return line.removesuffix("\n").removesuffix("\r")


def length_batches(lengths: list[int], batch_size: int, batch_tokens: int, rows: int = 1) -> list[list[int]]:
    """Indices sorted by length (longest first), cut into batches of at most ``batch_size`` sentences
    and ``batch_tokens`` padded source tokens, each sentence counted ``rows`` times (its beam) since
    the search holds that many rows for it (a longer sentence still forms a batch of one)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    budget = batch_tokens / rows
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        # The first sentence of a batch is its longest, so the padded size is count x that length.
        if current and len(current) < batch_size and (len(current) + 1) * lengths[current[0]] <= budget:
            current.append(i)
        else:
            batches.append([i])
    return batches


class LineTranslator(ABC):
    """What every translator offers on top of ``stream``: a list in, a list out, and settings per call."""

    decode: DecodeConfig
    sampling: SamplingConfig | None = None  # engines that draw samples set it
    languages: tuple[str, str] | None = None  # (source, target) as the run's config names them, where known
    precision: dict[str, str] | None = None  # the number format it computes in and why (PrecisionChoice.to_dict)
    data: DataConfig | None = None  # the data section of the model's config: the directions it was trained for
    target_language: str | None = None  # the language it translates into; None until chosen (``into``)
    source_prefix: str = ""  # put before each source: the target's tag, in a model of several targets
    # A model told its languages by tokens (data.languages): the source language's token id, put before each
    # source, and the target language's, which each output starts with (forced, and not part of the translation).
    source_lead: tuple[int, ...] = ()
    target_lead: tuple[int, ...] = ()
    src_tok: Tokenizer
    tgt_tok: Tokenizer

    def into(self, tgt_lang: str | None, src_lang: str | None = None) -> LineTranslator:
        """This translator translating into ``tgt_lang``, which must be a target language of the model; None
        picks the model's only one (or the one chosen before). ``src_lang``: the source language, which a model
        told its languages by tokens needs (its default, or the one chosen before, when None); for other models
        it is checked against their directions. ConfigError, naming the model's directions, otherwise."""
        if self.data is None:  # an export of no known directions: one pair
            for given, known, side in ((tgt_lang, 1, "into"), (src_lang, 0, "from")):
                if given and self.languages and given != self.languages[known]:
                    raise ConfigError(f"this model translates {side} {self.languages[known]}, not {given!r}")
            return self
        if self.target_language is not None:
            tgt_lang = tgt_lang or self.target_language
            src_lang = src_lang or (self.languages[0] if self.languages and self.data.languages else None)
        lang = choose_target(self.data, tgt_lang)
        changed = copy.copy(self)
        changed.target_language, changed.source_prefix = lang, source_prefix(self.data, lang)
        changed.languages = (choose_source(self.data, src_lang, lang), lang)
        leads = language_leads(self.data, self.src_tok, self.tgt_tok, *changed.languages)
        changed.source_lead, changed.target_lead = leads
        return changed

    def check_target(self) -> None:
        """ConfigError unless the target language is known: a model of several needs ``into`` first."""
        if self.data is not None and self.target_language is None:
            choose_source(self.data, None, choose_target(self.data, None))
            if self.data.languages:  # a default direction, not yet chosen: translations would carry no tokens
                raise ConfigError("the languages are not chosen: give --src-lang and --tgt-lang")

    @abstractmethod
    def stream(self, chunks: Iterable[list[str]]) -> Iterator[list[Translation]]:
        """The translations of each line of each chunk, in order: each engine translates its own way."""

    nbest: int

    def using(self, nbest: int | None = None, **decode: Any) -> LineTranslator:
        """This translator with ``nbest`` or some decode settings changed (``beam=4, lenpen=0.6``); the model
        is shared."""
        changed = copy.copy(self)
        changed.decode = with_overrides(self.decode, decode)
        changed.nbest = self.nbest if nbest is None else nbest
        check_nbest(changed.nbest, changed.decode, changed.sampling)
        return changed

    def translate(
        self, lines: Iterable[str], tgt_lang: str | None = None, src_lang: str | None = None, **decode: Any
    ) -> list[str]:
        """The best translation of each line, in order: one string per line, "" for an empty line."""
        return [best[0].text for best in self.hypotheses(lines, tgt_lang, src_lang, **decode)]

    def hypotheses(
        self, lines: Iterable[str], tgt_lang: str | None = None, src_lang: str | None = None, **decode: Any
    ) -> Iterator[list[Translation]]:
        """The translations of each line (``nbest`` of them, best first, with scores and alignments when
        asked for), streamed: lines are read and translated in chunks, so any iterable will do, an open
        file too (a line's ending newline is not part of it). ``tgt_lang``: the target language, for a
        model of several; ``src_lang``: the source language, for a model told its languages by tokens."""
        translator = self.using(**decode).choosing(tgt_lang, src_lang)
        translator.check_target()
        yield from translator.stream(chunked(without_newline(line) for line in lines))

    def choosing(self, tgt_lang: str | None, src_lang: str | None) -> LineTranslator:
        """This translator, into ``tgt_lang`` from ``src_lang`` where either is given (``into``)."""
        return self if tgt_lang is None and src_lang is None else self.into(tgt_lang, src_lang)

    def score(
        self,
        sources: Iterable[str],
        targets: Iterable[str],
        tgt_lang: str | None = None,
        tokens: bool = False,
        src_lang: str | None = None,
    ) -> Iterator[PairScore]:
        """How probable the model finds each target given its source (teacher-forced, eos included), one score per
        pair, in order, empty lines included; with ``tokens``, each token's log-probability too. Streamed as
        ``hypotheses`` is: the two are read in step, in chunks, and PairMismatch names the line where one ran out.
        The model's tags apply as in translation (``tgt_lang``, for a model of several target languages;
        ``src_lang`` for one told its languages by tokens, whose target language token is given, not scored); a
        source or target longer than the model's positions is truncated, with a warning naming the line."""
        scorer = self.choosing(tgt_lang, src_lang)
        scorer.check_target()
        first_line = 1
        for src, tgt in paired_chunks(sources, targets):
            yield from scorer.score_chunk(src, tgt, first_line, tokens)
            first_line += len(src)

    def score_chunk(self, sources: list[str], targets: list[str], first_line: int, tokens: bool) -> list[PairScore]:
        """The scores of one chunk of pairs, whose first is line ``first_line``: each engine scores its own way."""
        raise ConfigError(f"{type(self).__name__} cannot score translations")


def check_nbest(nbest: int, decode: DecodeConfig, sampling: SamplingConfig | None = None) -> None:
    """A search keeps ``beam`` hypotheses, so it has at most that many to give (samples are drawn anew); each
    sample is a row of its own, so their number is bounded as a beam is."""
    if not 1 <= nbest <= MAX_BEAM:
        raise ConfigError(f"nbest must be between 1 and {MAX_BEAM:,}, got {nbest:,}")
    if sampling is None and nbest > decode.beam:
        raise ConfigError(f"nbest {nbest} needs a beam of at least {nbest} (the beam is {decode.beam})")


def with_overrides(decode: DecodeConfig, overrides: dict[str, Any]) -> DecodeConfig:
    """``decode`` with the given settings replaced, checked as a config is."""
    known = {f.name for f in fields(DecodeConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown decode setting {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return replace(decode, **overrides)


class Translator(LineTranslator):
    """A model, its tokenizers and decoding settings: translates lines, streaming or all at once."""

    def __init__(
        self,
        model: Transformer,
        src_tok: Tokenizer,
        tgt_tok: Tokenizer,
        decode: DecodeConfig,
        device: torch.device,
        nbest: int = 1,
        sampling: SamplingConfig | None = None,
        aligner: Transformer | None = None,
        on_batch: Callable[[int], None] | None = None,
        shortlist: Shortlist | None = None,
    ) -> None:
        """``aligner``: the model whose cross-attention gives each best translation a word alignment;
        ``on_batch(n)``: called as each batch of ``n`` lines is done (lines that need no model count as one batch),
        to show progress; ``shortlist``: beam search over each batch's candidate target tokens only."""
        check_nbest(nbest, decode, sampling)
        if shortlist is not None and sampling is not None:
            raise ConfigError("a shortlist is for beam search; sampling draws from the whole vocabulary")
        self.shortlist = shortlist
        self.model, self.src_tok, self.tgt_tok = model, src_tok, tgt_tok
        self.decode, self.device, self.nbest = decode, device, nbest
        self.sampling = sampling
        self.aligner = aligner
        self.on_batch = on_batch
        self.generator = torch.Generator(device).manual_seed(sampling.seed) if sampling is not None else None

    def reseeded(self, offset: int) -> Translator:
        """This translator drawing its samples afresh from the sampling seed plus ``offset``: a part of a long
        input sampled alone draws what it draws within the whole (mtkit.translation.resumable)."""
        changed = copy.copy(self)
        if self.sampling is not None:
            seed = (self.sampling.seed + offset) % 2**64
            changed.generator = torch.Generator(self.device).manual_seed(seed)
        return changed

    def stream(self, chunks: Iterable[list[str]], prefixes: Iterable[str] | None = None) -> Iterator[list[Translation]]:
        """The ``nbest`` translations of each line, best first, in input order, chunk by chunk.

        Each chunk is sorted into batches by length; all its results come out before the next
        chunk is read, so the caller decides how much input is held at once. ``prefixes``,
        line-aligned with the input, gives the start each translation must have ("" for none).
        """
        self.check_target()
        first_line = 1
        prefix_lines = iter(prefixes) if prefixes is not None else None
        for chunk in chunks:
            chunk_prefixes = None
            if prefix_lines is not None:
                chunk_prefixes = list(islice(prefix_lines, len(chunk)))
                if len(chunk_prefixes) < len(chunk):
                    raise PrefixMismatch(f"no prefix for input line {first_line + len(chunk_prefixes)}")
            yield from self._translate_chunk(chunk, first_line, chunk_prefixes)
            first_line += len(chunk)
        if prefix_lines is not None and next(prefix_lines, None) is not None:
            raise PrefixMismatch(f"more prefixes than the {first_line - 1} input lines")

    def score_chunk(self, sources: list[str], targets: list[str], first_line: int, tokens: bool) -> list[PairScore]:
        """The scores of one chunk of pairs, in batches by length (the longer of source and target) as translation
        batches its lines, each batch teacher-forced in one pass (mtkit.decoding.forced)."""
        limits = (self.model.max_source_positions, self.model.max_target_positions)
        leads = (self.source_lead, self.target_lead)
        pairs = pair_ids(self.src_tok, self.tgt_tok, sources, targets, limits, first_line, self.source_prefix, leads)
        results: dict[int, PairScore] = {}
        lengths = [max(len(src), len(tgt)) + 1 for src, tgt in pairs]
        for batch in length_batches(lengths, self.decode.batch_size, self.decode.batch_tokens):
            src, src_pad_mask = source_tensor([pairs[i][0] for i in batch])
            found = forced_log_probs(
                self.model, src.to(self.device), src_pad_mask.to(self.device), [pairs[i][1] for i in batch],
                self.target_lead,
            )  # fmt: skip
            for i, token_logprobs in zip(batch, found):
                results[i] = pair_score(token_logprobs, tokens)
        return [results[i] for i in range(len(pairs))]

    def _translate_chunk(
        self, lines: list[str], first_line: int, prefixes: list[str] | None
    ) -> list[list[Translation]]:
        results: list[list[Translation]] = [[EMPTY] for _ in lines]
        lead, room = list(self.target_lead), self.model.max_target_positions - len(self.target_lead)
        forced = self.tgt_tok.encode_capped(prefixes, room) if prefixes else None
        for i, prefix in enumerate(forced or []):
            if len(prefix) >= room:  # no position left for its eos
                raise PrefixMismatch(
                    f"line {first_line + i}: the prefix is longer than the model's outputs can be "
                    f"({room - 1} tokens, model.max_positions)"
                )
        ids = source_ids(
            self.src_tok, lines, self.model.max_source_positions, first_line, self.source_prefix, self.source_lead
        )
        todo = list(ids)
        if self.on_batch is not None and len(todo) < len(lines):
            self.on_batch(len(lines) - len(todo))
        d = self.decode
        rows = self.nbest if self.sampling is not None else d.beam
        for batch in length_batches([len(ids[i]) + 1 for i in todo], d.batch_size, d.batch_tokens, rows):
            chunk = [todo[b] for b in batch]
            src, src_pad_mask = source_tensor([ids[i] for i in chunk])
            src, src_pad_mask = src.to(self.device), src_pad_mask.to(self.device)
            batch_prefixes = [forced[i] for i in chunk] if forced is not None else None
            if lead:  # the target language's token starts every output
                batch_prefixes = [lead + p for p in batch_prefixes] if batch_prefixes else [lead] * len(chunk)
            if self.sampling is not None:  # nbest independent draws per line, each its own batch row
                n = self.nbest
                drawn = sample_search(
                    self.model, src.repeat_interleave(n, 0), src_pad_mask.repeat_interleave(n, 0), self.sampling, d,
                    [p for p in batch_prefixes for _ in range(n)] if batch_prefixes else None, self.generator,
                    lead=len(lead),
                )  # fmt: skip
                hyps = [sorted(drawn[i : i + n], key=lambda h: -h.score) for i in range(0, len(drawn), n)]
            else:
                candidates = self.shortlist.candidates(src, batch_prefixes) if self.shortlist is not None else None
                if d.beam == 1:  # greedy: what beam 1 finds, with less bookkeeping per step
                    found = sample_search(
                        self.model, src, src_pad_mask, None, d, batch_prefixes, candidates=candidates, lead=len(lead)
                    )
                    hyps = [[h] for h in found]
                else:
                    hyps = beam_search(
                        self.model, src, src_pad_mask, d, self.nbest, batch_prefixes, candidates, len(lead)
                    )
            if lead:  # the language's token is no part of the translation
                hyps = [[replace(h, tokens=h.tokens[len(lead) :]) for h in sentence] for sentence in hyps]
            alignments = [""] * len(chunk)
            if self.aligner is not None:
                pairs = [(ids[i], sentence[0].tokens) for i, sentence in zip(chunk, hyps)]
                leads = (self.source_lead, self.target_lead)
                alignments = align_batch(self.aligner, self.src_tok, self.tgt_tok, pairs, leads=leads)
            for i, sentence, alignment in zip(chunk, hyps, alignments):
                texts = self.tgt_tok.decode([h.tokens for h in sentence])
                results[i] = [Translation(t, h.score, h.logprob) for t, h in zip(texts, sentence)]
                results[i][0] = replace(results[i][0], alignment=alignment)
            if self.on_batch is not None:
                self.on_batch(len(chunk))
        return results


def aligner_of(model: Transformer | Ensemble) -> Transformer:
    """The model whose cross-attention gives word alignments: the model itself, or an ensemble's first member."""
    return model.members[0] if isinstance(model, Ensemble) else model


def chunked(lines: Iterable[str], size: int = CHUNK_LINES) -> Iterator[list[str]]:
    """Consecutive lists of up to ``size`` lines."""
    it = iter(lines)
    while chunk := list(islice(it, size)):
        yield chunk
