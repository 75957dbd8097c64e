"""Finding and reading a COMET model as untrusted files: where they come from, hparams.yaml, the encoder's
config.json and tokenizer, and the checkpoint's state dict.

A model is a folder laid out as unbabel-comet's Hub repositories are (hparams.yaml, checkpoints/model.ckpt),
given by its path or by a Hub id that huggingface_hub downloads (those two files only) at a revision into its
cache, offline when HF_HUB_OFFLINE says so. hparams.yaml's ``pretrained_model`` names the XLM-R encoder whose
config.json and tokenizer files are read (never its weights: the checkpoint holds them): a Hub id fetched the
same way, or a folder inside the model's own. No file is followed through a link out of the folder it belongs
to, and of the tokenizer only the files that define it are read (tokenizer_config.json, which could name any
other file, is not). Every hyper-parameter is checked, and one the native network does not implement is refused
by name. The checkpoint is read with ``weights_only``, its size bounded by the network the config describes, and
its tensors' names and shapes checked against that network before anything is built from them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mtkit import untrusted
from mtkit.config.reader import parse_yaml
from mtkit.errors import MtkitError
from mtkit.hub_folders import cache_snapshot, check_inside
from mtkit.model.checkpoint import CheckpointError, UnreadableCheckpoint, load_torch_file
from mtkit.scoring.comet_model import ACTIVATIONS, POOLS, CometConfig

HPARAMS = "hparams.yaml"
CHECKPOINT = "checkpoints/model.ckpt"
ENCODER_CONFIG = "config.json"
# The tokenizer's vocabulary (either file defines it: xlm-roberta-large ships both, microsoft/infoxlm-large only the
# SentencePiece model) and its special tokens.
VOCABULARY_FILES = ("tokenizer.json", "sentencepiece.bpe.model")
TOKENIZER_FILES = (*VOCABULARY_FILES, "special_tokens_map.json")
MAX_HPARAMS_BYTES = 64 << 10  # unbabel-comet's hparams.yaml hold about 40 short values
MAX_CONFIG_BYTES = 1 << 20  # an XLM-R config.json is under 1 KiB
MAX_TOKENIZER_BYTES = 64 << 20  # XLM-R's tokenizer.json is 17 MB, its SentencePiece model 5 MB
# A checkpoint may hold Adam's two moments per weight beside the weights (a Lightning checkpoint left unstripped).
CHECKPOINT_WEIGHT_COPIES = 3
CHECKPOINT_SLACK_BYTES = 16 << 20  # the pickled header: hyper-parameters, loop and callback states
# Bounds on the encoder a config.json may describe (XLM-R XXL, the largest, has 48 layers of width 4096).
ENCODER_BOUNDS = {
    "vocab_size": (1, 1 << 20),
    "hidden_size": (1, 8192),
    "num_hidden_layers": (1, 96),
    "num_attention_heads": (1, 128),
    "intermediate_size": (1, 65536),
    "max_position_embeddings": (8, 16384),
    "type_vocab_size": (1, 16),
}
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "relu")
MAX_HEAD_LAYERS = 8
MAX_HEAD_WIDTH = 65536
CLASSES = {"regression_metric": "regression", "unified_metric": "unified"}
# The defaults of unbabel-comet 2.2.7's two classes, which fill what a checkpoint leaves out.
DEFAULTS: dict[str, dict[str, Any]] = {
    "regression": {
        "layer": "mix",
        "layer_transformation": "softmax",
        "layer_norm": True,
        "pool": "avg",
        "pretrained_model": "xlm-roberta-large",
    },
    "unified": {
        "sent_layer": "mix",
        "layer_transformation": "sparsemax",
        "layer_norm": True,
        "pretrained_model": "microsoft/infoxlm-large",
        "input_segments": ["mt", "src", "ref"],
        "word_level_training": False,
    },
}
COMMON_DEFAULTS = {
    "encoder_model": "XLM-RoBERTa",
    "hidden_sizes": [3072, 1024],
    "activations": "Tanh",
    "final_activation": None,
    "dropout": 0.1,
}
# Options of training alone, which leave the network as it is: any value is accepted and none is used.
TRAINING_ONLY = {
    "nr_frozen_epochs", "keep_embeddings_frozen", "optimizer", "warmup_steps", "encoder_learning_rate",
    "learning_rate", "layerwise_decay", "loss", "batch_size", "train_data", "validation_data",
    "load_pretrained_weights", "local_files_only", "loss_lambda", "error_labels", "cross_entropy_weights",
    "word_weights", "word_layer", "class_identifier",
}  # fmt: skip
UNIFIED_IGNORED = {"layer", "pool"}  # the base class's, which the unified class never reads
# Encoder buffers that transformers before 4.31 saved in state dicts and later versions make again.
LEGACY_BUFFERS = ("encoder.model.embeddings.position_ids", "encoder.model.embeddings.token_type_ids")
_HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")


class CometFileError(MtkitError, ValueError):
    """A COMET model that cannot be found or read as given; the message names the file and the field."""


@dataclass(frozen=True)
class ModelSource:
    """Where a COMET model's files are, what its signature calls it, and where their links may lead."""

    folder: Path
    model_id: str  # the Hub id, or a local folder's name
    revision: str  # the commit the Hub snapshot resolved to, or "local"
    roots: tuple[Path, ...]  # the folders a file (or the link it is) may lie in
    cache_dir: Path | None


