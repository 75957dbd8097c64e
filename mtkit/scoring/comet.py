"""COMET and CometKiwi scores of given translations, computed natively over transformers' XLM-R encoder.

The scores equal unbabel-comet's for the same checkpoint (Unbabel/wmt22-comet-da, Unbabel/wmt22-cometkiwi-da,
or any model of those two classes): the same tokenization and truncation, the same joint sequences, the same
layer mix, pooling and head (``comet_model``), read from the same files (``comet_files``). What differs is how
the work is done: segments are scored a chunk at a time, so that memory stays bounded however many there are;
within a chunk, sentences are batched by token length, and each distinct text (sources, references, and the
translations of every system) is encoded once, as each distinct pair of translation and source is for CometKiwi.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtkit import runtime, untrusted
from mtkit.errors import MtkitError
from mtkit.scoring import comet_files
from mtkit.scoring.comet_model import SEPARATOR_TOKENS, CometConfig, CometNetwork
from mtkit.scoring.comet_names import COMET_MODELS, COMET_NAME, COMETKIWI_NAME, MAX_BATCH_SIZE, PRECISIONS
from mtkit.version import __version__

PAIRS_PER_CHUNK = 4096  # rows of sentence features the head scores at once: 100 MB at width 1024
TEXTS_PER_CHUNK = 16384  # sentence embeddings held at once: 64 MB at width 1024


class CometInputError(MtkitError, ValueError):
    """Segments a COMET model cannot score as given: unequal lengths, references missing, nothing to score."""


@dataclass(frozen=True)
class CometResult:
    name: str  # "COMET" (reference-based) or "CometKiwi" (reference-free)
    system: float  # the mean of the segment scores
    segments: list[float]  # one per segment, in input order
    signature: str  # model, revision, a Hub encoder's revision, references, precision and mtkit's version

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Tokens:
    """How the encoder's tokenizer is used: ids with <s> and </s>, cut as unbabel-comet cuts them."""

    encode: Callable[[list[str]], list[list[int]]]
    cls_id: int
    sep_id: int
    pad_id: int
    max_positions: int  # the longest sequence the encoder takes: its position embeddings less two

    def joined(self, mt: list[int], src: list[int]) -> list[int]:
        """<s> mt </s></s> src </s>, cut to ``max_positions`` when the two are too long together."""
        inner_mt, inner_src = mt[1:-1], src[1:-1]
        sequence = [self.cls_id, *inner_mt, *[self.sep_id] * SEPARATOR_TOKENS, *inner_src, self.sep_id]
        if len(inner_mt) + len(inner_src) > self.max_positions - (1 + 2 * SEPARATOR_TOKENS):
            return sequence[: self.max_positions]
        return sequence


@dataclass(frozen=True)
class Origin:
    """What a score depends on besides the texts, as its signature says it."""

    model: str  # the Hub id, or a local folder's name
    revision: str  # the commit the Hub snapshot resolved to, or "local"
    encoder: str | None  # a Hub encoder's id@commit; None when the encoder is a folder of the model's own
    precision: str


