"""The models one server serves (`mtkit serve --model NAME=PATH ...`, or a models file): each known by a card read
without its weights, loaded at its first request and, beyond ``max_loaded`` models in memory, the least recently
used idle one evicted to make room.

Requests are checked and routed against the cards: by the model a request names, else by its languages (the first
model, in the operator's order, that translates them). Loading and evicting happen in the one thread that runs the
searches (``admit`` and ``translators``, which the batcher calls there), so a model is never loaded while it is
searched, and a model whose searches are running is never evicted: a request for a model that has no room waits
while the least recently used busy model takes no new requests, until its searches end and it makes room. A model
that fails to load fails the requests that come for it within ``RETRY_LOAD_S`` without being loaded again (nor
evicting another model for it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtkit.config import ConfigError, DataConfig, DecodeConfig
from mtkit.data.directions import default_languages, directions
from mtkit.data.tokenizer import Tokenizer
from mtkit.decoding.line_translator import LineTranslator, Translator
from mtkit.interop.ct2_export import read_manifest
from mtkit.model.checkpoint import read_meta, weights_file
from mtkit.model.loading import adapter_path, resolve
from mtkit.serving.adapters import ADAPTER_NAME, ServedAdapter
from mtkit.serving.requests import echoed
from mtkit.serving.searches import Translators, batching

log = logging.getLogger("mtkit")

MODEL_NAME = ADAPTER_NAME  # what a request's model field names: letters, digits, '.', '_' and '-'
RETRY_LOAD_S = 10.0  # after a model failed to load, its requests fail this long before it is tried again


class LoadFailed(RuntimeError):
    """A model that failed to load a moment ago, not tried again yet."""


@dataclass(frozen=True)
class ModelSpec:
    """A model as the operator names it: the name requests call it by, its path, and its LoRA adapters by name."""

    name: str
    path: Path
    adapters: dict[str, Path] = field(default_factory=dict)


@dataclass
class Loaded:
    """A model in memory: its translators (the model's, None, and each adapter's) and what /v1/models says of it."""

    translators: Translators
    adapters: list[dict[str, Any]]
    batching: str

    @property
    def translator(self) -> LineTranslator:
        return self.translators[None]


@dataclass
class ModelCard:
    """What requests for one model are checked and routed against, read without its weights: its languages, decode
    settings and adapters' names; its tokenizers once it has been loaded (kept when it is evicted: they count the
    tokens of its answers). Each load renews it from the model loaded."""

    name: str
    data: DataConfig | None  # None for an export that records no directions
    decode: DecodeConfig
    aligns: bool  # whether its engine gives word alignments
    adapters: list[str]
    tokenizers: tuple[Tokenizer, Tokenizer] | None = None

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) directions it translates; one pair, empty where unknown, for an export of no known
        directions; for a model told its languages by tokens (``between``), its default direction where it has
        one."""
        if self.data is None:
            return [("", "")]
        if self.data.languages:
            src, tgt = self.defaults
            return [(src, tgt)] if src and tgt else []
        return directions(self.data)

    @property
    def between(self) -> tuple[str, ...]:
        """The languages of a model told its languages by tokens (an imported NLLB-200 or M2M100), any two of which
        it translates between; none for others."""
        return self.data.languages if self.data is not None else ()

    @property
    def defaults(self) -> tuple[str | None, str | None]:
        """The source and target languages a model told its languages by tokens translates when a request names
        none; (None, None) for others."""
        return default_languages(self.data) if self.data is not None and self.data.languages else (None, None)

    def translates(self, src_lang: str | None, tgt_lang: str | None) -> bool:
        """Whether it translates ``src_lang`` (None: any, or its default) into ``tgt_lang``."""
        if self.between:
            source = src_lang or self.defaults[0]
            return tgt_lang in self.between and source in self.between and source != tgt_lang
        return any(tgt == tgt_lang and src_lang in (None, src) for src, tgt in self.pairs if tgt)

    @functools.cached_property
    def context(self) -> dict[str, Any]:
        """What checking a request for it needs to know (mtkit.serving.requests)."""
        return {
            "targets": list(dict.fromkeys(tgt for _, tgt in self.pairs if tgt)),
            "directions": self.pairs,
            "languages": frozenset(self.between),
            "defaults": self.defaults,
            "adapters": self.adapters,
            "beam": self.decode.beam,
            "aligns": self.aligns,
        }


