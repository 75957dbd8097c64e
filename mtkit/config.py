"""Typed configuration: the one home for defaults, loaded from YAML plus ``--set`` overrides.

The YAML file mirrors the dataclass tree (``data``, ``tokenizer``, ``model``, ``train``, ``decode``, ``recipe``,
``backtranslation``, ``distillation``);
an unknown key or a value of the wrong type or range is a ``ConfigError`` naming the key.
"""

import dataclasses
import math
import re
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mtkit.errors import MtkitError
from mtkit.untrusted import shown


class ConfigError(MtkitError, ValueError):
    """A bad config file, key or value; the CLI prints it as one line."""


SpmType = Literal["unigram", "bpe"]  # SentencePiece model types
# The number formats of training and translation; auto: bf16 where the device computes it natively, else fp32
# (mtkit.runtime.choose_precision).
Precision = Literal["auto", "fp32", "bf16", "fp16"]
# Translation also takes int8: int8 weights and activations in the linear layers, on the CPU (mtkit.model.quantization).
InferencePrecision = Literal["auto", "fp32", "bf16", "fp16", "int8"]


# A language code: it names a direction and, in a model of several target languages, the tag <2CODE>
# prefixed to each source (mtkit.data.directions).
LANGUAGE_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,15}")
MAX_CORPORA = 256  # corpora in data.corpora: each is a token store held open and a share of the batches