class Comet:
    """A loaded COMET model: ``score`` systems' translations, or ``pairwise`` candidates against each other."""

    name: str  # "COMET" or "CometKiwi"
    needs_references: bool  # True for COMET, which compares each translation with its reference

    def __init__(
        self, network: CometNetwork, tokens: Tokens, device: torch.device, batch_size: int, origin: Origin
    ) -> None:
        self.network, self.tokens, self.device, self.batch_size = network, tokens, device, batch_size
        self.needs_references = network.config.kind == "regression"
        self.name = COMET_NAME if self.needs_references else COMETKIWI_NAME
        self.origin = origin

    @classmethod
    def load(
        cls,
        model: str,
        *,
        revision: str | None = None,
        encoder_revision: str | None = None,
        cache_dir: Path | None = None,
        device: str = "cpu",
        precision: str = "fp32",
        batch_size: int = 16,
        threads: int = 0,
    ) -> Comet:
        """model: a name of COMET_MODELS, a Hub id, or a local folder laid out as a Hub COMET repository
        (hparams.yaml, checkpoints/model.ckpt). encoder_revision: the commit, branch or tag of the encoder's
        config and tokenizer when hparams.yaml names a Hub encoder (None: its main branch). precision: fp32, bf16,
        int8 or auto (as mtkit translate's)."""
        if precision not in PRECISIONS:
            raise CometInputError(f"precision must be one of {', '.join(PRECISIONS)}, got {untrusted.shown(precision)}")
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise CometInputError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}, got {batch_size}")
        runtime.require("transformers", "COMET", "transformers (mtkit's [hf] extra)")
        runtime.set_threads(threads)
        target = runtime.pick_device(device)
        choice = runtime.resolve_precision(precision, target)
        source = comet_files.locate(COMET_MODELS.get(model, model), revision, cache_dir)
        network, tokens, encoder = _read_model(source, encoder_revision)
        network.to(target)
        if choice.precision == "bf16":
            network.encoder.to(torch.bfloat16)
        elif choice.precision == "int8":
            from mtkit.model.quantization import quantize_int8

            quantize_int8(network.encoder.model.encoder)
        return cls(
            network, tokens, target, batch_size, Origin(source.model_id, source.revision, encoder, choice.precision)
        )

    def score(
        self, sources: list[str], systems: list[list[str]], references: list[list[str]] | None = None
    ) -> list[CometResult]:
        """One result per system. references: one list per reference set (sacreBLEU's layout), each aligned with
        sources; with several, a segment's score is the mean over the references. Segments are scored a chunk at a
        time (TEXTS_PER_CHUNK embeddings at most); within one, the embeddings of sources and references are computed
        once for all systems. CometKiwi reads no references: its signature says refs:0."""
        _check_segments(sources, systems, references)
        references = references or []
        if self.needs_references and not references:
            raise CometInputError(f"{self.name} compares each translation with a reference: give references")
        if not self.needs_references:
            references = []
        per_system: list[list[float]] = [[] for _ in systems]
        step = max(1, TEXTS_PER_CHUNK // (1 + len(references) + len(systems)))
        with torch.inference_mode():
            for start in range(0, len(sources), step):
                part = slice(start, start + step)
                chunk_systems = [hypotheses[part] for hypotheses in systems]
                if self.needs_references:
                    chunk = self._compared(sources[part], chunk_systems, [refs[part] for refs in references])
                else:
                    chunk = self._joint(sources[part], chunk_systems)
                for scores, chunk_scores in zip(per_system, chunk, strict=True):
                    scores.extend(chunk_scores)
        signature = self.signature(len(references))
        return [CometResult(self.name, sum(scores) / len(scores), scores, signature) for scores in per_system]

    def signature(self, references: int) -> str:
        """What a score depends on: the model and its revision, a Hub encoder's revision (its tokenizer's), the
        number of reference sets, the precision."""
        origin = self.origin
        encoder = "" if origin.encoder is None else f"encoder:{origin.encoder}|"
        return (
            f"model:{origin.model}|revision:{origin.revision}|{encoder}refs:{references}|precision:{origin.precision}"
            f"|mtkit:{__version__}"
        )

    def pairwise(self, sources: list[str], candidates: list[list[str]]) -> list[Tensor]:
        """For each line, an N x N matrix (N: its number of candidates): [i, j] = the score of candidates[i] with
        candidates[j] as its reference (reference-based models only). Lines are taken together, as many as
        TEXTS_PER_CHUNK embeddings allow: their distinct texts are encoded once, in batches of similar length."""
        if not self.needs_references:
            raise CometInputError(f"{self.name} scores without references: pairwise scores need a COMET model")
        _check_texts(sources, "sources")
        if not isinstance(candidates, list) or len(candidates) != len(sources):
            raise CometInputError(f"candidates must be a list of one list of candidates per source ({len(sources)})")
        for line in candidates:
            _check_texts(line, "each line's candidates")
        matrices: list[Tensor] = []
        start = 0
        with torch.inference_mode():
            while start < len(sources):
                end, texts = start + 1, 1 + len(candidates[start])
                while end < len(sources) and texts + 1 + len(candidates[end]) <= TEXTS_PER_CHUNK:
                    texts += 1 + len(candidates[end])
                    end += 1
                matrices += self._pairwise_lines(sources[start:end], candidates[start:end])
                start = end
        return matrices

    def _pairwise_lines(self, sources: list[str], candidates: list[list[str]]) -> list[Tensor]:
        embeddings, index = self._embeddings([*sources, *chain.from_iterable(candidates)])
        mt, ref, src = [], [], []
        for source, line in zip(sources, candidates, strict=True):
            rows = torch.tensor([index[text] for text in line], dtype=torch.long)
            mt.append(rows.repeat_interleave(len(line)))
            ref.append(rows.repeat(len(line)))
            src.append(torch.full((len(line) ** 2,), index[source], dtype=torch.long))
        scores = self._head(embeddings, *(torch.cat(rows) for rows in (mt, ref, src))).float().cpu()
        blocks = scores.split([len(line) ** 2 for line in candidates])
        return [block.view(len(line), len(line)) for block, line in zip(blocks, candidates, strict=True)]

    # -- COMET: sentence embeddings compared ------------------------------------------------------

    def _compared(self, sources: list[str], systems: list[list[str]], references: list[list[str]]) -> list[list[float]]:
        embeddings, index = self._embeddings(
            [*sources, *chain.from_iterable(references), *chain.from_iterable(systems)]
        )

        def rows(texts: list[str]) -> Tensor:
            return torch.tensor([index[text] for text in texts], dtype=torch.long)

        src, refs = rows(sources), [rows(ref_set) for ref_set in references]
        results = []
        for hypotheses in systems:
            mt = rows(hypotheses)
            scores = torch.stack([self._head(embeddings, mt, ref, src) for ref in refs]).mean(0)
            results.append(scores.cpu().tolist())
        return results

    def _head(self, embeddings: Tensor, mt: Tensor, ref: Tensor, src: Tensor) -> Tensor:
        """``network.compared`` of the (N, H) ``embeddings``' rows ``mt``, ``ref`` and ``src`` (index tensors of one
        length), a bounded number of rows at a time."""
        if mt.numel() == 0:
            return embeddings.new_empty(0)
        indexes = [x.to(embeddings.device) for x in (mt, ref, src)]
        return torch.cat(
            [
                self.network.compared(*(embeddings[x[i : i + PAIRS_PER_CHUNK]] for x in indexes))
                for i in range(0, mt.numel(), PAIRS_PER_CHUNK)
            ]
        )

    def _embeddings(self, texts: Sequence[str]) -> tuple[Tensor, dict[str, int]]:
        """The sentence embedding of each distinct text (N, H), and each text's row."""
        distinct = list(dict.fromkeys(texts))
        ids = self.tokens.encode(distinct)
        embeddings = self._batched(ids, self.network.sentence_embeddings)
        return embeddings, {text: row for row, text in enumerate(distinct)}

    # -- CometKiwi: translation and source encoded together ----------------------------------------

    def _joint(self, sources: list[str], systems: list[list[str]]) -> list[list[float]]:
        pairs = list(dict.fromkeys((mt, src) for hypotheses in systems for mt, src in zip(hypotheses, sources)))
        distinct = list(dict.fromkeys([*sources, *(mt for mt, _ in pairs)]))
        ids = dict(zip(distinct, self.tokens.encode(distinct), strict=True))
        scores = self._batched([self.tokens.joined(ids[mt], ids[src]) for mt, src in pairs], self.network.joint_scores)
        by_pair = dict(zip(pairs, scores.float().cpu().tolist(), strict=True))
        return [[by_pair[(mt, src)] for mt, src in zip(hypotheses, sources)] for hypotheses in systems]

    # -- batches --------------------------------------------------------------------------------

    def _batched(self, sequences: list[list[int]], forward: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``forward`` over ``sequences`` in batches of similar length (little padding), rows in input order."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        outputs: list[Tensor] = []
        for start in range(0, len(order), self.batch_size):
            batch = [sequences[i] for i in order[start : start + self.batch_size]]
            width = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), width), self.tokens.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, sequence in enumerate(batch):
                ids[row, : len(sequence)] = torch.tensor(sequence)
                mask[row, : len(sequence)] = 1
            outputs.append(forward(ids.to(self.device), mask.to(self.device)))
        merged = torch.cat(outputs)
        restored = torch.empty_like(merged)
        restored[torch.tensor(order, device=merged.device)] = merged
        return restored