# -- finding the files ----------------------------------------------------------------------


def locate(model: str, revision: str | None, cache_dir: Path | None) -> ModelSource:
    """A local folder, else a Hub id downloaded at ``revision`` (hparams.yaml and the checkpoint only)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CometFileError(f"{model}: a revision applies to Hub repositories, and this is a local folder")
        cached = cache_snapshot(path)
        if cached is not None:
            return ModelSource(path, cached[0], path.resolve().name, _snapshot_roots(path.resolve()), cache_dir)
        return ModelSource(path, path.resolve().name, "local", (path,), cache_dir)
    if not _HUB_ID.fullmatch(model) or "/" not in model or ".." in model:
        raise CometFileError(f"{model}: no such folder, nor a Hub repository id (OWNER/NAME), nor comet or cometkiwi")
    folder = download(model, revision, cache_dir, [HPARAMS, CHECKPOINT])
    return ModelSource(folder, model, folder.name, _snapshot_roots(folder), cache_dir)


def download(repo_id: str, revision: str | None, cache_dir: Path | None, files: list[str]) -> Path:
    """The snapshot of ``repo_id`` in huggingface_hub's cache holding ``files``; from the cache alone when
    HF_HUB_OFFLINE is set (read now, not when huggingface_hub was imported)."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=files, local_files_only=offline
        )
    except LocalEntryNotFoundError:
        where = "the Hugging Face cache" if cache_dir is None else f"the Hugging Face cache {cache_dir}"
        raise CometFileError(f"hf:{repo_id}: not in {where}, and the Hub cannot be reached (HF_HUB_OFFLINE?)") from None
    except HfHubHTTPError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CometFileError(f"hf:{repo_id}: {first}") from None
    except (ValueError, OSError) as err:  # a malformed id or revision, a full disk
        raise CometFileError(f"hf:{repo_id}: {err}") from None
    return Path(folder)


def _snapshot_roots(snapshot: Path) -> tuple[Path, ...]:
    """Where the files of a snapshot in huggingface_hub's cache lie: the snapshot, and the repository's blobs/,
    which its files link to."""
    return snapshot, snapshot.parent.parent / "blobs"


def model_file(source: ModelSource, name: str, folder: Path | None = None, limit: int | None = None) -> Path:
    """``folder/name`` (``folder``: the model's by default), present, inside the model's roots even through a link,
    and no larger than ``limit`` bytes."""
    path = (folder or source.folder) / name
    if not path.is_file():
        hint = "" if folder else f"; a COMET model folder holds {HPARAMS} and {CHECKPOINT}"
        raise CometFileError(f"{path}: not found{hint}")
    check_inside(path, source.roots, error=CometFileError)
    if limit is not None and path.stat().st_size > limit:
        raise CometFileError(f"{path}: {path.stat().st_size:,} bytes, more than the {limit:,} such a file may have")
    return path


