"""The configuration's tree: ``RunConfig``, its sections by the YAML key that holds each, and the settings
commands take as options rather than from a run's YAML file."""

from dataclasses import asdict, dataclass, field
from typing import Any

from mtkit.config.checks import check
from mtkit.config.data import CleanConfig, DataConfig, TokenizerConfig
from mtkit.config.decoding import DecodeConfig, ServeConfig
from mtkit.config.model import ModelConfig
from mtkit.config.training import TrainConfig
from mtkit.config.workflows import BackTranslationConfig, DistillationConfig, PairFilterConfig, RecipeConfig


@dataclass(frozen=True)
class RunConfig:
    """A run's whole configuration, as its config.yaml and its checkpoints' headers hold it."""

    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    backtranslation: BackTranslationConfig = field(default_factory=BackTranslationConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    pair_filter: PairFilterConfig = field(default_factory=PairFilterConfig)

    def __post_init__(self) -> None:
        check(
            not self.pair_filter.enabled or self.distillation.enabled or bool(self.backtranslation.monolingual),
            "pair_filter filters the pairs of a distillation or back-translation: this config has neither",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
    "recipe": RecipeConfig,
    "backtranslation": BackTranslationConfig,
    "distillation": DistillationConfig,
    "pair_filter": PairFilterConfig,
}

# Settings given as command-line options rather than in a run's YAML file, by the command that takes them.
COMMAND_OPTIONS: dict[str, type] = {"mtkit prepare": CleanConfig, "mtkit serve": ServeConfig}
