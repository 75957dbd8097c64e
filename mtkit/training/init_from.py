"""train.init_from: a run that starts from a trained model's weights and tokenizers (fine-tuning).

The model is a run directory (its best/), a checkpoint folder or an averaged .safetensors file with its
tokenizer(s) beside it. The run takes the model's architecture (model.*) and its tokenizers (tokenizer.*,
copied into RUN/ and never trained); its optimizer, schedule and data position start afresh. A key of
those sections that the config sets to other than its default must agree with the model, except the
dropouts, which are training settings; tokenizer model files are compared by content, and
tokenizer.vocab_size with the pieces of the model's tokenizer(s). A key left at its default takes the
model's value, so a key set to its default value cannot be told from one left out.

``hf:SOURCE`` names a transformers MarianMTModel or M2M100ForConditionalGeneration folder or Hub repository (an
OPUS-MT, NLLB-200 or M2M100 model), as
`mtkit import hf SOURCE` takes it: the run imports it into RUN/imported/, then starts from that. Each start
before the run's first checkpoint imports it anew, since an import an earlier start left there may be of
another model (train.init_from changed, or the folder did).

The model is read only while the run has no checkpoint. Once it has one, the same rules settle the
config against the run's newest checkpoint, so the config that started a run resumes it, even if the
model it started from has since changed or gone; but for a LoRA run (train.lora), whose checkpoints hold its
adapters alone, and which reads its base again from the path it recorded (adapters.py).

A LoRA run as the model to start from stands for its base with its adapter merged: a run without train.lora
trains all of that model's weights.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mtkit.config import ConfigError, DataConfig, RunConfig, TokenizerConfig
from mtkit.data.tokenizer import Tokenizer
from mtkit.files import file_sha256
from mtkit.interop.export_folder import MANIFEST
from mtkit.interop.hf_import import import_hf
from mtkit.model.checkpoint import (
    WEIGHTS_FILE,
    Checkpoint,
    CheckpointError,
    find_tokenizer,
    read_checkpoint,
    weights_file,
)
from mtkit.model.loading import is_adapted, load_for_inference, resolve
from mtkit.model.run_folder import IMPORTED_DIR
from mtkit.untrusted import shown

log = logging.getLogger("mtkit")

TRAINING_SETTINGS = ("dropout", "attention_dropout", "activation_dropout")  # model.* keys a run may change
LANGUAGE_SETTINGS = ("languages", "language_token")  # data.* keys a run takes from the model it starts from
TOKENIZER_FILES = ("model", "src_model", "tgt_model")  # tokenizer.* keys naming files: compared by content
HF_PREFIX = "hf:"  # train.init_from: hf:SOURCE, a Marian model to import first


@dataclass
class InitialModel:
    """The model a run starts from, and the config it is settled against: the model's, whose tokenizer models
    are the files found beside it (checked against its header) and whose vocab_size is theirs."""

    checkpoint: Checkpoint
    cfg: RunConfig
    record: dict[str, str]  # what the run's checkpoints and metrics.jsonl say of it: its weights file and SHA-256


def import_once(init_from: str, run_dir: Path, afresh: bool = False) -> Path:
    """The mtkit model train.init_from names: the path as given, or for ``hf:SOURCE`` its import in RUN/imported/,
    made if there is none, or ``afresh`` (the Hub's files are downloaded into huggingface_hub's cache)."""
    if not init_from.startswith(HF_PREFIX):
        return Path(init_from)
    target = Path(run_dir) / IMPORTED_DIR
    if afresh:
        shutil.rmtree(target, ignore_errors=True)
    if not (target / WEIGHTS_FILE).is_file():
        import_hf(init_from[len(HF_PREFIX) :], target)
    return target


def read_initial_model(model: Path) -> InitialModel:
    """The model train.init_from names, read whole; CheckpointError for a path mtkit cannot start training from."""
    ckpt, cfg = read_trained_model(model)
    weights = weights_file(ckpt.path).resolve()
    log.info("starting from the weights of %s (train.init_from)", weights)
    record = {"path": str(weights), "sha256": file_sha256(weights)}
    return InitialModel(ckpt, cfg, record)


def read_trained_model(model: Path) -> tuple[Checkpoint, RunConfig]:
    """A trained model (run directory, checkpoint or averaged .safetensors) read without its training state, and its
    config whose tokenizer models are the files found beside it (checked against its header) and whose vocab_size
    is theirs; CheckpointError for an export or anything else mtkit cannot read as a model."""
    model = Path(model)
    if (model / MANIFEST).is_file():
        raise CheckpointError(
            f"{model}: an export (`mtkit export`, for CTranslate2 or transformers), which mtkit cannot train; "
            "set train.init_from to the run, checkpoint or .safetensors file it was exported from"
        )
    ckpt = read_checkpoint(resolve(model), with_state=False)
    if is_adapted(ckpt):  # a LoRA run: the model it stands for, its adapter merged into its base (in float32)
        merged = load_for_inference(ckpt.path, torch.device("cpu"), merge=True).model
        ckpt = replace(ckpt, weights=merged.state_dict())
    where = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    found = {side: find_tokenizer(r, where, ckpt.path.name).resolve() for side, r in ckpt.meta["tokenizer"].items()}
    tc = ckpt.cfg.tokenizer
    files = {"model": found["src"]} if tc.joint else {"src_model": found["src"], "tgt_model": found["tgt"]}
    sizes = {Tokenizer(path).vocab_size for path in found.values()}
    # what the tokenizers hold, not what the config asked of tokenizer training (unused when a model was given)
    vocab_size = sizes.pop() if len(sizes) == 1 else tc.vocab_size
    tokenizer = replace(tc, vocab_size=vocab_size, **{key: str(path) for key, path in files.items()})
    return ckpt, replace(ckpt.cfg, tokenizer=tokenizer)


def settle_config(cfg: RunConfig, theirs: RunConfig, records: dict[str, Any], source: str) -> RunConfig:
    """``cfg`` with the model and tokenizer sections of the model it starts from (or of the checkpoint it resumes
    from), and the languages it is told by tokens (data.languages, data.language_token: an imported NLLB-200 or
    M2M100): ``theirs`` is that model's config, ``records`` its tokenizer records (file and SHA-256 by side),
    ``source`` how errors name it.

    ConfigError, in one line naming the key and both values, for a key that disagrees.
    """
    model = _agreed("model", cfg.model, theirs.model, source, changeable=TRAINING_SETTINGS)
    for key in LANGUAGE_SETTINGS:
        mine, their = getattr(cfg.data, key), getattr(theirs.data, key)
        if mine and mine != their:
            raise ConfigError(
                f"data.{key} is {shown(mine)} in this config but {shown(their)} in {source}: the model reads its "
                f"languages as it was trained to; leave data.{key} out"
            )
    data = replace(cfg.data, **{key: getattr(theirs.data, key) for key in LANGUAGE_SETTINGS})
    _check_languages(data, source)
    tokenizer = settle_tokenizer(cfg.tokenizer, theirs.tokenizer, records, source)
    return replace(cfg, model=model, tokenizer=tokenizer, data=data)


def _check_languages(data: DataConfig, source: str) -> None:
    """The languages a run trains on are among those ``source`` is told by tokens (data.languages), if it is."""
    if not data.languages:
        return
    named = [(f"data.corpora[{i}].", c) for i, c in enumerate(data.corpora)] or [("data.", data)]
    for prefix, section in named:
        for key in ("src_lang", "tgt_lang"):
            code = getattr(section, key)
            if code not in data.languages:
                shown_codes = ", ".join(data.languages[:8]) + (", ..." if len(data.languages) > 8 else "")
                raise ConfigError(
                    f"{prefix}{key} is {shown(code)}, which is not one of the {len(data.languages):,} languages "
                    f"{source} is told by tokens ({shown_codes})"
                )


def settle_tokenizer(
    mine: TokenizerConfig,
    theirs: TokenizerConfig,
    records: dict[str, Any],
    source: str,
    keeps: str = "a run that starts from a model keeps its tokenizer settings",
) -> TokenizerConfig:
    """The tokenizer section of a run that must use the tokenizers of ``source`` (whose config section is ``theirs``
    and tokenizer records ``records``): theirs, where ``mine`` leaves a key at its default; ConfigError, in one line
    saying that the run ``keeps`` them, for a key or tokenizer file that disagrees."""
    _check_tokenizer_files(mine, theirs.joint, records, source)
    unnamed = replace(mine, **dict.fromkeys(TOKENIZER_FILES, ""))  # the files were compared by content
    return _agreed("tokenizer", unnamed, theirs, source, keeps=keeps)


def _agreed(
    section: str,
    mine: Any,
    theirs: Any,
    source: str,
    changeable: tuple[str, ...] = (),
    keeps: str = "",
) -> Any:
    """A config section whose every key is ``theirs``, unless ``mine`` sets it (to other than the default) and it is
    ``changeable``; ConfigError for any other key ``mine`` sets to another value."""
    keeps = keeps or f"a run that starts from a model keeps its {section} settings"
    defaults = type(mine)()
    values = {}
    for f in dataclasses.fields(mine):
        my, their = getattr(mine, f.name), getattr(theirs, f.name)
        if my == their or my == getattr(defaults, f.name):
            values[f.name] = their
        elif f.name in changeable:
            values[f.name] = my
        else:
            raise ConfigError(
                f"{section}.{f.name} is {shown(my)} in this config but {shown(their)} in {source}: {keeps}; "
                f"leave {section}.{f.name} out"
            )
    return type(mine)(**values)


def _check_tokenizer_files(mine: TokenizerConfig, joint: bool, records: dict[str, Any], source: str) -> None:
    """A tokenizer model the config names must be the very one ``source`` was trained with (by its SHA-256)."""
    sides = {"model": "src"} if joint else {"src_model": "src", "tgt_model": "tgt"}
    for key in TOKENIZER_FILES:
        given = getattr(mine, key)
        if not given:
            continue
        if key not in sides:
            has = "one joint tokenizer" if joint else "a source and a target tokenizer (tokenizer.joint: false)"
            raise ConfigError(f"tokenizer.{key} is set, but {source} has {has}; leave tokenizer.{key} out")
        record = records[sides[key]]
        if file_sha256(Path(given)) != record["sha256"]:
            raise ConfigError(
                f"tokenizer.{key} {given} is another vocabulary than {source} was trained with "
                f"(its {record['file']}); leave tokenizer.{key} out to take the model's"
            )