def encoder_folder(source: ModelSource, pretrained_model: str, revision: str | None) -> tuple[Path, ModelSource]:
    """The folder of the encoder's config.json and tokenizer, and the source its files are checked against:
    a folder inside the model's own, or a Hub id whose config and tokenizer files are fetched (not its weights) at
    ``revision`` (None: its main branch)."""
    path = Path(pretrained_model)
    if path.is_absolute() or (source.folder / path).is_dir():
        folder = path if path.is_absolute() else source.folder / path
        real, inside = folder.resolve(), source.folder.resolve()
        if not real.is_relative_to(inside) or not folder.is_dir():
            raise CometFileError(
                f"{source.folder / HPARAMS}: pretrained_model {untrusted.shown_path(pretrained_model)} is not a folder "
                f"inside the model's folder {source.folder}; an encoder is read from there or from the Hub"
            )
        if revision is not None:
            raise CometFileError(
                f"{source.folder / HPARAMS}: an encoder revision applies to a Hub encoder, and this model's encoder is "
                f"its folder {untrusted.shown_path(pretrained_model)}"
            )
        return folder, source
    if not _HUB_ID.fullmatch(pretrained_model) or ".." in pretrained_model:
        raise CometFileError(
            f"{source.folder / HPARAMS}: pretrained_model {untrusted.shown_path(pretrained_model)} is neither a Hub id "
            "nor a folder inside the model's folder"
        )
    folder = download(pretrained_model, revision, source.cache_dir, [ENCODER_CONFIG, *TOKENIZER_FILES])
    return folder, ModelSource(folder, pretrained_model, folder.name, _snapshot_roots(folder), source.cache_dir)


def tokenizer_files(source: ModelSource, folder: Path) -> list[Path]:
    """The tokenizer files present in ``folder``, each checked to be the encoder's own and of bounded size, one of
    them defining the vocabulary."""
    present = [name for name in TOKENIZER_FILES if (folder / name).exists() or (folder / name).is_symlink()]
    if not set(VOCABULARY_FILES) & set(present):
        raise CometFileError(f"{folder}: no tokenizer.json or sentencepiece.bpe.model for the encoder's tokenizer")
    return [model_file(source, name, folder, MAX_TOKENIZER_BYTES) for name in present]


# -- hparams.yaml ---------------------------------------------------------------------------


def read_hparams(path: Path) -> dict[str, Any]:
    """hparams.yaml as a mapping of option names, read with the safe loader, aliases bounded."""
    try:
        value = parse_yaml(path.read_text(encoding="utf-8"))[0]
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CometFileError(f"{path}: not readable YAML ({str(err).splitlines()[0][:200]})") from None
    try:
        return untrusted.mapping(value, "hparams.yaml", required=("class_identifier",))
    except untrusted.Malformed as err:
        raise CometFileError(f"{path}: {err}") from None


def comet_config(hparams: dict[str, Any], overrides: dict[str, Any] | None, where: Path) -> tuple[CometConfig, str]:
    """The network ``hparams`` (hparams.yaml) describe, with what the checkpoint's own hyper-parameters
    (``overrides``) say in their place, as unbabel-comet builds it; and the encoder's ``pretrained_model``."""
    try:
        identifier = untrusted.one_of(hparams["class_identifier"], "class_identifier", CLASSES)
        kind = CLASSES[identifier]
        if overrides is not None and overrides.get("class_identifier", identifier) != identifier:
            raise untrusted.Malformed(
                f"class_identifier is {untrusted.shown(overrides['class_identifier'])} in the checkpoint, "
                f"{identifier} here"
            )
        options = {**COMMON_DEFAULTS, **DEFAULTS[kind], **hparams, **(overrides or {})}
        return _network(kind, options, hparams.get("layer_transformation")), _pretrained(options)
    except untrusted.Malformed as err:
        raise CometFileError(f"{where}: {err}") from None


