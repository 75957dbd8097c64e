"""The model section: the Transformer's shape, and the presets that set it."""

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from mtkit.config.bounds import MAX_LAYERS, MAX_POSITIONS
from mtkit.config.checks import check, check_choices
from mtkit.config.setting import setting

Preset = Literal["transformer-base", "transformer-big", "transformer-small", "student-tiny", "student-micro"]
PRESETS: dict[Preset, dict[str, Any]] = {
    "transformer-base": {
        "encoder_layers": 6,
        "decoder_layers": 6,
        "d_model": 512,
        "heads": 8,
        "ffn": 2048,
        "dropout": 0.1,
    },
    "transformer-big": {
        "encoder_layers": 6,
        "decoder_layers": 6,
        "d_model": 1024,
        "heads": 16,
        "ffn": 4096,
        "dropout": 0.3,
    },
    "transformer-small": {
        "encoder_layers": 3,
        "decoder_layers": 3,
        "d_model": 256,
        "heads": 4,
        "ffn": 1024,
        "dropout": 0.1,
    },
    "student-tiny": {
        "encoder_layers": 6,
        "decoder_layers": 2,
        "d_model": 256,
        "heads": 8,
        "ffn": 1536,
        "dropout": 0.1,
    },
    "student-micro": {
        "encoder_layers": 6,
        "decoder_layers": 2,
        "d_model": 128,
        "heads": 4,
        "ffn": 512,
        "dropout": 0.1,
    },
}
PRESET_REASONS: dict[Preset, str] = {
    "transformer-base": "Vaswani et al. (2017), Table 3: 65M parameters on a 37k joint vocabulary.",
    "transformer-big": "Vaswani et al. (2017), Table 3: 213M parameters on a 37k joint vocabulary.",
    "transformer-small": "Small enough to train on a laptop CPU in an hour (Multi30k-sized corpora).",
    "student-tiny": (
        "Students for sequence-level distillation (`distillation`): a deep encoder, which runs once per sentence, "
        "and a shallow decoder, which runs once per output token and beam entry (Kasai et al., 2021). student-tiny "
        "is the shape of Firefox Translations' tiny students (whose decoder layers are SSRUs, not attention)."
    ),
    "student-micro": (
        "Half that width: a student of an ensemble of two transformer-small teachers (under a quarter of its "
        "parameters)."
    ),
}
DEFAULT_PRESET: Preset = "transformer-small"
_DEFAULT_MODEL = PRESETS[DEFAULT_PRESET]  # ModelConfig's defaults for the keys a preset sets


@dataclass(frozen=True)
class ModelConfig:
    preset: Preset = setting(DEFAULT_PRESET, "sets the defaults below; explicit keys override it")
    encoder_layers: int = setting(_DEFAULT_MODEL["encoder_layers"], "layers in the encoder stack")
    decoder_layers: int = setting(_DEFAULT_MODEL["decoder_layers"], "layers in the decoder stack")
    d_model: int = setting(_DEFAULT_MODEL["d_model"], "width of the embeddings and of every layer's input and output")
    heads: int = setting(_DEFAULT_MODEL["heads"], "attention heads per layer; each has d_model / heads dimensions")
    ffn: int = setting(_DEFAULT_MODEL["ffn"], "hidden width of each layer's feed-forward block")
    dropout: float = setting(_DEFAULT_MODEL["dropout"], "on embeddings and residual branches")
    attention_dropout: float = setting(0.0, "on attention weights")
    activation_dropout: float = setting(0.0, "inside the feed-forward block, after its activation")
    activation: Literal["relu", "gelu", "swish"] = setting(
        "relu",
        "the feed-forward block's nonlinearity: relu as in the paper; gelu (exact, erf); swish, x * sigmoid(x), "
        "which Marian and OPUS-MT models use (SiLU)",
    )
    norm: Literal["post", "pre"] = setting(
        "post",
        "post: LN(x + f(x)) as in the paper; pre: x + f(LN(x)), steadier when deep",
    )
    tie_embeddings: bool = setting(True, "share source, target and output embeddings (one vocabulary)")
    tie_output: bool = setting(
        False,
        "share the target embeddings and the output projection (implied by tie_embeddings)",
    )
    output_bias: bool = setting(False, "a learned bias on the output logits (Marian's final_logits_bias)")
    positions: Literal["sinusoidal", "learned", "relative", "rotary", "fairseq"] = setting(
        "sinusoidal",
        "sinusoidal or learned: added to the embeddings; relative (Shaw et al., 2018) or rotary (Su et al., 2021): "
        "inside encoder and decoder self-attention, so scores depend on distances; fairseq: the sinusoids fairseq "
        "and tensor2tensor add (frequencies 10000^(-i/(d_model/2 - 1)), sin and cos in two halves, from position 2), "
        "which NLLB-200 and M2M100 were trained with",
    )
    decoder_start: Literal["bos", "eos"] = setting(
        "bos",
        "the token the decoder reads before the first output: bos, or eos as fairseq-trained models (NLLB-200, "
        "M2M100) read it",
    )
    relative_clip: int = setting(16, "relative: distances beyond this many positions share one vector")
    attention_window: int = setting(0, "self-attention sees only positions at most this far away; 0: all")
    max_positions: int = setting(1024, "longest token sequence the model takes, in training and translation")

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {
        "MAX_LAYERS": ("encoder_layers", "decoder_layers"),
        "MAX_POSITIONS": ("max_positions",),
    }

    def __post_init__(self) -> None:
        check_choices(self, "model")
        check(
            1 <= self.encoder_layers <= MAX_LAYERS and 1 <= self.decoder_layers <= MAX_LAYERS,
            f"model.encoder_layers and model.decoder_layers must be between 1 and {MAX_LAYERS}",
        )
        check(self.d_model >= 1 and self.heads >= 1, "model.d_model and model.heads must be >= 1")
        check(
            self.d_model % self.heads == 0,
            f"model.d_model {self.d_model} must be divisible by model.heads {self.heads}",
        )
        check(self.ffn >= 1, "model.ffn must be >= 1")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            check(0.0 <= getattr(self, name) < 1.0, f"model.{name} must be in [0, 1)")
        check(self.relative_clip >= 1, "model.relative_clip must be >= 1")
        check(self.attention_window >= 0, "model.attention_window must be >= 0")
        check(
            self.positions != "rotary" or (self.d_model // self.heads) % 2 == 0,
            f"model.positions rotary needs an even head size, and d_model {self.d_model} / heads {self.heads} is odd",
        )
        check(
            self.positions != "fairseq" or (self.d_model % 2 == 0 and self.d_model >= 4),
            f"model.positions fairseq needs an even d_model of at least 4, got {self.d_model}",
        )
        check(8 <= self.max_positions <= MAX_POSITIONS, f"model.max_positions must be between 8 and {MAX_POSITIONS}")
