"""The data sections: the parallel corpora a model trains on and their files, the tokenizer trained on
them, and how `mtkit prepare` cleans a training split."""

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from mtkit.config.bounds import MAX_CORPORA, MAX_LANGUAGES
from mtkit.config.checks import check, check_choices
from mtkit.config.setting import setting
from mtkit.untrusted import shown

SpmType = Literal["unigram", "bpe"]  # SentencePiece model types

# A language code: it names a direction and, in a model of several target languages, the tag <2CODE>
# prefixed to each source (mtkit.data.directions).
LANGUAGE_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,15}")


@dataclass(frozen=True)
class CorpusConfig:
    """One parallel corpus of ``data.corpora``: a direction, where its pairs are, and its share of the batches.

    Its pairs come from text files (``train_src``/``train_tgt``, as data.train_src/train_tgt take them), from a
    folder laid out as ``mtkit prepare`` writes one (``prepared``: its train.SRC and train.TGT, valid.* when there,
    and test.*, which ``mtkit run`` scores), or, in ``mtkit run``, from a catalogue corpus (``corpus``), which the
    run prepares and whose test split it scores.
    """

    src_lang: str = setting("", "source language code (required)")
    tgt_lang: str = setting("", "target language code (required)")
    train_src: str = setting("", "source side; a .tsv(.gz) holding both sides when train_tgt is empty")
    train_tgt: str = setting("", "target side, line-aligned with train_src")
    valid_src: str = setting("", "this direction's validation set (BLEU is reported per direction); empty: none")
    valid_tgt: str = setting("", "its references, line-aligned with valid_src")
    prepared: str = setting("", "a folder laid out as `mtkit prepare` writes one, instead of the files above")
    corpus: str = setting("", "a catalogue corpus (`mtkit prepare --list`) that `mtkit run` prepares and tests on")
    weight: float = setting(1.0, "multiplies the corpus's size when batches are drawn (data.temperature)")
    back_translated: bool = setting(
        False,
        "its sources are synthetic (back-translations): each is prefixed with the reserved <BT> tag "
        "(Caswell et al., 2019), so the model can tell them from real text",
    )

    def __post_init__(self) -> None:
        for side in ("src_lang", "tgt_lang"):
            code = getattr(self, side)
            check(bool(code), f"{side} is required")
            check(
                LANGUAGE_CODE.fullmatch(code) is not None,
                f"{side} {shown(code)} is not a language code (a letter, then up to 15 letters, digits, _ or -)",
            )
        check(self.src_lang != self.tgt_lang, f"src_lang and tgt_lang are both {self.src_lang}")
        check(self.weight > 0, f"weight must be > 0, got {self.weight:g}")
        given = [name for name in ("train_src", "prepared", "corpus") if getattr(self, name)]
        check(len(given) <= 1, f"give one of train_src, prepared and corpus, not {' and '.join(given)}")
        check(not self.train_tgt or bool(self.train_src), "train_tgt needs train_src (or a .tsv train_src alone)")
        check(not self.valid_tgt or bool(self.valid_src), "valid_tgt needs valid_src")
        check(
            not (self.prepared or self.corpus) or not self.valid_src,
            "a prepared folder or catalogue corpus brings its own validation set: leave valid_src empty",
        )

    @property
    def direction(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"


@dataclass(frozen=True)
class DataConfig:
    train_src: str = setting("", "source side; a .tsv(.gz) holding both sides when train_tgt is empty")
    train_tgt: str = setting("", "target side, line-aligned with train_src")
    valid_src: str = setting("", "validation source, or a .tsv(.gz) of both sides; empty: no validation")
    valid_tgt: str = setting("", "validation target, line-aligned with valid_src")
    src_lang: str = setting("src", "source language code; `mtkit run` checks it against recipe.corpus")
    tgt_lang: str = setting(
        "tgt",
        "target language code; `mtkit run` checks it too and names `test.hyp.<tgt_lang>` after it",
    )
    max_tokens: int = setting(200, "pairs with a longer side (in subword tokens) are dropped from training")
    max_ratio: float = setting(3.0, "...and pairs whose longer side is more than this many times the shorter")
    cache_dir: str = setting(
        "",
        "Where training pairs are kept encoded (memory-mapped) for reuse by later runs; empty: $MTKIT_CACHE_DIR, "
        "else ~/.cache/mtkit/encoded. `mtkit run` uses its data folder's encoded/.",
    )
    corpora: tuple[CorpusConfig, ...] = setting(
        (),
        "several parallel corpora trained into one model, each a direction with its own files and weight, instead of "
        "train_src/train_tgt/valid_src/valid_tgt; a model of several target languages gets a tag <2CODE> before each "
        "source (docs/multilingual.md)",
    )
    languages: tuple[str, ...] = setting(
        (),
        "the languages of a model that is told its source and target language by tokens, as NLLB-200 and M2M100 "
        "are (`mtkit import hf` records them): it translates between any two of them; each source begins with its "
        "language's token and each output with the target language's (data.language_token)",
    )
    language_token: str = setting(
        "",
        "with data.languages: the piece of a language's token, {lang} standing for its code (NLLB-200: {lang}, "
        "M2M100: __{lang}__)",
    )
    temperature: float = setting(
        1.0,
        "each batch comes from one corpus, drawn with probability proportional to "
        "(weight * pairs) ** (1 / temperature): 1 follows the corpora's sizes, larger values flatten the shares "
        "towards uniform (fairseq's and eole's temperature sampling)",
    )

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {"MAX_CORPORA": ("corpora",), "MAX_LANGUAGES": ("languages",)}

    def __post_init__(self) -> None:
        object.__setattr__(self, "corpora", tuple(self.corpora))  # a list when built in Python
        object.__setattr__(self, "languages", tuple(self.languages))
        self._check_languages()
        check(self.max_tokens >= 1, "data.max_tokens must be >= 1")
        check(self.max_ratio >= 1.0, "data.max_ratio must be >= 1")
        check(self.temperature > 0, f"data.temperature must be > 0, got {self.temperature:g}")
        check(
            len(self.corpora) <= MAX_CORPORA,
            f"data.corpora lists {len(self.corpora):,} corpora; at most {MAX_CORPORA} are taken",
        )
        if self.corpora:
            given = [name for name in ("train_src", "train_tgt", "valid_src", "valid_tgt") if getattr(self, name)]
            check(
                not given,
                f"data.corpora replaces data.{', data.'.join(given)}: give each corpus its files (or leave "
                "data.corpora empty)",
            )
            validated = [c.direction for c in self.corpora if c.valid_src]
            twice = sorted({d for d in validated if validated.count(d) > 1})
            check(not twice, f"data.corpora gives two validation sets for {', '.join(twice)}: keep one")

    def _check_languages(self) -> None:
        """data.languages: distinct language codes, each with a token data.language_token names."""
        check(
            len(self.languages) <= MAX_LANGUAGES,
            f"data.languages lists {len(self.languages):,} languages; at most {MAX_LANGUAGES:,} are taken",
        )
        for code in self.languages:
            check(
                isinstance(code, str) and LANGUAGE_CODE.fullmatch(code) is not None,
                f"data.languages: {shown(code)} is not a language code (a letter, then up to 15 letters, digits, _ "
                "or -)",
            )
        twice = sorted({code for code in self.languages if self.languages.count(code) > 1})
        check(not twice, f"data.languages names {', '.join(twice)} twice")
        if not self.languages:
            check(not self.language_token, "data.language_token needs data.languages")
            return
        token = self.language_token
        check(
            token.count("{lang}") == 1 and len(token) <= 64 and not any(c.isspace() for c in token),
            f"data.language_token must hold {{lang}} once, no spaces, at most 64 characters; got {shown(token)}",
        )


@dataclass(frozen=True)
class TokenizerConfig:
    type: SpmType = setting("unigram", "SentencePiece model type")
    vocab_size: int = setting(8000, "pieces in each model trained; a model already in the run directory must match")
    joint: bool = setting(True, "one model for both languages (needed for tied embeddings)")
    character_coverage: float = setting(1.0, "0.9995 is usual for scripts with many characters (zh, ja)")
    input_sentence_size: int = setting(
        2_000_000,
        "Sentences sampled to train on (0: every one). SentencePiece needs about 3 KiB of memory per sampled "
        "sentence of WMT length: 6 GiB at 2M, whatever the corpus size.",
    )
    seed: int = setting(1, "SentencePiece's random generator (which sentences are sampled)")
    model: str = setting("", "an existing joint .model to use instead of training one")
    src_model: str = setting("", "an existing source .model to use with tokenizer.joint: false")
    tgt_model: str = setting("", "an existing target .model to use with tokenizer.joint: false")

    def __post_init__(self) -> None:
        check_choices(self, "tokenizer")
        check(self.vocab_size >= 16, "tokenizer.vocab_size must be >= 16")
        check(0.0 < self.character_coverage <= 1.0, "tokenizer.character_coverage must be in (0, 1]")
        check(self.input_sentence_size >= 0, "tokenizer.input_sentence_size must be >= 0")
        check(0 <= self.seed < 2**32, "tokenizer.seed must be in [0, 2**32)")


@dataclass(frozen=True)
class CleanConfig:
    """How `mtkit prepare` cleans a training split (its --nfkc, --dedupe, --min-words, --max-words and
    --max-ratio); valid and test are written as published."""

    nfkc: bool = setting(
        False,
        "Unicode NFKC normalisation (off by default: it changes e.g. full-width forms and ligatures)",
    )
    dedupe: bool = setting(True, "drop exact duplicate (source, target) pairs after normalisation")
    min_words: int = setting(1, "whitespace-separated words per side")
    max_words: int = setting(250, "as Moses clean-corpus-n")
    max_ratio: float = setting(
        3.0,
        "longer side / shorter side in words (Moses' default is 9; fairseq's examples use 1.5)",
    )

    def __post_init__(self) -> None:
        check(self.min_words >= 1, f"clean.min_words must be >= 1, got {self.min_words}")
        check(
            self.max_words >= self.min_words,
            f"clean.max_words must be >= clean.min_words ({self.min_words}), got {self.max_words}",
        )
        check(self.max_ratio >= 1.0, f"clean.max_ratio must be >= 1, got {self.max_ratio}")  # False for NaN too