def _network(kind: str, options: dict[str, Any], yaml_transformation: Any) -> CometConfig:
    known = (
        TRAINING_ONLY | set(COMMON_DEFAULTS) | set(DEFAULTS[kind]) | (UNIFIED_IGNORED if kind == "unified" else set())
    )
    unknown = [key for key in options if key not in known]
    if unknown:
        raise untrusted.Malformed(f"unknown option {untrusted.shown(unknown[0])}: not an option of {kind} COMET models")
    untrusted.one_of(options["encoder_model"], "encoder_model", ("XLM-RoBERTa",))
    layer = options[layer_field(kind)]
    if layer != "mix":
        layer = untrusted.integer(layer, layer_field(kind), 0, ENCODER_BOUNDS["num_hidden_layers"][1])
    # unbabel-comet mixes by softmax whatever is not "sparsemax"; it writes "sparsemax_patch" for models that
    # were trained so by mistake.
    transformation = untrusted.one_of(
        options["layer_transformation"], "layer_transformation", ("softmax", "sparsemax", "sparsemax_patch")
    )
    if yaml_transformation == "sparsemax_patch":
        transformation = "softmax"
    if not isinstance(options["layer_norm"], bool):
        raise untrusted.Malformed(f"layer_norm must be true or false, got {untrusted.shown(options['layer_norm'])}")
    dropout = untrusted.number(options["dropout"], "dropout")
    hidden = options["hidden_sizes"]
    if not isinstance(hidden, list) or not 1 <= len(hidden) <= MAX_HEAD_LAYERS:
        raise untrusted.Malformed(f"hidden_sizes must be a list of 1 to {MAX_HEAD_LAYERS} widths")
    widths = tuple(untrusted.integer(width, f"hidden_sizes[{i}]", 1, MAX_HEAD_WIDTH) for i, width in enumerate(hidden))
    final = options["final_activation"]
    if kind == "unified":
        segments = options["input_segments"]
        if segments != ["mt", "src"]:
            raise untrusted.Malformed(
                f"input_segments {untrusted.shown(segments)} is not implemented: only CometKiwi's [mt, src] is"
            )
        if options["word_level_training"] is not False:
            raise untrusted.Malformed("word_level_training is not implemented: only sentence scores are")
    return CometConfig(
        kind=kind,
        layer=None if layer == "mix" else layer,
        sparsemax=transformation == "sparsemax",
        layer_norm=options["layer_norm"],
        pool=untrusted.one_of(options["pool"], "pool", POOLS) if kind == "regression" else "cls",
        hidden_sizes=widths,
        activation=_activation(options["activations"], "activations"),
        final_activation=None if final is None else _activation(final, "final_activation"),
        mix_dropout=layer == "mix" and dropout != 0,
    )


def layer_field(kind: str) -> str:
    """The name of the option that chooses the hidden state scored: the two classes call it differently."""
    return "layer" if kind == "regression" else "sent_layer"


def check_layer(config: CometConfig, encoder_layers: int, where: Path) -> None:
    """A chosen hidden state must be one the encoder has: unbabel-comet refuses a layer of num_hidden_layers + 1 or
    more (0 is the embeddings)."""
    if config.layer is not None and config.layer > encoder_layers:
        raise CometFileError(
            f"{where}: {layer_field(config.kind)} is {config.layer}, and the encoder has hidden states 0 (its "
            f"embeddings) to {encoder_layers} (num_hidden_layers in its config.json)"
        )


def _activation(value: Any, field: str) -> str:
    """An activation's name as unbabel-comet reads it (title case: "tanh" is Tanh)."""
    return untrusted.one_of(value.title() if isinstance(value, str) else value, field, ACTIVATIONS)


def _pretrained(options: dict[str, Any]) -> str:
    name = untrusted.string(options["pretrained_model"], "pretrained_model")
    if not name or len(name) > 4096 or "\0" in name:
        raise untrusted.Malformed(f"pretrained_model must name a Hub id or a folder, got {untrusted.shown(name)}")
    return name


# -- the encoder's config.json ------------------------------------------------------------------