def _check_texts(texts: object, what: str) -> None:
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise CometInputError(f"{what} must be a list of strings")


def _check_segments(sources: list[str], systems: list[list[str]], references: list[list[str]] | None) -> None:
    """Lists of strings, every system and reference set as long as the sources, and something to score."""
    _check_texts(sources, "sources")
    if not isinstance(systems, list) or not systems:
        raise CometInputError("systems must be a list of one or more lists of translations")
    named = [(f"system {i + 1}", hyps) for i, hyps in enumerate(systems)]
    named += [(f"reference set {i + 1}", refs) for i, refs in enumerate(references or [])]
    for what, texts in named:
        _check_texts(texts, what)
        if len(texts) != len(sources):
            raise CometInputError(f"{what} has {len(texts)} segments, and there are {len(sources)} sources")
    if not sources:
        raise CometInputError("nothing to score: no segments")


def _read_model(
    source: comet_files.ModelSource, encoder_revision: str | None
) -> tuple[CometNetwork, Tokens, str | None]:
    """The network with the checkpoint's weights (float32, on the CPU, in evaluation mode, cut to the layers its
    score depends on), the encoder's tokenizer, and a Hub encoder's id@commit (None for a folder of the model's)."""
    import transformers

    hparams_path = comet_files.model_file(source, comet_files.HPARAMS, limit=comet_files.MAX_HPARAMS_BYTES)
    hparams = comet_files.read_hparams(hparams_path)
    config, pretrained = comet_files.comet_config(hparams, None, hparams_path)
    folder, encoder_source = comet_files.encoder_folder(source, pretrained, encoder_revision)
    config_path = comet_files.model_file(
        encoder_source, comet_files.ENCODER_CONFIG, folder, comet_files.MAX_CONFIG_BYTES
    )
    encoder_config = transformers.XLMRobertaConfig(**comet_files.encoder_config(config_path))
    comet_files.check_layer(config, encoder_config.num_hidden_layers, hparams_path)
    tokenizer = _tokenizer(folder, comet_files.tokenizer_files(encoder_source, folder))
    if len(tokenizer) > encoder_config.vocab_size:
        raise comet_files.CometFileError(
            f"{folder}: the tokenizer has {len(tokenizer):,} tokens, more than the {encoder_config.vocab_size:,} of "
            "the encoder's vocabulary (vocab_size in its config.json)"
        )
    with torch.device("meta"):
        expected = _network(encoder_config, config).state_dict()
    checkpoint = comet_files.model_file(source, comet_files.CHECKPOINT)
    state, hyper_parameters = comet_files.read_checkpoint(checkpoint, expected)
    if hyper_parameters is not None and comet_files.comet_config(hparams, hyper_parameters, checkpoint)[0] != config:
        raise comet_files.CometFileError(
            f"{checkpoint}: its hyper_parameters describe another network than {hparams_path} does"
        )
    with _no_init_weights():
        network = _network(encoder_config, config)
    network.load_state_dict(state, assign=True)
    network.eval()
    network.encoder.keep_layers(network.layers_used())
    max_positions = encoder_config.max_position_embeddings - 2

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, truncation=True, max_length=max_positions - 2)["input_ids"]

    ids = (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id)
    if any(not isinstance(i, int) or not 0 <= i < encoder_config.vocab_size for i in ids):
        raise comet_files.CometFileError(f"{folder}: the tokenizer has no <s>, </s> or <pad> within the vocabulary")
    network.pad_id = tokenizer.pad_token_id  # what unbabel-comet's pooling counts as padding
    hub_encoder = None if encoder_source is source else f"{encoder_source.model_id}@{encoder_source.revision}"
    return network, Tokens(encode, *ids, max_positions), hub_encoder


