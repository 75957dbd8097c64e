"""Config loading: presets, overrides, and loud failures for typos and bad values."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

from mtkit import config
from mtkit.config import (
    PRESETS,
    SECTIONS,
    ConfigError,
    ModelConfig,
    Preset,
    TrainConfig,
    config_yaml,
    from_dict,
    read_config,
)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    from mtkit.data.corpora import CORPORA

    cfg = read_config(recipe)
    if cfg.data.corpora:  # each corpus names its catalogue corpus, of its languages, or a folder a data script writes
        assert not cfg.recipe.corpus
        for item in cfg.data.corpora:
            if item.corpus:
                corpus = CORPORA[item.corpus]
                assert (corpus.src_lang, corpus.tgt_lang) == (item.src_lang, item.tgt_lang)
            else:
                assert item.prepared.startswith("data/") and cfg.backtranslation.monolingual.startswith("data/")
    else:
        corpus = CORPORA[cfg.recipe.corpus]
        assert (corpus.src_lang, corpus.tgt_lang) == (cfg.data.src_lang, cfg.data.tgt_lang)
    assert cfg.recipe.expected and cfg.recipe.hardware and 0 < cfg.recipe.bleu_min < cfg.recipe.bleu_max
    # The machine decides the precision, and the updates the budget, so that a score does not depend on the CPU.
    assert cfg.train.precision == "auto" and cfg.train.max_time == 0


def test_preset_sets_defaults_and_explicit_keys_win():
    cfg = from_dict({"model": {"preset": "transformer-big", "dropout": 0.2}})
    assert (cfg.model.d_model, cfg.model.heads, cfg.model.ffn) == (1024, 16, 4096)
    assert cfg.model.dropout == 0.2
    assert from_dict({"model": {"preset": "transformer-base"}}).model.d_model == PRESETS["transformer-base"]["d_model"]


def test_model_defaults_are_the_default_presets():
    """A ModelConfig built directly has the sizes a config without model keys gets from the preset."""
    defaults = ModelConfig()
    assert {key: getattr(defaults, key) for key in PRESETS[defaults.preset]} == PRESETS[defaults.preset]
    assert from_dict({}).model == defaults


def test_overrides_are_typed_and_apply_to_any_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.001\n")
    cfg = read_config(
        path,
        [
            "train.lr=5e-4",
            "train.max_steps=20",
            "model.norm=pre",
            "tokenizer.joint=false",
            "model.tie_embeddings=false",
        ],
    )
    assert cfg.train.lr == 5e-4 and cfg.train.max_steps == 20
    assert cfg.model.norm == "pre" and cfg.tokenizer.joint is False


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"train": {"lrr": 1}}, "unknown config key train.lrr"),
        ({"trian": {}}, "unknown config section 'trian'"),
        ({"train": {"lr": "fast"}}, "train.lr must be of type float"),
        ({"train": {"max_steps": 1.5}}, "train.max_steps must be of type int"),
        ({"train": {"lr": -1}}, "train.lr must be > 0"),
        ({"model": {"d_model": 100, "heads": 3}}, "divisible"),
        ({"model": {"preset": "huge"}}, "model.preset must be one of"),
        ({"train": {"precision": "fp8"}}, "train.precision"),
        ({"train": {"valid_bleu": False}}, "best_metric bleu needs train.valid_bleu"),
        ({"train": {"best_metric": "chrf"}}, "train.best_metric must be one of bleu, loss, comet, got 'chrf'"),
        ({"train": {"precision": 16}}, "train.precision must be one of auto, fp32, bf16, fp16, got 16"),
    ],
)
def test_bad_keys_and_values_are_named(raw, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


CHOICES = {
    f"{section}.{f.name}": typing.get_args(hint)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if typing.get_origin(hint := typing.get_type_hints(cls)[f.name]) is Literal
}


def test_settings_with_a_fixed_set_of_values_are_literals():
    assert set(CHOICES) == {
        "tokenizer.type",
        "model.preset",
        "model.norm",
        "model.activation",
        "model.positions",
        "model.decoder_start",
        "train.precision",
        "train.device",
        "train.nonfinite",
        "train.best_metric",
        "train.schedule",
        "decode.length_penalty",
        "backtranslation.method",
    }
    assert set(PRESETS) == set(typing.get_args(Preset))


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_value_outside_the_choices_names_the_key_and_the_choices(tmp_path, key):
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: nope\n")
    message = f"{path}:2: {key} must be one of {', '.join(CHOICES[key])}, got 'nope'"
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_config(path)


def test_choices_are_checked_when_a_section_is_built_in_python():
    with pytest.raises(ConfigError, match=re.escape("model.norm must be one of post, pre, got 'mid'")):
        ModelConfig(norm="mid")
    with pytest.raises(ConfigError, match=re.escape("train.freeze[0] must be one of embeddings, encoder, decoder")):
        TrainConfig(freeze=("all",))


def test_a_list_of_choices_comes_from_yaml_or_set_and_each_item_is_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  freeze: [embeddings, encoder]\n")
    cfg = read_config(path, ["train.init_from=runs/base"])
    assert cfg.train.freeze == ("embeddings", "encoder")
    assert from_dict(yaml.safe_load(config_yaml(cfg))) == cfg  # as config.yaml and a checkpoint header hold it
    assert read_config(None, ["train.freeze=[decoder]"]).train.freeze == ("decoder",)
    assert read_config(None, ["train.freeze=[]"]).train.freeze == ()
    refused = {
        "train.freeze=[encoder, all]": "--set train.freeze=[encoder, all]: train.freeze[1] must be one of embeddings, "
        "encoder, decoder, got 'all'",
        "train.freeze=encoder": "train.freeze must be a list of embeddings, encoder, decoder (YAML: [a, b]), "
        "got 'encoder'",
        "train.freeze=[decoder, encoder, embeddings]": "train.freeze lists every part of the model",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_config(None, [override])


# Each size a setting may ask of a search, with the bound in mtkit.config that every source of settings passes
# (a flag, a config, a checkpoint header, an export's mtkit.json).
SIZE_BOUNDS = {
    "decode.beam": "MAX_BEAM",
    "decode.lenpen": "MAX_LENPEN",
    "decode.max_len_a": "MAX_POSITIONS",
    "decode.max_len_b": "MAX_POSITIONS",
    "decode.min_len": "MAX_POSITIONS",
    "decode.batch_size": "MAX_BATCH_TOKENS",
    "decode.batch_tokens": "MAX_BATCH_TOKENS",
    "train.valid_beam": "MAX_BEAM",
    "train.batch_tokens": "MAX_BATCH_TOKENS",
}


@pytest.mark.parametrize("key, bound", SIZE_BOUNDS.items(), ids=list(SIZE_BOUNDS))
def test_a_size_is_taken_up_to_its_bound_and_refused_beyond_it(tmp_path, key, bound):
    """decode.beam 1000000000 in a checkpoint header or an export once had the kernel kill the process."""
    section, name = key.split(".")
    limit = getattr(config, bound)
    assert getattr(getattr(from_dict({section: {name: limit}}), section), name) == limit
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {limit + 1}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: {key} must be at most {limit:,}")):
        read_config(path)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        read_config(None, ["lr=3"])
    with pytest.raises(ConfigError, match="config file not found"):
        read_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_config(bad)