def encoder_config(path: Path) -> dict[str, Any]:
    """The XLM-R config.json's values the network is built from, each checked and bounded."""
    import json

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw = untrusted.mapping(raw, "config.json")
        if raw.get("model_type", "xlm-roberta") != "xlm-roberta":
            raise untrusted.Malformed(f"model_type must be xlm-roberta, got {untrusted.shown(raw['model_type'])}")
        values = {key: untrusted.integer(raw.get(key), key, low, high) for key, (low, high) in ENCODER_BOUNDS.items()}
        if values["hidden_size"] % values["num_attention_heads"]:
            raise untrusted.Malformed("hidden_size must be a multiple of num_attention_heads")
        values["pad_token_id"] = untrusted.integer(
            raw.get("pad_token_id", 1), "pad_token_id", 0, values["vocab_size"] - 1
        )
        values["layer_norm_eps"] = untrusted.number(raw.get("layer_norm_eps", 1e-5), "layer_norm_eps")
        values["hidden_act"] = untrusted.one_of(raw.get("hidden_act", "gelu"), "hidden_act", ENCODER_ACTIVATIONS)
        untrusted.one_of(raw.get("position_embedding_type", "absolute"), "position_embedding_type", ("absolute",))
        if raw.get("is_decoder", False) is not False:
            raise untrusted.Malformed("is_decoder must be false: COMET's encoder attends both ways")
    except (ValueError, RecursionError, UnicodeDecodeError) as err:  # JSON, UTF-8, nesting, or a Malformed value
        raise CometFileError(f"{path}: {str(err).splitlines()[0][:300]}") from None
    return values


# -- the checkpoint ---------------------------------------------------------------------------


def read_checkpoint(path: Path, expected: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The checkpoint's state dict, every tensor named and shaped as in ``expected`` (the network's, on the meta
    device) and finite, as float32; and its hyper-parameters, if it holds them. Refused unread when the file is
    larger than such a network's checkpoint can be."""
    weights = sum(tensor.numel() for tensor in expected.values()) * 4
    limit = CHECKPOINT_WEIGHT_COPIES * weights + CHECKPOINT_SLACK_BYTES
    if path.stat().st_size > limit:
        raise CometFileError(
            f"{path}: {path.stat().st_size:,} bytes, more than the {limit:,} a checkpoint of this network can have"
        )
    try:
        loaded = load_torch_file(path)
    except UnreadableCheckpoint:
        raise CometFileError(f"{path}: truncated or damaged, not a readable COMET checkpoint") from None
    except CheckpointError as err:
        raise CometFileError(str(err)) from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), dict):
        raise CometFileError(f"{path}: not a COMET checkpoint (no state_dict)")
    state = loaded["state_dict"]
    if not all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()):
        raise CometFileError(f"{path}: its state_dict must map names to tensors")
    for key in LEGACY_BUFFERS:
        legacy = state.pop(key, None)
        if legacy is not None and (legacy.dim() != 2 or legacy.size(0) != 1):
            raise CometFileError(f"{path}: {key} is {tuple(legacy.shape)}, not (1, positions)")
    missing = [key for key in expected if key not in state]
    extra = [key for key in state if key not in expected]
    if missing or extra:
        names = ", ".join([*(f"no {key}" for key in missing[:3]), *(f"an extra {key}" for key in extra[:3])])
        raise CometFileError(f"{path}: its tensors are not those of the network hparams.yaml describes ({names})")
    for key, tensor in expected.items():
        if state[key].shape != tensor.shape:
            raise CometFileError(
                f"{path}: {key} is {tuple(state[key].shape)}, and the network hparams.yaml and the encoder's "
                f"config.json describe needs {tuple(tensor.shape)}"
            )
        if not state[key].is_floating_point():
            raise CometFileError(f"{path}: {key} is {state[key].dtype}, not a floating-point tensor")
        if not bool(torch.isfinite(state[key]).all()):
            raise CometFileError(f"{path}: {key} holds NaN or infinite values; such a model scores nothing")
    hyper = loaded.get("hyper_parameters")
    if hyper is not None and not isinstance(hyper, dict):
        raise CometFileError(f"{path}: hyper_parameters must be a mapping, got {untrusted.shown(hyper)}")
    return {key: tensor.float() for key, tensor in state.items()}, hyper
