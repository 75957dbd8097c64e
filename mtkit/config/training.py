"""The training section: updates, learning rate, precision, validation, checkpoints and recovery."""

import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

from mtkit.config.bounds import MAX_BATCH_TOKENS, MAX_BEAM, MAX_PAD_MULTIPLE, MAX_PREFETCH
from mtkit.config.checks import check, check_choices
from mtkit.config.setting import setting

# The number formats of training and translation; auto: bf16 where the device computes it natively, else fp32
# (mtkit.runtime.choose_precision).
Precision = Literal["auto", "fp32", "bf16", "fp16"]
FreezeGroup = Literal["embeddings", "encoder", "decoder"]  # the parts of a model train.freeze can hold still
# The linear layers train.lora can adapt: each projection by name, or a group of them (mtkit.model.lora.TARGETS).
LoraTarget = Literal[
    "attention", "self_attention", "cross_attention", "ffn",
    "self_q", "self_k", "self_v", "self_out", "cross_q", "cross_k", "cross_v", "cross_out", "ffn_up", "ffn_down",
]  # fmt: skip


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al., 2021): each target linear layer W of the model train.init_from names gets an adapter, two
    matrices A (rank, in) and B (out, rank), and computes x W^T + b + (alpha / rank) B A x; the base model stays as
    it is and only the adapters train. B starts at zero, so training starts from the base model's function. Each
    checkpoint then holds the adapters alone, with the digest of the base they adapt (docs/commands.md)."""

    rank: int = setting(
        0,
        "the rank of each adapter, at most the smaller width of every target layer; 0: no adapters, the whole model "
        "trains (as train.freeze allows)",
    )
    alpha: float = setting(16.0, "the adapters' updates are scaled by alpha / rank")
    dropout: float = setting(0.0, "dropout on each adapter's input, in training")
    targets: tuple[LoraTarget, ...] = setting(
        ("attention",),
        "the layers adapted, in the encoder and the decoder: attention (every attention projection: self_attention "
        "and cross_attention, each its q, k, v and out projections), ffn (ffn_up and ffn_down), or single "
        "projections such as self_q, self_v, cross_q, cross_out",
    )

    def __post_init__(self) -> None:
        check_choices(self, "train.lora")
        check(self.rank >= 0, f"train.lora.rank must be >= 0 (0: no LoRA), got {self.rank}")
        check(self.alpha > 0, f"train.lora.alpha must be > 0, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, f"train.lora.dropout must be in [0, 1), got {self.dropout}")
        check(not self.rank or bool(self.targets), "train.lora.targets is empty: name the layers to adapt")


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = setting(10_000, "optimizer updates")
    max_epochs: int = setting(0, "0: no epoch limit")
    batch_tokens: int = setting(4096, "padded tokens per side per batch (per accumulation step)")
    accum: int = setting(1, "batches accumulated per update: effective batch = batch_tokens * accum")
    lr: float = setting(1e-3, "peak learning rate, reached at the end of warm-up")
    warmup: int = setting(4000, "linear warm-up steps, then the decay train.schedule names")
    schedule: Literal["inverse_sqrt", "constant", "linear"] = setting(
        "inverse_sqrt",
        "the learning rate after warm-up: inverse_sqrt decays as 1 / sqrt(update) (Vaswani et al., 2017); constant "
        "stays at train.lr; linear falls to 0 at train.max_steps, usual for fine-tuning a trained model",
    )
    label_smoothing: float = setting(0.1, "loss mass spread uniformly over the vocabulary (Szegedy et al., 2016)")
    clip_norm: float = setting(1.0, "global gradient-norm bound; 0 disables clipping")
    weight_decay: float = setting(0.0, "Adam's L2 penalty, added to the gradients (not decoupled as in AdamW)")
    precision: Precision = setting(
        "auto",
        "bf16 where native (CPU with AVX512-BF16/AMX-BF16, GPU), else fp32; fp16: GPU only",
    )
    seed: int = setting(1, "initial weights, dropout masks and batch order")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto picks cuda when available")
    threads: int = setting(0, "CPU threads for torch; 0 keeps torch's default")
    valid_every: int = setting(1000, "validation (loss + BLEU) cadence in updates; 0 validates only at the end")
    save_every: int = setting(1000, "checkpoint cadence in updates; the last checkpoint is also saved at the end")
    log_every: int = setting(100, "metrics line cadence in updates")
    valid_beam: int = setting(5, "beam size for validation BLEU")
    valid_bleu: bool = setting(True, "decode the validation set for BLEU (loss is always computed)")
    valid_comet: str = setting(
        "",
        "a COMET model to score each validation's translations with as well: comet (Unbabel/wmt22-comet-da), "
        "cometkiwi (Unbabel/wmt22-cometkiwi-da, without references), another Hub id, or a folder laid out as a Hub "
        "COMET repository; loaded once per run on the training device and run in fp32, it logs valid_comet. "
        '"": none',
    )
    best_metric: Literal["bleu", "loss", "comet"] = setting(
        "bleu", "what RUN/best/ and early stopping follow; comet needs train.valid_comet"
    )
    patience: int = setting(0, "stop after this many validations without a new best; 0 never stops early")
    max_time: float = setting(0.0, "wall-clock budget in minutes, summed over resumed runs; 0 is no limit")
    keep_last: int = setting(
        5,
        "periodic checkpoints kept in RUN_DIR/checkpoints (for resuming and averaging); 0 keeps all",
    )
    nonfinite: Literal["rollback", "skip", "stop"] = setting(
        "rollback",
        "fp32/bf16 non-finite loss or gradient: rollback (to the last checkpoint), skip, stop",
    )
    max_rollbacks: int = setting(3, "rollbacks allowed before training stops")
    rollback_lr_factor: float = setting(0.5, "each rollback multiplies the learning rate by this")
    ddp_timeout: float = setting(
        1800.0,
        "seconds a collective may wait for the other ranks (incl. rank 0's validation)",
    )
    compile: bool = setting(False, "torch.compile the encoder-decoder for training")
    prefetch: int = setting(
        2,
        "updates whose batches a background thread makes ahead (in pinned memory for a GPU); 0 makes each batch in "
        "the training loop when its turn comes. The batches and their order are the same either way",
    )
    pad_to_multiple: int = setting(
        1,
        "padded batch lengths rounded up to a multiple of this (within model.max_positions) and batch rows padded to "
        "what train.batch_tokens holds, so that train.compile compiles each of a bounded set of shapes once (8 suits "
        "tensor cores; a larger multiple, fewer shapes); 1 pads to each batch's longest sentence, and train.compile "
        "compiles once for symbolic sizes. Batches are cut by the rounded lengths; each one's loss is what it is "
        "without the extra padding, which is masked. Changed in a resumed run, as train.batch_tokens, it cuts the "
        "rest of the epoch's batches differently",
    )
    tensorboard: bool = setting(False, "also write TensorBoard event files to RUN_DIR/tensorboard")
    init_from: str = setting(
        "",
        "a trained model to start from (fine-tuning): a run directory (its best/), a checkpoint folder or an "
        "averaged .safetensors file with its tokenizer(s) beside it, or hf:SOURCE, a transformers Marian, NLLB-200 or "
        "M2M100 model (a folder or a Hub id such as Helsinki-NLP/opus-mt-en-de or facebook/nllb-200-distilled-600M) "
        "imported into RUN_DIR/imported as `mtkit import hf` "
        "does. The run takes its architecture and tokenizers; optimizer, schedule and data position start afresh. "
        'Read only while the run has no checkpoint; "": random weights',
    )
    freeze: tuple[FreezeGroup, ...] = setting(
        (),
        "parts of the model kept at their values (requires_grad off, out of the optimizer): embeddings (token and "
        "learned position embeddings, and the output projection when it is tied to them), encoder, decoder (with an "
        "untied output projection)",
    )
    lora: LoraConfig = setting(
        LoraConfig(),
        "LoRA: low-rank adapters trained on a frozen train.init_from model instead of its weights (its keys: "
        "train.lora below); rank 0, the default, trains the model itself",
    )

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {
        "MAX_BEAM": ("valid_beam",),
        "MAX_BATCH_TOKENS": ("batch_tokens",),
        "MAX_PREFETCH": ("prefetch",),
        "MAX_PAD_MULTIPLE": ("pad_to_multiple",),
    }

    def __post_init__(self) -> None:
        check_choices(self, "train")
        check(
            not set(typing.get_args(FreezeGroup)) <= set(self.freeze),
            "train.freeze lists every part of the model: nothing would train",
        )
        for name in ("max_steps", "batch_tokens", "accum", "valid_beam", "log_every"):
            check(getattr(self, name) >= 1, f"train.{name} must be >= 1")
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
            check(getattr(self, name) >= 0, f"train.{name} must be >= 0")
        check(self.valid_beam <= MAX_BEAM, f"train.valid_beam must be at most {MAX_BEAM:,}, got {self.valid_beam:,}")
        check(
            self.batch_tokens <= MAX_BATCH_TOKENS,
            f"train.batch_tokens must be at most {MAX_BATCH_TOKENS:,}, got {self.batch_tokens:,}",
        )
        check(self.max_rollbacks >= 0, "train.max_rollbacks must be >= 0")
        check(self.prefetch <= MAX_PREFETCH, f"train.prefetch must be at most {MAX_PREFETCH}")
        check(
            0 <= self.pad_to_multiple <= MAX_PAD_MULTIPLE,
            f"train.pad_to_multiple must be between 0 and {MAX_PAD_MULTIPLE}",
        )
        check(0.0 < self.rollback_lr_factor <= 1.0, "train.rollback_lr_factor must be in (0, 1]")
        check(self.ddp_timeout > 0, "train.ddp_timeout must be > 0")
        check(self.lr > 0, "train.lr must be > 0")
        check(self.max_time >= 0, "train.max_time must be >= 0")
        check(
            self.best_metric != "bleu" or self.valid_bleu,
            "train.best_metric bleu needs train.valid_bleu: true (or use best_metric: loss)",
        )
        check(
            self.best_metric != "comet" or bool(self.valid_comet),
            "train.best_metric comet needs train.valid_comet, the COMET model to score with (e.g. comet)",
        )
        check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing must be in [0, 1)")
        check(self.clip_norm >= 0 and self.weight_decay >= 0, "train.clip_norm and train.weight_decay must be >= 0")
        if self.lora.rank:
            check(bool(self.init_from), "train.lora needs train.init_from: the trained model the adapters adapt")
            check(
                not self.freeze,
                "train.lora holds the whole base model still and trains its adapters alone: leave train.freeze out",
            )