@dataclass(frozen=True)
class CorpusConfig:
    """One parallel corpus of ``data.corpora``: a direction, where its pairs are, and its share of the batches.

    Its pairs come from text files (``train_src``/``train_tgt``, as data.train_src/train_tgt take them), from a
    folder laid out as ``mtkit prepare`` writes one (``prepared``: its train.SRC and train.TGT, valid.* when there,
    and test.*, which ``mtkit run`` scores), or, in ``mtkit run``, from a catalogue corpus (``corpus``), which the
    run prepares and whose test split it scores.
    """

    src_lang: str = ""  # source language code (required)
    tgt_lang: str = ""  # target language code (required)
    train_src: str = ""  # source side; a .tsv(.gz) holding both sides when train_tgt is empty
    train_tgt: str = ""  # target side, line-aligned with train_src
    valid_src: str = ""  # this direction's validation set (BLEU is reported per direction); empty: none
    valid_tgt: str = ""  # its references, line-aligned with valid_src
    prepared: str = ""  # a folder laid out as `mtkit prepare` writes one, instead of the files above
    corpus: str = ""  # a catalogue corpus (`mtkit prepare --list`) that `mtkit run` prepares and tests on
    weight: float = 1.0  # multiplies the corpus's size when batches are drawn (data.temperature)
    # its sources are synthetic (back-translations): each is prefixed with the reserved <BT> tag (Caswell et al.,
    # 2019), so the model can tell them from real text
    back_translated: bool = False

    def __post_init__(self) -> None:
        for side in ("src_lang", "tgt_lang"):
            code = getattr(self, side)
            _check(bool(code), f"{side} is required")
            _check(
                LANGUAGE_CODE.fullmatch(code) is not None,
                f"{side} {shown(code)} is not a language code (a letter, then up to 15 letters, digits, _ or -)",
            )
        _check(self.src_lang != self.tgt_lang, f"src_lang and tgt_lang are both {self.src_lang}")
        _check(self.weight > 0, f"weight must be > 0, got {self.weight:g}")
        given = [name for name in ("train_src", "prepared", "corpus") if getattr(self, name)]
        _check(len(given) <= 1, f"give one of train_src, prepared and corpus, not {' and '.join(given)}")
        _check(not self.train_tgt or bool(self.train_src), "train_tgt needs train_src (or a .tsv train_src alone)")
        _check(not self.valid_tgt or bool(self.valid_src), "valid_tgt needs valid_src")
        _check(
            not (self.prepared or self.corpus) or not self.valid_src,
            "a prepared folder or catalogue corpus brings its own validation set: leave valid_src empty",
        )

    @property
    def direction(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"


@dataclass(frozen=True)
class DataConfig:
    train_src: str = ""  # source side; a .tsv(.gz) holding both sides when train_tgt is empty
    train_tgt: str = ""  # target side, line-aligned with train_src
    valid_src: str = ""  # validation source, or a .tsv(.gz) of both sides; empty: no validation
    valid_tgt: str = ""  # validation target, line-aligned with valid_src
    src_lang: str = "src"  # source language code; `mtkit run` checks it against recipe.corpus
    tgt_lang: str = "tgt"  # target language code; `mtkit run` checks it too and names `test.hyp.<tgt_lang>` after it
    max_tokens: int = 200  # pairs with a longer side (in subword tokens) are dropped from training
    max_ratio: float = 3.0  # ...and pairs whose longer side is more than this many times the shorter
    # Where training pairs are kept encoded (memory-mapped) for reuse by later runs; empty:
    # $MTKIT_CACHE_DIR, else ~/.cache/mtkit/encoded. `mtkit run` uses its data folder's encoded/.
    cache_dir: str = ""
    # several parallel corpora trained into one model, each a direction with its own files and weight, instead of
    # train_src/train_tgt/valid_src/valid_tgt; a model of several target languages gets a tag <2CODE> before
    # each source (docs/multilingual.md)
    corpora: tuple[CorpusConfig, ...] = ()
    # each batch comes from one corpus, drawn with probability proportional to (weight * pairs) ** (1 / temperature):
    # 1 follows the corpora's sizes, larger values flatten the shares towards uniform (fairseq's and eole's
    # temperature sampling)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "corpora", tuple(self.corpora))  # a list when built in Python
        _check(self.max_tokens >= 1, "data.max_tokens must be >= 1")
        _check(self.max_ratio >= 1.0, "data.max_ratio must be >= 1")
        _check(self.temperature > 0, f"data.temperature must be > 0, got {self.temperature:g}")
        _check(
            len(self.corpora) <= MAX_CORPORA,
            f"data.corpora lists {len(self.corpora):,} corpora; at most {MAX_CORPORA} are taken",
        )
        if self.corpora:
            given = [name for name in ("train_src", "train_tgt", "valid_src", "valid_tgt") if getattr(self, name)]
            _check(
                not given,
                f"data.corpora replaces data.{', data.'.join(given)}: give each corpus its files (or leave "
                "data.corpora empty)",
            )
            validated = [c.direction for c in self.corpora if c.valid_src]
            twice = sorted({d for d in validated if validated.count(d) > 1})
            _check(not twice, f"data.corpora gives two validation sets for {', '.join(twice)}: keep one")


@dataclass(frozen=True)
class TokenizerConfig:
    type: SpmType = "unigram"  # SentencePiece model type
    vocab_size: int = 8000  # pieces in each model trained; a model already in the run directory must match
    joint: bool = True  # one model for both languages (needed for tied embeddings)
    character_coverage: float = 1.0  # 0.9995 is usual for scripts with many characters (zh, ja)
    # Sentences sampled to train on (0: every one). SentencePiece needs about 3 KiB of memory per sampled
    # sentence of WMT length: 6 GiB at 2M, whatever the corpus size.
    input_sentence_size: int = 2_000_000
    seed: int = 1  # SentencePiece's random generator (which sentences are sampled)
    model: str = ""  # an existing joint .model to use instead of training one
    src_model: str = ""  # an existing source .model to use with tokenizer.joint: false
    tgt_model: str = ""  # an existing target .model to use with tokenizer.joint: false

    def __post_init__(self) -> None:
        _check_choices(self, "tokenizer")
        _check(self.vocab_size >= 16, "tokenizer.vocab_size must be >= 16")
        _check(0.0 < self.character_coverage <= 1.0, "tokenizer.character_coverage must be in (0, 1]")
        _check(self.input_sentence_size >= 0, "tokenizer.input_sentence_size must be >= 0")
        _check(0 <= self.seed < 2**32, "tokenizer.seed must be in [0, 2**32)")


Preset = Literal["transformer-base", "transformer-big", "transformer-small", "student-tiny", "student-micro"]
PRESETS: dict[Preset, dict[str, Any]] = {
    # Vaswani et al. (2017), Table 3: 65M parameters on a 37k joint vocabulary.
    "transformer-base": {
        "encoder_layers": 6,
        "decoder_layers": 6,
        "d_model": 512,
        "heads": 8,
        "ffn": 2048,
        "dropout": 0.1,
    },
    # Vaswani et al. (2017), Table 3: 213M parameters on a 37k joint vocabulary.
    "transformer-big": {
        "encoder_layers": 6,
        "decoder_layers": 6,
        "d_model": 1024,
        "heads": 16,
        "ffn": 4096,
        "dropout": 0.3,
    },
    # Small enough to train on a laptop CPU in an hour (Multi30k-sized corpora).
    "transformer-small": {
        "encoder_layers": 3,
        "decoder_layers": 3,
        "d_model": 256,
        "heads": 4,
        "ffn": 1024,
        "dropout": 0.1,
    },
    # Students for sequence-level distillation (`distillation`): a deep encoder, which runs once per sentence, and a
    # shallow decoder, which runs once per output token and beam entry (Kasai et al., 2021). student-tiny is
    # the shape of Firefox Translations' tiny students (whose decoder layers are SSRUs, not attention).
    "student-tiny": {
        "encoder_layers": 6,
        "decoder_layers": 2,
        "d_model": 256,
        "heads": 8,
        "ffn": 1536,
        "dropout": 0.1,
    },
    # Half that width: a student of an ensemble of two transformer-small teachers (under a quarter of its parameters).
    "student-micro": {
        "encoder_layers": 6,
        "decoder_layers": 2,
        "d_model": 128,
        "heads": 4,
        "ffn": 512,
        "dropout": 0.1,
    },
}
DEFAULT_PRESET: Preset = "transformer-small"
_DEFAULT_MODEL = PRESETS[DEFAULT_PRESET]  # ModelConfig's defaults for the keys a preset sets


# Bounds on what a config (one in a checkpoint header too) can make mtkit build. Position tables are
# computed, not stored, so a header's max_positions is not checked by the weights it comes with.
MAX_POSITIONS = 65_536
MAX_LAYERS = 1_000  # per stack
# Hypotheses per sentence (a beam, or n-best translations) that a setting may ask for, wherever it comes from (a
# flag, a config, a checkpoint header, an export's mtkit.json): 64 lines at beam 1,000 stay in bounded memory.
MAX_BEAM = 1_000
# Padded tokens in one batch, and so sentences in it: per side in training, source tokens times the beam in
# decoding (25 times decoding's default).
MAX_BATCH_TOKENS = 1 << 20
# Updates whose batches are held made ahead of training (each train.accum batches of train.batch_tokens per side).
MAX_PREFETCH = 16
# Padded lengths rounded up to a multiple of at most this (a longer one pads short batches to no use).
MAX_PAD_MULTIPLE = 256
# A length penalty's alpha is useful from 0.6 to 2; at 10, 65,536 ** alpha still fits a float.
MAX_LENPEN = 10.0
# A sampling temperature T divides float32 log-probabilities, which CUDA computes as a product with 1 / T: both T
# and 1 / T must be float32 numbers (3.4e38 at most), or the draw's weights are NaN. At MIN_TEMPERATURE each draw
# is the greedy token, at MAX_TEMPERATURE every allowed token is equally likely.
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 1e30


@dataclass(frozen=True)
class ModelConfig:
    preset: Preset = DEFAULT_PRESET  # sets the defaults below; explicit keys override it
    encoder_layers: int = _DEFAULT_MODEL["encoder_layers"]  # layers in the encoder stack
    decoder_layers: int = _DEFAULT_MODEL["decoder_layers"]  # layers in the decoder stack
    d_model: int = _DEFAULT_MODEL["d_model"]  # width of the embeddings and of every layer's input and output
    heads: int = _DEFAULT_MODEL["heads"]  # attention heads per layer; each has d_model / heads dimensions
    ffn: int = _DEFAULT_MODEL["ffn"]  # hidden width of each layer's feed-forward block
    dropout: float = _DEFAULT_MODEL["dropout"]  # on embeddings and residual branches
    attention_dropout: float = 0.0  # on attention weights
    activation_dropout: float = 0.0  # inside the feed-forward block, after its activation
    # the feed-forward block's nonlinearity: relu as in the paper; gelu (exact, erf); swish, x * sigmoid(x), which
    # Marian and OPUS-MT models use (SiLU)
    activation: Literal["relu", "gelu", "swish"] = "relu"
    norm: Literal["post", "pre"] = "post"  # post: LN(x + f(x)) as in the paper; pre: x + f(LN(x)), steadier when deep
    tie_embeddings: bool = True  # share source, target and output embeddings (one vocabulary)
    tie_output: bool = False  # share the target embeddings and the output projection (implied by tie_embeddings)
    output_bias: bool = False  # a learned bias on the output logits (Marian's final_logits_bias)
    # sinusoidal or learned: added to the embeddings; relative (Shaw et al., 2018) or rotary (Su et al.,
    # 2021): inside encoder and decoder self-attention, so scores depend on distances
    positions: Literal["sinusoidal", "learned", "relative", "rotary"] = "sinusoidal"
    relative_clip: int = 16  # relative: distances beyond this many positions share one vector
    attention_window: int = 0  # self-attention sees only positions at most this far away; 0: all
    max_positions: int = 1024  # longest token sequence the model takes, in training and translation

    def __post_init__(self) -> None:
        _check_choices(self, "model")
        _check(
            1 <= self.encoder_layers <= MAX_LAYERS and 1 <= self.decoder_layers <= MAX_LAYERS,
            f"model.encoder_layers and model.decoder_layers must be between 1 and {MAX_LAYERS}",
        )
        _check(self.d_model >= 1 and self.heads >= 1, "model.d_model and model.heads must be >= 1")
        _check(
            self.d_model % self.heads == 0,
            f"model.d_model {self.d_model} must be divisible by model.heads {self.heads}",
        )
        _check(self.ffn >= 1, "model.ffn must be >= 1")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            _check(0.0 <= getattr(self, name) < 1.0, f"model.{name} must be in [0, 1)")
        _check(self.relative_clip >= 1, "model.relative_clip must be >= 1")
        _check(self.attention_window >= 0, "model.attention_window must be >= 0")
        _check(
            self.positions != "rotary" or (self.d_model // self.heads) % 2 == 0,
            f"model.positions rotary needs an even head size, and d_model {self.d_model} / heads {self.heads} is odd",
        )
        _check(8 <= self.max_positions <= MAX_POSITIONS, f"model.max_positions must be between 8 and {MAX_POSITIONS}")


FreezeGroup = Literal["embeddings", "encoder", "decoder"]  # the parts of a model train.freeze can hold still


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 10_000  # optimizer updates
    max_epochs: int = 0  # 0: no epoch limit
    batch_tokens: int = 4096  # padded tokens per side per batch (per accumulation step)
    accum: int = 1  # batches accumulated per update: effective batch = batch_tokens * accum
    lr: float = 1e-3  # peak learning rate, reached at the end of warm-up
    warmup: int = 4000  # linear warm-up steps, then the decay train.schedule names
    # the learning rate after warm-up: inverse_sqrt decays as 1 / sqrt(update) (Vaswani et al., 2017); constant
    # stays at train.lr; linear falls to 0 at train.max_steps, usual for fine-tuning a trained model
    schedule: Literal["inverse_sqrt", "constant", "linear"] = "inverse_sqrt"
    label_smoothing: float = 0.1  # loss mass spread uniformly over the vocabulary (Szegedy et al., 2016)
    clip_norm: float = 1.0  # global gradient-norm bound; 0 disables clipping
    weight_decay: float = 0.0  # Adam's L2 penalty, added to the gradients (not decoupled as in AdamW)
    precision: Precision = "auto"  # bf16 where native (CPU with AVX512-BF16/AMX-BF16, GPU), else fp32; fp16: GPU only
    seed: int = 1  # initial weights, dropout masks and batch order
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto picks cuda when available
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    valid_every: int = 1000  # validation (loss + BLEU) cadence in updates; 0 validates only at the end
    save_every: int = 1000  # checkpoint cadence in updates; the last checkpoint is also saved at the end
    log_every: int = 100  # metrics line cadence in updates
    valid_beam: int = 5  # beam size for validation BLEU
    valid_bleu: bool = True  # decode the validation set for BLEU (loss is always computed)
    best_metric: Literal["bleu", "loss"] = "bleu"  # what RUN/best/ and early stopping follow
    patience: int = 0  # stop after this many validations without a new best; 0 never stops early
    max_time: float = 0.0  # wall-clock budget in minutes, summed over resumed runs; 0 is no limit
    keep_last: int = 5  # periodic checkpoints kept in RUN_DIR/checkpoints (for resuming and averaging); 0 keeps all
    # fp32/bf16 non-finite loss or gradient: rollback (to the last checkpoint), skip, stop
    nonfinite: Literal["rollback", "skip", "stop"] = "rollback"
    max_rollbacks: int = 3  # rollbacks allowed before training stops
    rollback_lr_factor: float = 0.5  # each rollback multiplies the learning rate by this
    ddp_timeout: float = 1800.0  # seconds a collective may wait for the other ranks (incl. rank 0's validation)
    compile: bool = False  # torch.compile the encoder-decoder for training
    # updates whose batches a background thread makes ahead (in pinned memory for a GPU); 0 makes each batch in the
    # training loop when its turn comes. The batches and their order are the same either way
    prefetch: int = 2
    # padded batch lengths rounded up to a multiple of this (within model.max_positions) and batch rows padded to
    # what train.batch_tokens holds, so that train.compile compiles each of a bounded set of shapes once (8 suits
    # tensor cores; a larger multiple, fewer shapes); 1 pads to each batch's longest sentence, and train.compile
    # compiles once for symbolic sizes. Batches are cut by the rounded lengths; each one's loss is what it is
    # without the extra padding, which is masked. Changed in a resumed run, as train.batch_tokens, it cuts the
    # rest of the epoch's batches differently
    pad_to_multiple: int = 1
    tensorboard: bool = False  # also write TensorBoard event files to RUN_DIR/tensorboard
    # a trained model to start from (fine-tuning): a run directory (its best/), a checkpoint folder or an averaged
    # .safetensors file with its tokenizer(s) beside it, or hf:SOURCE, a transformers Marian model (a folder or a Hub
    # id such as Helsinki-NLP/opus-mt-en-de) imported into RUN_DIR/imported as `mtkit import hf` does. The run takes
    # its architecture and tokenizers; optimizer, schedule and data position start afresh. Read only while the run
    # has no checkpoint; "": random weights
    init_from: str = ""
    # parts of the model kept at their values (requires_grad off, out of the optimizer): embeddings (token and learned
    # position embeddings, and the output projection when it is tied to them), encoder, decoder (with an untied
    # output projection)
    freeze: tuple[FreezeGroup, ...] = ()

    def __post_init__(self) -> None:
        _check_choices(self, "train")
        _check(
            not set(typing.get_args(FreezeGroup)) <= set(self.freeze),
            "train.freeze lists every part of the model: nothing would train",
        )
        for name in ("max_steps", "batch_tokens", "accum", "valid_beam", "log_every"):
            _check(getattr(self, name) >= 1, f"train.{name} must be >= 1")
        for name in (
            "max_epochs",
            "warmup",
            "valid_every",
            "save_every",
            "threads",
            "patience",
            "keep_last",
            "prefetch",
        ):
            _check(getattr(self, name) >= 0, f"train.{name} must be >= 0")
        _check(self.valid_beam <= MAX_BEAM, f"train.valid_beam must be at most {MAX_BEAM:,}, got {self.valid_beam:,}")
        _check(
            self.batch_tokens <= MAX_BATCH_TOKENS,
            f"train.batch_tokens must be at most {MAX_BATCH_TOKENS:,}, got {self.batch_tokens:,}",
        )
        _check(self.max_rollbacks >= 0, "train.max_rollbacks must be >= 0")
        _check(self.prefetch <= MAX_PREFETCH, f"train.prefetch must be at most {MAX_PREFETCH}")
        _check(
            0 <= self.pad_to_multiple <= MAX_PAD_MULTIPLE,
            f"train.pad_to_multiple must be between 0 and {MAX_PAD_MULTIPLE}",
        )
        _check(0.0 < self.rollback_lr_factor <= 1.0, "train.rollback_lr_factor must be in (0, 1]")
        _check(self.ddp_timeout > 0, "train.ddp_timeout must be > 0")
        _check(self.lr > 0, "train.lr must be > 0")
        _check(self.max_time >= 0, "train.max_time must be >= 0")
        _check(
            self.best_metric == "loss" or self.valid_bleu,
            "train.best_metric bleu needs train.valid_bleu: true (or use best_metric: loss)",
        )
        _check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing must be in [0, 1)")
        _check(self.clip_norm >= 0 and self.weight_decay >= 0, "train.clip_norm and train.weight_decay must be >= 0")


LengthPenalty = Literal["gnmt", "power"]


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = 5  # hypotheses kept per sentence at each step
    lenpen: float = 1.0  # length penalty alpha, the exponent of decode.length_penalty's divisor; 0: none
    # how a finished hypothesis's log-probability is divided by its length L (its tokens and eos): gnmt,
    # ((5 + L) / 6) ** lenpen (Wu et al., 2016; OpenNMT-py); power, L ** lenpen (transformers, CTranslate2,
    # fairseq, Marian): choose power for a model imported from them, which the import records
    length_penalty: LengthPenalty = "gnmt"
    max_len_a: float = 1.5  # hypotheses stop at max_len_a * source_length + max_len_b tokens
    max_len_b: int = 10  # the constant term of that bound
    min_len: int = 0  # no eos before this many output tokens (unless max_len forces one)
    early_stop: bool = True  # also done once the best candidate ended (OpenNMT-py); False: when `beam` have (fairseq)
    batch_size: int = 128  # at most this many sentences per decoding batch...
    # ...and at most this many padded source tokens times the beam (the rows the search holds per
    # sentence), so memory stays bounded at any beam: 40,960 is 8,192 source tokens at beam 5
    batch_tokens: int = 40_960

    def __post_init__(self) -> None:
        _check_choices(self, "decode")
        _check(self.beam >= 1, "decode.beam must be >= 1")
        _check(math.isfinite(self.lenpen + self.max_len_a), "decode.lenpen and decode.max_len_a must be finite")
        _check(self.min_len >= 0, "decode.min_len must be >= 0")
        _check(self.batch_tokens >= 1, "decode.batch_tokens must be >= 1")
        _check(self.lenpen >= 0, "decode.lenpen must be >= 0")
        _check(self.max_len_a >= 0 and self.max_len_b >= 1, "decode.max_len_a must be >= 0 and max_len_b >= 1")
        _check(self.batch_size >= 1, "decode.batch_size must be >= 1")
        _check(self.beam <= MAX_BEAM, f"decode.beam must be at most {MAX_BEAM:,}, got {self.beam:,}")
        _check(self.lenpen <= MAX_LENPEN, f"decode.lenpen must be at most {MAX_LENPEN}, got {self.lenpen}")
        longest = f"at most {MAX_POSITIONS:,} (no output is longer)"
        _check(self.max_len_a <= MAX_POSITIONS, f"decode.max_len_a must be {longest}, got {self.max_len_a}")
        _check(self.max_len_b <= MAX_POSITIONS, f"decode.max_len_b must be {longest}, got {self.max_len_b:,}")
        _check(self.min_len <= MAX_POSITIONS, f"decode.min_len must be {longest}, got {self.min_len:,}")
        most = f"at most {MAX_BATCH_TOKENS:,}"
        _check(self.batch_tokens <= MAX_BATCH_TOKENS, f"decode.batch_tokens must be {most}, got {self.batch_tokens:,}")
        _check(self.batch_size <= MAX_BATCH_TOKENS, f"decode.batch_size must be {most}, got {self.batch_size:,}")


Engine = Literal["mtkit", "ctranslate2"]


@dataclass(frozen=True)
class InferenceConfig:
    """Where and how a trained model runs (`mtkit translate`, `mtkit attention`, `mtkit.load`): the defaults
    of their device, precision and engine."""

    device: str = "auto"  # auto: cuda when available, else cpu; or cpu, cuda, cuda:N
    # of the weights: auto is bf16 where the device computes it natively, else fp32; int8: CPU only
    precision: InferencePrecision = "auto"
    engine: Engine = "mtkit"  # or ctranslate2, for a folder `mtkit export` wrote
    # CPU threads for one process's operations (torch's, or CTranslate2's intra_threads); 0 keeps each library's
    # default: torch's OMP_NUM_THREADS where set, else one per core; CTranslate2's 4. Give each process its share of
    # the cores when several translate or serve on one machine: threads that outnumber the cores wait on each other
    threads: int = 0


MAX_PER_SOURCE = 1_000  # shortlist candidates per source token, at most: bounds what a shortlist file may allocate


@dataclass(frozen=True)
class ShortlistConfig:
    """How `mtkit shortlist` builds a vocabulary shortlist from training pairs (its --per-source, --frequent
    and --pairs)."""

    per_source: int = (
        10  # target candidates kept per source token: within 0.01 BLEU of the whole vocabulary on Multi30k
    )
    frequent: int = 100  # most frequent target tokens, candidates for every batch
    pairs: int = 200_000  # training pairs counted (the first ones): enough for the statistics, bounded memory


@dataclass(frozen=True)
class ServeConfig:
    """How `mtkit serve` listens, batches concurrent requests and bounds what one request may ask (its --host,
    --port, --max-batch-size, --max-wait-ms, --continuous, --max-queue, --max-texts, --max-chars, --timeout,
    --receive-timeout, --max-connections, --log-format and --api-key)."""

    host: str = "127.0.0.1"  # loopback only; 0.0.0.0 listens on every interface (then set api_key too)
    port: int = 8000  # 0: any free port, named in the log line that says where the server listens
    max_batch_size: int = 64  # sentences of concurrent requests searched together (one request is never split)
    max_wait_ms: float = 5.0  # how long the oldest sentence waits for search-mates before an idle search starts
    # requests join a search already running, and leave it as they are done (mtkit.decoding.continuous); False: each
    # search takes the requests waiting when it starts and ends with the last of them
    continuous: bool = True
    max_queue: int = 1024  # sentences waiting beyond this are refused (503), so a burst fails fast, not by timeouts
    max_texts: int = 64  # texts in one request; more is refused (413)
    max_chars: int = 20_000  # characters of one request's texts together; more is refused (413)
    max_beam: int = 16  # the widest beam a request may ask for: its batch-mates wait for its search too
    timeout: float = 30.0  # seconds a request waits for its translations before it is answered 504
    # seconds a client may take to send a request's headers, and again its body: slower headers close the
    # connection, a slower body is answered 408 (a client trickling bytes holds a connection no longer)
    receive_timeout: float = 10.0
    # connections open at once; one more is answered 503 and closed (kept under the process's file limit)
    max_connections: int = 512
    log_format: Literal["plain", "json"] = "plain"  # json: each log line one JSON object (a request's fields)
    # required as "Authorization: Bearer KEY" on every request but /health; "": none (MTKIT_API_KEY sets it too)
    api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_batch_size", "max_queue", "max_texts", "max_chars", "max_connections"):
            _check(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        _check(1 <= self.max_beam <= MAX_BEAM, f"ServeConfig.max_beam must be in [1, {MAX_BEAM}], got {self.max_beam}")
        _check(0 <= self.max_wait_ms < math.inf, f"--max-wait-ms must be a finite number >= 0, got {self.max_wait_ms}")
        _check(0 < self.timeout < math.inf, f"--timeout must be a finite number > 0, got {self.timeout}")
        _check(
            0 < self.receive_timeout < math.inf,
            f"--receive-timeout must be a finite number > 0, got {self.receive_timeout}",
        )
        _check(self.log_format in ("plain", "json"), f"--log-format must be plain or json, got {self.log_format!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """How `mtkit translate --sample` draws each next token instead of searching (back-translation,
    diverse outputs)."""

    temperature: float = 1.0  # < 1 sharpens the distribution, > 1 flattens it
    top_k: int = 0  # sample among the k most probable tokens; 0: all
    top_p: float = 1.0  # nucleus: the smallest set of tokens holding this much probability
    seed: int = 1  # of the random generator: the same seed draws the same samples

    def __post_init__(self) -> None:
        _check(
            MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            f"--temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {self.temperature:g}",
        )
        _check(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"--top-k must be >= 0, got {self.top_k}")
        _check(0 <= self.seed < 2**64, f"--seed must be in [0, 2**64), got {self.seed}")


@dataclass(frozen=True)
class RecipeConfig:
    """What `mtkit run` does around training: where the data comes from, what result to expect."""

    corpus: str = ""  # an `mtkit prepare` corpus; its train/valid files become data.*, its test split is scored
    data_dir: str = ""  # where it is prepared; "": one folder all runs share ($MTKIT_DATA_DIR, ~/.cache/mtkit/prepared)
    average_last: int = 5  # score the mean of the newest K checkpoints; 0 scores best/
    bleu_min: float = 0.0  # lowest test sacreBLEU that counts as reproducing the result
    bleu_max: float = 100.0  # highest test sacreBLEU that counts as reproducing the result
    expected: str = ""  # where that range comes from (paper, BLEU variant)
    hardware: str = ""  # the hardware and time the recipe expects

    def __post_init__(self) -> None:
        _check(self.average_last >= 0, "recipe.average_last must be >= 0")
        _check(
            0 <= self.bleu_min <= self.bleu_max <= 100, "recipe.bleu_min/bleu_max must satisfy 0 <= min <= max <= 100"
        )


@dataclass(frozen=True)
class BackTranslationConfig:
    """What `mtkit run` does to grow the parallel data with back-translation (Sennrich et al., 2016): a model
    of the reverse direction (given, or trained on the run's parallel data first) translates target-language
    monolingual text, and the main model trains on the real pairs and these synthetic ones, each synthetic
    source tagged <BT> (Caswell et al., 2019). Empty ``monolingual``: no back-translation."""

    monolingual: str = ""  # target-language text, one sentence per line, to back-translate
    # a trained model of the reverse direction (run directory, checkpoint or .safetensors); "": `mtkit run` trains
    # one into RUN/reverse, with the run's model and train settings on its parallel data turned around
    reverse_model: str = ""
    reverse_steps: int = 0  # updates of that reverse model; 0: train.max_steps
    # sample: each token drawn from the model's distribution, which Edunov et al. (2018) found better than beam
    # search once there are millions of sentences; beam: the reverse model's best translation, better with little
    # data in that study
    method: Literal["sample", "beam"] = "sample"
    beam: int = 5  # with method beam
    temperature: float = 1.0  # with method sample, as `mtkit translate --sample`: unrestricted sampling by default
    top_k: int = 0  # with method sample: only the k most probable tokens; 0 for all
    top_p: float = 1.0  # with method sample: the smallest set of tokens holding this much probability
    seed: int = 1  # of the sampling
    weight: float = 1.0  # the synthetic corpus's weight when batches are drawn (data.corpora)
    tag: bool = True  # put <BT> before each synthetic source

    def __post_init__(self) -> None:
        _check_choices(self, "backtranslation")
        _check(self.reverse_steps >= 0, "backtranslation.reverse_steps must be >= 0")
        _check(1 <= self.beam <= MAX_BEAM, f"backtranslation.beam must be in [1, {MAX_BEAM}]")
        _check(self.weight > 0, f"backtranslation.weight must be > 0, got {self.weight:g}")
        _check(
            MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            f"backtranslation.temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
            f"got {self.temperature:g}",
        )
        _check(0 < self.top_p <= 1 and self.top_k >= 0, "backtranslation.top_p must be in (0, 1], top_k >= 0")
        _check(0 <= self.seed < 2**63, "backtranslation.seed must be in [0, 2**63)")


MAX_TEACHERS = 16  # models in a teacher ensemble: each is held in memory and run at every decoding step


@dataclass(frozen=True)
class DistillationConfig:
    """What `mtkit run` does to train a small, fast student on a teacher's translations (sequence-level knowledge
    distillation, Kim and Rush, 2016): the teacher (given, or trained first from a recipe, one model per seed;
    several models decode as an ensemble) translates the training source by beam search, the pairs it makes
    are filtered, and this config's model, the student, trains on them with the teacher's tokenizer; then a
    shortlist is built from them and the report sets teacher and student side by side. Neither ``teacher``
    nor ``teacher_recipe``: no distillation."""

    teacher: tuple[str, ...] = ()  # trained models (run directories, checkpoints, .safetensors): several, an ensemble
    # a recipe `mtkit run` runs first, once per seed, into RUN/teacher-SEED, when teacher is empty: a teacher of the
    # same direction; the later seeds take the first one's tokenizer, so that they decode as an ensemble
    teacher_recipe: str = ""
    teacher_seeds: tuple[int, ...] = (1,)  # train.seed of each teacher trained from teacher_recipe
    beam: int = 5  # the teacher's beam on the training source (Firefox Translations uses 8)
    # of the teacher's n best translations of a line, keep the one closest to the line's reference by sentence
    # chrF (as Firefox Translations does with its whole beam); 1: the teacher's best; at most beam
    nbest: int = 1
    # drop pairs whose longer side, in the teacher's subword tokens (eos included), is more than this many times
    # the shorter: a translation much longer than its source repeats itself, one much shorter leaves text out
    max_ratio: float = 2.0
    # then drop this fraction of the pairs left: those whose translation the teacher scored lowest (length-normalised
    # log-probability), where it was least sure of itself; 0: none
    drop_worst: float = 0.0
    shortlist: bool = True  # build RUN/shortlist.safetensors from the distilled pairs (shortlist defaults)

    def __post_init__(self) -> None:
        _check(
            1 <= len(self.teacher_seeds) <= MAX_TEACHERS and len(self.teacher) <= MAX_TEACHERS,
            f"distillation.teacher and distillation.teacher_seeds must name 1 to {MAX_TEACHERS} models",
        )
        _check(len(set(self.teacher_seeds)) == len(self.teacher_seeds), "distillation.teacher_seeds has a seed twice")
        _check(all(0 <= s < 2**63 for s in self.teacher_seeds), "distillation.teacher_seeds must be in [0, 2**63)")
        _check(
            not (self.teacher and self.teacher_recipe),
            "give distillation.teacher (trained models) or distillation.teacher_recipe (to train them), not both",
        )
        _check(1 <= self.beam <= MAX_BEAM, f"distillation.beam must be in [1, {MAX_BEAM}]")
        _check(
            1 <= self.nbest <= self.beam, f"distillation.nbest must be between 1 and distillation.beam ({self.beam})"
        )
        _check(self.max_ratio >= 1.0, f"distillation.max_ratio must be >= 1, got {self.max_ratio:g}")
        _check(0.0 <= self.drop_worst < 1.0, f"distillation.drop_worst must be in [0, 1), got {self.drop_worst:g}")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.teacher_recipe)


@dataclass(frozen=True)
class CleanConfig:
    """How `mtkit prepare` cleans a training split (its --nfkc, --dedupe, --min-words, --max-words and
    --max-ratio); valid and test are written as published."""

    nfkc: bool = False  # Unicode NFKC normalisation (off by default: it changes e.g. full-width forms and ligatures)
    dedupe: bool = True  # drop exact duplicate (source, target) pairs after normalisation
    min_words: int = 1  # whitespace-separated words per side
    max_words: int = 250  # as Moses clean-corpus-n
    max_ratio: float = 3.0  # longer side / shorter side in words (Moses' default is 9; fairseq's examples use 1.5)

    def __post_init__(self) -> None:
        _check(self.min_words >= 1, f"clean.min_words must be >= 1, got {self.min_words}")
        _check(
            self.max_words >= self.min_words,
            f"clean.max_words must be >= clean.min_words ({self.min_words}), got {self.max_words}",
        )
        _check(self.max_ratio >= 1.0, f"clean.max_ratio must be >= 1, got {self.max_ratio}")  # False for NaN too


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    backtranslation: BackTranslationConfig = field(default_factory=BackTranslationConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choices(config: Any, section: str) -> None:
    """Check each field of choices (``Literal``, or a list of them) against them, also when it is built in Python."""
    for name, hint in typing.get_type_hints(type(config)).items():
        if typing.get_origin(hint) in (Literal, tuple):
            _coerce(f"{section}.{name}", getattr(config, name), hint)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a field's type; ints are accepted where floats are expected, a YAML list where a
    ``tuple[X, ...]`` is (each item checked as an X)."""
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
        of = f" of {', '.join(map(str, typing.get_args(item)))}" if typing.get_origin(item) is Literal else ""
        raise ConfigError(f"{key} must be a list{of} (YAML: [a, b]), got {shown(value)}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return _build(hint, value, key + ".")
        raise ConfigError(f"{key} must be a mapping of {', '.join(f.name for f in dataclasses.fields(hint))}")
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value in choices:
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {shown(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 2**63:  # beyond the 64-bit integers torch and numpy take
                raise ConfigError(f"{key} is too large, got {shown(value)}")
            return value
    elif hint is float:
        number = None
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                number = float(value)
            elif isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
                number = float(value)
        except (ValueError, OverflowError):  # not a number, or an int beyond any float
            pass
        if number is not None:
            if not math.isfinite(number):  # .inf and .nan parse, but no setting means them
                raise ConfigError(f"{key} must be a finite number, got {shown(value)}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{key} must be of type {name}, got {shown(value)}")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            name = key if isinstance(key, str) and key.isprintable() else shown(key)
            raise ConfigError(f"unknown config key {prefix}{name} (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(prefix + key, value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if prefix.endswith("]."):  # an item of a list (data.corpora[1].): its checks do not know where it is
            raise ConfigError(f"{prefix[:-1]}: {err}") from None
        raise


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
    "recipe": RecipeConfig,
    "backtranslation": BackTranslationConfig,
    "distillation": DistillationConfig,
}

# Settings given as command-line options rather than in a run's YAML file, by the command that takes them.
COMMAND_OPTIONS: dict[str, type] = {"mtkit prepare": CleanConfig, "mtkit serve": ServeConfig}


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts; the model preset fills model keys not given explicitly."""
    if not isinstance(raw, dict):
        raise ConfigError("a config must be a mapping of sections (data, tokenizer, model, train, decode)")
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {shown(section)} (known: {', '.join(SECTIONS)})")
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"config section {section} must be a mapping, got {shown(values)}")
    model_raw = dict(raw.get("model") or {})
    preset = _coerce("model.preset", model_raw.get("preset", ModelConfig.preset), Preset)
    sections = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    sections["model"] = {**PRESETS[preset], **model_raw}
    return RunConfig(**{name: _build(cls, sections[name], name + ".") for name, cls in SECTIONS.items()})


MAX_YAML_NODES = 10_000  # a config has about 100 values; aliases that expand to more are refused


def parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The value of a YAML document, read with the safe loader, and its node tree (for line numbers).

    No tags that build Python objects; anchors and aliases are allowed as long as the document they
    expand to has at most MAX_YAML_NODES nodes, so a few hundred bytes of nested aliases cannot take
    gigabytes. Raises yaml.YAMLError.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_NODES:,} values")
        return loader.construct_document(node), node
    except RecursionError:  # PyYAML composes recursively
        raise yaml.YAMLError("nested too deeply") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes in ``node`` with every alias expanded, counted once per distinct node (linear time)."""
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a node that contains itself: counted once, not forever
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``section.key=value`` override in place; the value is parsed as YAML."""
    key, sep, text = assignment.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {shown(assignment)}")
    try:
        value = parse_yaml(text)[0] if text.strip() else ""
    except yaml.YAMLError:
        value = text
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"config section {parts[0]} must be a mapping")
    section[parts[1]] = value


def read_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides.

    YAML is read with the safe loader and bounded in size (``parse_yaml``). An error about a key
    says where that key's value came from: the file and line, or the ``--set`` that gave it.
    """
    raw: Any = {}
    origins: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            raw, root = parse_yaml(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            where = getattr(err, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"{path}:{line} not valid YAML ({getattr(err, 'problem', None) or err})") from None
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config must be a mapping of sections")
        origins = {key: f"{path}:{line}" for key, line in _key_lines(root).items()}
    for assignment in overrides:
        apply_override(raw, assignment)
        origins[assignment.partition("=")[0].strip()] = f"--set {assignment}"
    try:
        return from_dict(raw)
    except ConfigError as err:
        named = re.findall(r"\b(?:" + "|".join(SECTIONS) + r")\.\w+", str(err))
        found = [origins[key] for key in named if key in origins]
        if not found:
            raise
        # A check across keys (d_model and heads) blames a --set over the file: the override is the change.
        origin = next((o for o in found if o.startswith("--set")), found[0])
        raise ConfigError(f"{origin}: {err}") from None


def _key_lines(root: yaml.Node | None) -> dict[str, int]:
    """The line of each ``section.key`` in a YAML config's node tree (1-based), for error messages."""
    lines = {}
    if isinstance(root, yaml.MappingNode):
        for section, body in root.value:
            if isinstance(body, yaml.MappingNode):
                for key, _ in body.value:
                    lines[f"{section.value}.{key.value}"] = key.start_mark.line + 1
    return lines


def config_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