def _tokenizer(folder: Path, files: list[Path]) -> Any:
    """XLM-R's tokenizer from the checked ``files`` alone, copied into a folder of their own: no other file of the
    encoder's folder (tokenizer_config.json, added_tokens.json, a chat template) is read, nor any path such a file
    would name."""
    import transformers

    with tempfile.TemporaryDirectory(prefix="mtkit-comet-tokenizer-") as private:
        for path in files:
            shutil.copyfile(path, Path(private) / path.name)
        try:
            return transformers.XLMRobertaTokenizerFast.from_pretrained(private, local_files_only=True)
        except Exception as err:  # tokenizers and sentencepiece raise several types for malformed files
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            message = f"{folder}: not a readable XLM-R tokenizer ({type(err).__name__}: {first})"
            raise comet_files.CometFileError(message) from None


def _network(encoder_config: Any, config: CometConfig) -> CometNetwork:
    from transformers import XLMRobertaModel

    encoder = XLMRobertaModel(encoder_config, add_pooling_layer=False)
    return CometNetwork(encoder, encoder_config.num_hidden_layers, config, encoder_config.pad_token_id)


def _no_init_weights() -> AbstractContextManager:
    """transformers' context that builds a model without drawing its initial weights (the checkpoint's replace
    them): seconds saved for XLM-R large."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()