def tokenizers_of(translator: LineTranslator) -> tuple[Tokenizer, Tokenizer] | None:
    """The source and target tokenizers of ``translator``; None for one that has none (one a test scripts)."""
    if isinstance(getattr(translator, "src_tok", None), Tokenizer):
        return translator.src_tok, translator.tgt_tok
    return None


def card_of(card: ModelCard, translator: LineTranslator) -> ModelCard:
    """``card`` as the model just loaded is: its languages, decode settings and tokenizers, which a run whose best
    checkpoint changed since the card was read may have changed too."""
    data, decode = getattr(translator, "data", card.data), getattr(translator, "decode", card.decode)
    tokenizers = tokenizers_of(translator) or card.tokenizers
    return dataclasses.replace(card, data=data, decode=decode, tokenizers=tokenizers)


def read_card(spec: ModelSpec, engine: str) -> ModelCard:
    """``spec``'s card from its checkpoint's header (or its CTranslate2 export's manifest), weights unread; its
    adapters' files found (they are read, and checked against the model, when it loads)."""
    if engine == "ctranslate2":
        manifest = read_manifest(spec.path)
        data, decode = manifest.get("data"), manifest["decode"]
    else:
        _, cfg = read_meta(weights_file(resolve(spec.path)))
        data, decode = cfg.data, cfg.decode
    for path in spec.adapters.values():
        adapter_path(path)
    return ModelCard(spec.name, data, decode, engine == "mtkit", list(spec.adapters))


class ModelPool:
    """The served models: their cards, and those in memory, least recently used first.

    ``load(spec)`` loads one; ``max_loaded`` bounds how many are in memory at once (0: no bound);
    ``on_load(name, seconds)`` and ``on_evict(name)`` are told of each load and eviction.
    """

    def __init__(
        self,
        specs: list[ModelSpec],
        cards: list[ModelCard],
        load: Callable[[ModelSpec], Loaded],
        max_loaded: int = 0,
    ) -> None:
        if max_loaded < 0:
            raise ConfigError(f"max_loaded must be >= 0 (0: no bound), got {max_loaded}")
        self.specs = {spec.name: spec for spec in specs}
        self.cards = {card.name: card for card in cards}
        self.load = load
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, Loaded] = OrderedDict()
        self.failed: dict[str, tuple[float, str]] = {}  # a model that failed to load: when, and why
        self.on_load: Callable[[str, float], None] = lambda name, seconds: None
        self.on_evict: Callable[[str], None] = lambda name: None

    def choose(self, model: str | None, src_lang: str | None, tgt_lang: str | None) -> str:
        """The served model's name for a request: ``model`` when given; else the only one, or the first that
        translates ``src_lang`` into ``tgt_lang``. ValueError saying what is wrong otherwise."""
        if model is not None:
            if model not in self.cards:
                raise ValueError(f"this server has no model {echoed(model)}; it serves {self._names()}")
            return model
        if len(self.cards) == 1:
            return next(iter(self.cards))
        if tgt_lang is None:
            raise ValueError(
                f"this server serves {len(self.cards)} models ({self._names()}): say which with model, or give "
                "tgt_lang (and src_lang)"
            )
        for card in self.cards.values():
            if card.translates(src_lang, tgt_lang):
                return card.name
        source = f"{echoed(src_lang)} " if src_lang is not None else ""
        raise ValueError(
            f"no model of this server translates {source}into {echoed(tgt_lang)}; /v1/models lists each one's "
            "directions"
        )

    def directions(self) -> list[tuple[str, str]]:
        """Every (source, target) pair some served model translates, each once, in the models' order: a model told
        its languages by tokens translates any of its languages into any other."""
        pairs: dict[tuple[str, str], None] = {}
        for card in self.cards.values():
            if card.between:
                pairs |= {(src, tgt): None for src in card.between for tgt in card.between if src != tgt}
            else:
                pairs |= {(src, tgt): None for src, tgt in card.pairs if src and tgt}
        return list(pairs)

    def _names(self) -> str:
        names = list(self.cards)
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    def admit(self, wanted: list[Hashable], busy: set[Hashable]) -> set[Hashable]:
        """The models among ``wanted`` (in the order of their oldest request) whose requests may start now, given
        those whose searches are running (``busy``); in the searches' thread. A model in memory may; one that is
        not may when there is room, or when an idle model (least recently used first) can be evicted to make it;
        else it waits, and the least recently used model that is busy takes no new requests until its searches
        end, when it makes room."""
        admitted: set[Hashable] = set()
        held_back: set[Hashable] = set()  # models in memory that take no new requests, to make room
        room = self.max_loaded - len(self.loaded) if self.max_loaded else len(wanted)
        for name in wanted:
            if self._failed_lately(name):  # its requests fail at once, and need no room
                admitted.add(name)
                continue
            if name in self.loaded:
                if name not in held_back:
                    admitted.add(name)
                    self.loaded.move_to_end(name)
                continue
            if room > 0:
                room -= 1
                admitted.add(name)
                continue
            idle = [held for held in self.loaded if held not in busy and held not in admitted]
            if idle:
                self._evict(idle[0])
                admitted.add(name)
                continue
            # Every model in memory is busy, or was admitted just now (it starts, and is busy next time): the least
            # recently used busy one takes no new requests until its searches end.
            victim = next((held for held in self.loaded if held in busy and held not in held_back), None)
            if victim is not None:
                held_back.add(victim)
                admitted.discard(victim)
        return admitted

    def _failed_lately(self, name: Hashable) -> bool:
        failed = self.failed.get(name)
        return failed is not None and time.monotonic() - failed[0] < RETRY_LOAD_S

    def translators(self, name: str) -> Translators:
        """The translators of model ``name``, loaded first if it is not in memory; it becomes the most recently
        used. In the searches' thread."""
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name].translators
        if self._failed_lately(name):
            raise LoadFailed(f"model {name} failed to load {time.monotonic() - self.failed[name][0]:.0f} s ago: "
                             f"{self.failed[name][1]}")  # fmt: skip
        if self.max_loaded and len(self.loaded) >= self.max_loaded:
            raise RuntimeError(f"no room for model {name}: requests reach the pool's models through its admit")
        start = time.perf_counter()
        try:
            loaded = self.load(self.specs[name])
        except Exception as err:
            self.failed[name] = (time.monotonic(), str(err)[:500])
            raise
        seconds = time.perf_counter() - start
        self.failed.pop(name, None)
        self.loaded[name] = loaded
        translator = loaded.translator
        self.cards[name] = card_of(self.cards[name], translator)
        precision = getattr(translator, "precision", None) or {}
        log.info(
            "model %s loaded in %.1f s (%d in memory): %s (%s), %s", name, seconds, len(self.loaded),
            precision.get("precision"), precision.get("reason"), loaded.batching,
        )  # fmt: skip
        self.on_load(name, seconds)
        return loaded.translators

    def _evict(self, name: str) -> None:
        del self.loaded[name]
        log.info("model %s evicted, the least recently used (%d in memory)", name, len(self.loaded))
        self.on_evict(name)


