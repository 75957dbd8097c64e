"""Configuration: typed sections (dataclasses holding every default once, each setting with its help text),
presets and bounds, read from YAML plus ``--set`` overrides; ``python -m mtkit.config.docs`` writes
docs/config.md from them.

A leaf. Imports: the leaves mtkit.errors and mtkit.untrusted (and PyYAML).
"""

from mtkit.config.bounds import (
    MAX_BATCH_TOKENS,
    MAX_BEAM,
    MAX_CORPORA,
    MAX_LANGUAGES,
    MAX_LAYERS,
    MAX_LENPEN,
    MAX_PAD_MULTIPLE,
    MAX_PER_SOURCE,
    MAX_POSITIONS,
    MAX_PREFETCH,
    MAX_TEACHERS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
)
from mtkit.config.checks import ConfigError
from mtkit.config.data import LANGUAGE_CODE, CleanConfig, CorpusConfig, DataConfig, SpmType, TokenizerConfig
from mtkit.config.decoding import (
    DecodeConfig,
    Engine,
    InferenceConfig,
    InferencePrecision,
    LengthPenalty,
    SamplingConfig,
    ServeConfig,
    ShortlistConfig,
)
from mtkit.config.model import PRESETS, ModelConfig, Preset
from mtkit.config.reader import apply_override, config_yaml, from_dict, read_config
from mtkit.config.schema import SECTIONS, RunConfig
from mtkit.config.training import FreezeGroup, LoraConfig, LoraTarget, Precision, TrainConfig
from mtkit.config.workflows import BackTranslationConfig, DistillationConfig, PairFilterConfig, RecipeConfig

__all__ = [
    "LANGUAGE_CODE",
    "MAX_BATCH_TOKENS",
    "MAX_BEAM",
    "MAX_CORPORA",
    "MAX_LANGUAGES",
    "MAX_LAYERS",
    "MAX_LENPEN",
    "MAX_PAD_MULTIPLE",
    "MAX_PER_SOURCE",
    "MAX_POSITIONS",
    "MAX_PREFETCH",
    "MAX_TEACHERS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "PRESETS",
    "SECTIONS",
    "BackTranslationConfig",
    "CleanConfig",
    "ConfigError",
    "CorpusConfig",
    "DataConfig",
    "DecodeConfig",
    "DistillationConfig",
    "Engine",
    "FreezeGroup",
    "InferenceConfig",
    "InferencePrecision",
    "LengthPenalty",
    "LoraConfig",
    "LoraTarget",
    "ModelConfig",
    "PairFilterConfig",
    "Precision",
    "Preset",
    "RecipeConfig",
    "RunConfig",
    "SamplingConfig",
    "ServeConfig",
    "ShortlistConfig",
    "SpmType",
    "TokenizerConfig",
    "TrainConfig",
    "apply_override",
    "config_yaml",
    "from_dict",
    "read_config",
]
