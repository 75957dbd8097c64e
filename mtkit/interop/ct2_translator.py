"""Translation with a CTranslate2 export (``mtkit export``): its tokenizers and decoding settings with it,
and mtkit's search rules kept wherever CTranslate2's options can express them.

Sources are encoded by ``mtkit.decoding.line_translator.source_ids``, the front end every engine shares, so a
line is cut and tokenized here exactly as mtkit's own engine does it. Given translations are scored through
CTranslate2's ``score_batch``, their pairs encoded as mtkit's engine encodes them (``pair_ids``).

A model told its languages by tokens (an imported NLLB-200 or M2M100) gets the source language's token before
each source, and the target language's as CTranslate2's ``target_prefix``, which it leaves out of the translation
and of its score, as mtkit's search counts that token certain; ``score_batch`` scores it, and its log-probability
is left out there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mtkit.config import ConfigError, DecodeConfig, InferenceConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from mtkit.decoding.line_translator import (
    EMPTY,
    LineTranslator,
    PairScore,
    Translation,
    check_nbest,
    length_batches,
    pair_ids,
    pair_score,
    source_ids,
    with_overrides,
)
from mtkit.decoding.search import max_length, normalised
from mtkit.interop.ct2_export import VMAP, import_ctranslate2, read_manifest
from mtkit.model.checkpoint import CheckpointError

MODEL_FILE = "model.bin"  # CTranslate2's weights file in a model folder


# What CTranslate2's loading errors say when its weights file is the cause: cut short, unreadable, of another
# binary version. The other causes (config.json, the vocabularies, the device) name themselves.
_WEIGHTS_ERRORS = (MODEL_FILE, "Variable '", "binary version")


def _load_engine(ct2_dir: Path, device: str, compute_type: str, threads: int = InferenceConfig.threads) -> Any:
    """``ctranslate2.Translator`` over the export on ``threads`` CPU threads (0: CTranslate2's default), its failure
    one line naming the file at fault where it can."""
    try:
        ct2 = import_ctranslate2()
        return ct2.Translator(str(ct2_dir), device=device, compute_type=compute_type, intra_threads=threads)
    except (RuntimeError, ValueError) as err:  # the C++ library's exceptions, as its bindings raise them
        reason = " ".join(str(err).split())
        where = ct2_dir / MODEL_FILE if any(mark in reason for mark in _WEIGHTS_ERRORS) else ct2_dir
        raise CheckpointError(f"{where}: CTranslate2 cannot load it on {device} ({reason})") from None


class CTranslate2Translator(LineTranslator):
    """An exported model, its tokenizers and decoding settings, with ``Translator``'s interface.

    Decoding follows mtkit's search: eos is appended to the source, decoding starts from bos, pad and
    bos are never generated, each sentence stops at max_len_a * source length + max_len_b tokens
    (eos included) and ``min_len`` holds eos back. Greedy output is mtkit's up to float rounding.
    CTranslate2 takes one cap per call: a batch is searched under its largest, and a sentence whose
    search came within a token of its own cap is searched again under it, with the others of that cap.

    For beams, CTranslate2 returns its ``beam`` finished hypotheses, which are then ranked by mtkit's
    length penalty (decode.length_penalty). Its own penalty, length ** lenpen, also decides which
    hypotheses to keep when more than ``beam`` finish: it is used for mtkit's ``power``, which it is,
    and left out for ``gnmt``, where it would drop the short ones mtkit keeps (the search then runs on
    log-probabilities). With ``power`` the search finds what mtkit's finds with decode.early_stop
    false. Where results still differ:

    - at the cap, CTranslate2 ends the ``beam`` best candidates as they are, where mtkit extends
      the best that do not end with eos; the beams may then differ.
    - log-probabilities are higher by the probability pad and bos had, as CTranslate2 renormalises
      after banning them (next to nothing in a trained model). Hypotheses the cap cut are rescored,
      to count the eos mtkit forces there.
    - a cap of 0 tokens (max_len_a * length + max_len_b < 2) gives an empty translation scored 0.

    Translating runs no torch op: torch's OpenMP threads spin for a while after each one, and beside
    CTranslate2's threads on the same cores that slows CTranslate2 down sharply.
    """

    def __init__(
        self,
        ct2_dir: Path,
        src_tok: Tokenizer,
        tgt_tok: Tokenizer,
        decode: DecodeConfig,
        device: str = "cpu",
        compute_type: str = "default",
        nbest: int = 1,
        use_vmap: bool = False,
        threads: int = InferenceConfig.threads,
    ) -> None:
        check_nbest(nbest, decode)
        self.max_positions = read_manifest(ct2_dir)["max_positions"]
        if use_vmap and not (Path(ct2_dir) / VMAP).is_file():
            raise ConfigError(f"{ct2_dir}: the export has no vocabulary map; export it with --shortlist")
        self.use_vmap = use_vmap
        self.engine = _load_engine(Path(ct2_dir), device, compute_type, threads)
        self.src_tok, self.tgt_tok = src_tok, tgt_tok
        self.decode, self.nbest = decode, nbest
        self.eos = tgt_tok.sp.id_to_piece(EOS_ID)
        self.banned = [[tgt_tok.sp.id_to_piece(PAD_ID)], [tgt_tok.sp.id_to_piece(BOS_ID)]]

    @classmethod
    def from_dir(
        cls,
        ct2_dir: Path,
        decode: DecodeConfig | dict[str, Any] | None = None,
        device: str = "cpu",
        compute_type: str = "default",
        nbest: int = 1,
        use_vmap: bool = False,
        threads: int = InferenceConfig.threads,
    ) -> CTranslate2Translator:
        """The export in ``ct2_dir`` with its own tokenizers. ``decode``: whole settings (a DecodeConfig), or
        changes (a dict) to the run's, which None keeps; ``use_vmap``: search over the export's vocabulary map;
        ``threads``: CTranslate2's intra_threads (0: its default)."""
        manifest = read_manifest(ct2_dir)
        toks = {side: Tokenizer(Path(ct2_dir) / name) for side, name in manifest["tokenizer"].items()}
        settings = decode if isinstance(decode, DecodeConfig) else with_overrides(manifest["decode"], decode or {})
        translator = cls(
            Path(ct2_dir), toks["src"], toks["tgt"], settings, device, compute_type, nbest, use_vmap, threads
        )
        translator.data = manifest.get("data")
        return translator

    def stream(self, chunks: Iterable[list[str]]) -> Iterator[list[Translation]]:
        """The ``nbest`` translations of each line, best first, in input order, chunk by chunk."""
        self.check_target()
        first_line = 1
        for chunk in chunks:
            yield from self._translate_chunk(chunk, first_line)
            first_line += len(chunk)

    def score_chunk(self, sources: list[str], targets: list[str], first_line: int, tokens: bool) -> list[PairScore]:
        """The scores of one chunk of pairs through CTranslate2's ``score_batch``, in the batches mtkit's engine
        scores them in; the pairs are encoded and truncated as there, so CTranslate2 truncates nothing."""
        limits = (self.max_positions, self.max_positions)
        leads = (self.source_lead, self.target_lead)
        pairs = pair_ids(self.src_tok, self.tgt_tok, sources, targets, limits, first_line, self.source_prefix, leads)
        results: dict[int, PairScore] = {}
        lengths = [max(len(src), len(tgt)) + 1 for src, tgt in pairs]
        lead = len(self.target_lead)
        for batch in length_batches(lengths, self.decode.batch_size, self.decode.batch_tokens):
            scored = self.engine.score_batch(
                [self.src_tok.sp.id_to_piece(pairs[i][0]) for i in batch],
                [self.tgt_tok.sp.id_to_piece([*self.target_lead, *pairs[i][1]]) for i in batch],
                max_input_length=0,
            )
            for i, result in zip(batch, scored):  # the target's tokens and the eos scoring appends, after the lead
                results[i] = pair_score(result.log_probs[lead:], tokens)
        return [results[i] for i in range(len(pairs))]

    def _translate_chunk(self, lines: list[str], first_line: int) -> list[list[Translation]]:
        results: list[list[Translation]] = [[EMPTY] for _ in lines]
        ids = source_ids(self.src_tok, lines, self.max_positions, first_line, self.source_prefix, self.source_lead)
        todo = list(ids)
        if not todo:
            return results
        d = self.decode
        least = len(self.target_lead) + 1  # the lead and eos, as mtkit's search caps a forced prefix
        caps = {i: max(max_length(len(ids[i]), d.max_len_a, d.max_len_b, self.max_positions), least) - 1 for i in todo}
        for i in todo:
            if caps[i] == 0:  # not even one token before eos
                results[i] = [Translation("", 0.0, 0.0)]
        todo = [i for i in todo if caps[i] > 0]
        # Every sentence first under the largest cap of its batch, in batches as CTranslate2's own users
        # make them; then, under its own cap, each whose search came near it (``_near_cap``).
        again: dict[int, list[int]] = {}
        for batch, cap in self._batches(todo, ids, caps):
            for i, hyps in zip(batch, self._search([ids[i] for i in batch], cap)):
                if self._near_cap(hyps, caps[i]) or min(d.min_len, caps[i]) != min(d.min_len, cap):
                    again.setdefault(caps[i], []).append(i)
                else:
                    results[i] = self._translations(hyps)
        for cap, group in again.items():
            for batch, _ in self._batches(group, ids, caps):
                for i, hyps in zip(batch, self._search([ids[i] for i in batch], cap)):
                    results[i] = self._translations(hyps)
        return results

    def _batches(
        self, todo: list[int], ids: dict[int, list[int]], caps: dict[int, int]
    ) -> Iterator[tuple[list[int], int]]:
        """``todo`` cut into length-sorted batches as ``translate`` cuts them, each with its sentences' largest cap."""
        d = self.decode
        for batch in length_batches([len(ids[i]) + 1 for i in todo], d.batch_size, d.batch_tokens, d.beam):
            chosen = [todo[b] for b in batch]
            yield chosen, max(caps[i] for i in chosen)

    def _near_cap(self, hyps: list[tuple[list[str], float]], cap: int) -> bool:
        """Whether a sentence's search, run under a larger cap than its own ``cap``, may have gone where its own
        would have stopped it: a hypothesis within a token of ``cap``. Before that step the two searches are
        the same, and one that finished earlier gives the same hypotheses under either."""
        return any(len(tokens) - (tokens[-1] == self.eos) >= cap - 1 for tokens, _ in hyps)

    def _search(self, seqs: list[list[int]], cap: int) -> list[list[tuple[list[str], float]]]:
        """The ``beam`` finished hypotheses (tokens, logprob) of each of ``seqs``, whose outputs may have up to
        ``cap`` tokens before eos (the target language's token, which each starts with, counted); those the cap cut
        are scored with the eos mtkit forces there."""
        d = self.decode
        power = d.lenpen if d.length_penalty == "power" else 0.0  # CTranslate2's own penalty (see the class)
        source = [self.src_tok.sp.id_to_piece(seq) for seq in seqs]
        prefix = [self.tgt_tok.sp.id_to_piece(list(self.target_lead))] * len(seqs) if self.target_lead else None
        results = self.engine.translate_batch(
            source,
            prefix,
            beam_size=d.beam,
            num_hypotheses=d.beam,  # every finished hypothesis kept, for mtkit's ranking
            length_penalty=power,
            max_decoding_length=cap,
            min_decoding_length=min(d.min_len, cap),
            suppress_sequences=self.banned,
            return_end_token=True,  # tells a hypothesis that ended from one the cap cut
            return_scores=True,
            max_input_length=0,  # already truncated, by mtkit's rule
            use_vmap=self.use_vmap,
        )
        hyps = [  # a score is the log-probability over length ** power (the lead and the end token counted)
            [(tokens, score * len(tokens) ** power) for tokens, score in zip(result.hypotheses, result.scores)]
            for result in results
        ]
        self._add_forced_eos(source, hyps)
        return hyps

    def _add_forced_eos(self, source: list[list[str]], hyps: list[list[tuple[list[str], float]]]) -> None:
        """Rescore, in place, hypotheses the length cap cut: mtkit ends them with eos and counts its log-probability."""
        cut = [
            (s, k)
            for s, sentence in enumerate(hyps)
            for k, (tokens, _) in enumerate(sentence)
            if tokens[-1] != self.eos
        ]
        if not cut:
            return
        scored = self.engine.score_batch(
            [source[s] for s, _ in cut], [hyps[s][k][0] for s, k in cut], max_input_length=0
        )
        lead = len(self.target_lead)
        for (s, k), result in zip(cut, scored):  # the target's tokens and the eos scoring appends, after the lead
            hyps[s][k] = (hyps[s][k][0], sum(result.log_probs[lead:]))

    def _translations(self, hyps: list[tuple[list[str], float]]) -> list[Translation]:
        """The ``nbest`` best of one sentence's (tokens, logprob) hypotheses, ranked as mtkit's beam ranks them (the
        lead counted in their length, as there, and left out of their text)."""
        ids = [self.tgt_tok.sp.piece_to_id(tokens[:-1] if tokens[-1] == self.eos else tokens) for tokens, _ in hyps]
        texts = self.tgt_tok.decode([seq[len(self.target_lead) :] for seq in ids])
        translations = [
            Translation(text, normalised(logprob, len(seq), self.decode), logprob)
            for text, seq, (_, logprob) in zip(texts, ids, hyps)
        ]
        return sorted(translations, key=lambda t: -t.score)[: self.nbest]