def loader(continuous: bool, **load: Any) -> Callable[[ModelSpec], Loaded]:
    """What loads a served model: `mtkit.load` with ``load``'s options (device, precision, engine, threads), its
    adapters over it; searched continuously where it can be and ``continuous`` allows."""
    from mtkit.serving.adapters import load_adapters
    from mtkit.translation.engines import load_translator

    def load_model(spec: ModelSpec) -> Loaded:
        translator = load_translator(spec.path, **load)
        return in_memory(translator, load_adapters(spec.path, translator, spec.adapters), continuous)

    return load_model


def in_memory(translator: LineTranslator, adapters: dict[str, ServedAdapter], continuous: bool) -> Loaded:
    """A model in memory: ``translator``, its LoRA ``adapters`` by name, and how it is searched."""
    translators: Translators = {None: translator, **{name: served.translator for name, served in adapters.items()}}
    records = [{"name": name, **served.record} for name, served in adapters.items()]
    return Loaded(translators, records, batching(translator, continuous))


def pool_of(
    name: str, translator: LineTranslator, adapters: dict[str, ServedAdapter] | None = None, continuous: bool = True
) -> ModelPool:
    """A pool of one model already in memory, ``translator`` (and its LoRA ``adapters``, by name), which requests
    call ``name``: for serving a translator made in this process."""
    adapters = adapters or {}
    card = ModelCard(
        name, translator.data, translator.decode, isinstance(translator, Translator), list(adapters),
        tokenizers_of(translator),
    )  # fmt: skip
    pool = ModelPool([], [card], load=_loaded_already)
    pool.loaded[name] = in_memory(translator, adapters, continuous)
    return pool


def _loaded_already(spec: ModelSpec) -> Loaded:
    raise RuntimeError(f"model {spec.name} is served from memory and cannot be loaded again")
