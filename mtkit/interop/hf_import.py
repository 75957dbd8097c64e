"""Import a transformers ``MarianMTModel`` (OPUS-MT and other Marian models) as an mtkit model.

The source is a folder as ``save_pretrained`` writes it, or a Hugging Face Hub repository, downloaded
through huggingface_hub at a revision and kept in its cache. The output is an mtkit checkpoint folder
(model.safetensors and the tokenizer models) that translate, eval, serve, average, export and
``train.init_from`` take. What Marian models have and how mtkit expresses it, exactly:

- post-norm layers, no final LayerNorm, token embeddings scaled by sqrt(D) (``scale_embedding``),
  swish, GELU or ReLU (``model.activation``), one head count and FFN width for both stacks;
- sinusoidal positions from 0, sin and cos in two halves of the model dimension: the residual stream
  is permuted into mtkit's interleaved layout (marian.py); stored position tables must be those;
- ``final_logits_bias`` becomes the output bias (``model.output_bias``); shared embeddings
  (``share_encoder_decoder_embeddings``) become ``model.tie_embeddings``, a decoder tied to the output
  alone ``model.tie_output``;
- ids: Marian numbers pieces by vocab.json, not by the SentencePiece model. mtkit ids are Marian's
  renumbered: 0 a new padding row, 1 unk, 2 Marian's pad, which is also its decoder start (mtkit's
  bos, never generated), 3 eos, then every other piece in Marian's order. Each side's SentencePiece
  model is rewritten with its pieces in that order (``tokenizer_model``): pieces of the vocabulary that
  the model never produces are kept as unused, pieces the model produces that the vocabulary lacks
  follow the vocabulary and encode as unk (``mtkit.data.tokenizer.vocabulary_size``), as
  MarianTokenizer maps them; language tags (``>>fr<<``) segment whole. The new padding row's logit
  is ``NOT_A_TOKEN``, so every probability is Marian's.
- fp16 and bf16 weights are widened to float32, which keeps every value.

A config mtkit cannot express is refused in one line naming the field. Every file is untrusted:
sizes are bounded before reading: vocab.json by the number of pieces config.json gives it (96 bytes
a piece), the safetensors header by the number of tensors config.json describes; the header's tensors
must fit in the file, and their names and shapes are compared with config.json before a tensor is read
or the model is built, so a config.json describing a huge model allocates nothing, and a vocabulary
(with its vocab.json) is as large as the embeddings the file holds (d_model is at least 16); weights
must be finite; no path is taken from a file, a file may not be a link out of the model's folder (a
snapshot of huggingface_hub's cache links into its repository's blobs/), and pytorch_model.bin loads
with ``weights_only=True``. The rewritten SentencePiece models are loaded once to check that they
give mtkit's special ids, and one whose pieces vocab.json mostly lacks (another model's, or source and
target swapped) is refused.

generate's ``num_beams`` and ``length_penalty`` (generation_config.json's, else config.json's, where
older transformers saved them) become ``decode.beam`` and ``decode.lenpen``, with
``decode.length_penalty`` power, as transformers ranks hypotheses.

The languages a model translates are recorded as ``data.src_lang``/``data.tgt_lang``, as a trained
model's are: given to the import, or read from an OPUS-MT name (``opus-mt-en-de``); otherwise mtkit's
``src`` and ``tgt``. A name's ``mul`` or language-group code (``opus-mt-en-mul``,
``opus-mt-tc-big-en-zle``) states no language, nor does the name of a model whose vocabulary holds
target tags (``>>por<<``) state its target: such a model translates into the language a tag at the
start of the input names, and its tags are recorded (``imported.language_tags``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import Tensor

from mtkit import untrusted
from mtkit.config import (
    LANGUAGE_CODE,
    MAX_LAYERS,
    MAX_LENPEN,
    MAX_POSITIONS,
    ConfigError,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    RunConfig,
    TokenizerConfig,
)
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtkit.errors import MtkitError
from mtkit.files import file_sha256
from mtkit.interop.marian import ACTIVATIONS, NOT_A_TOKEN, from_marian, layer_weights, residual_order, to_marian
from mtkit.model import checkpoint
from mtkit.model.checkpoint import TOKENIZER_NAMES, CheckpointError, check_finite
from mtkit.model.loading import skeleton_device
from mtkit.model.transformer import Transformer, build_model, sinusoidal_table

MAX_JSON_BYTES = 1 << 20  # config.json, generation_config.json, tokenizer_config.json: a few KiB each
MAX_VOCAB_BYTES = 64 << 20  # vocab.json: OPUS-MT's 58,101 pieces take 1.2 MB
# bytes a vocab.json entry may take on average: a 14-character piece written as six-character escapes (MarianTokenizer
# writes each non-ASCII character as a backslash, u and four hex digits), its id, quotes and indent; OPUS-MT's take 21
MAX_VOCAB_ENTRY_BYTES = 96
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own bound on a file's header
# a safetensors header's bytes: 512 for each tensor config.json describes (a name, dtype, shape and offsets take
# about 120), and this much besides (__metadata__)
HEADER_ENTRY_BYTES = 512
HEADER_BYTES = 64 << 10
# safetensors' dtypes and their sizes in bytes: a header's tensors must fit in the file's data
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2}
DTYPE_BYTES |= {"I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SPM_BYTES = 64 << 20  # a SentencePiece model: 32k pieces take 0.8 MB
MAX_VOCABULARY = 1 << 20  # pieces in one vocabulary
MAX_D_MODEL = 1 << 16
# the narrowest model dimension imported (OPUS-MT's narrowest is 256): embeddings this wide make the weights file
# grow with the vocabulary, and vocab.json with it
MIN_D_MODEL = 16
MAX_IMPORTED_BEAM = 64  # the largest num_beams recorded as decode.beam: generate's are 4 to 12
GENERATE_LENGTH_PENALTY = 1.0  # transformers' length_penalty where a model's files give none
MAX_FFN = 1 << 18  # a feed-forward width: OPUS-MT's largest (tc-big) is 4,096
PAD_PIECE = "<mtkit:pad>"  # mtkit's padding id, which Marian has no piece for
START_PIECE = "<s>"  # what the piece at mtkit's bos id is called: Marian's pad, its decoder start
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first found is read
_LANGUAGE_TAG = re.compile(r">>[^<>\s]+<<")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# An OPUS-MT model's name states its languages: opus-mt-en-de, opus-mt-tc-big-en-pt (ISO 639 codes, or a group's)
_OPUS_NAME = re.compile(r"opus-mt-(?:tc-(?:big|base)-)?([a-z]{2,3})-([a-z]{2,3})")
# Codes of OPUS-MT names that are no language: mul (many) and the ISO 639-5 codes of language groups (zle, East
# Slavic; gem, Germanic; ...). A model into one of them chooses its target by a >>xxx<< tag.
GROUP_CODES = frozenset(
    "mul aav afa alg alv apa aqa aql art ath auf aus awd azc bad bai bat ber bih bnt btk cai cau cba ccn ccs cdc "
    "cdd cel cmc cpe cpf cpp crp csu cus day dmn dra egx esx euq fiu fox gem gme gmq gmw grk hmx hok hyx iir ijo inc "
    "ine ira iro itc jpx kar kdo khi kro map mkh mno mun myn nah nai ngf nic nub omq omv oto paa phi plf poz pqe pqw "
    "pra qwe roa sai sal sdv sem sgn sio sit sla smi son sqj ssa syd tai tbq trk tup tut tuw urj wak wen wns ypk zhx "
    "zle zls zlw znd".split()
)
# Settings of transformers' BART family that change the architecture; Marian models have them false (older
# transformers wrote them out). static_position_embeddings true is Marian's sinusoids: checked on its own.
_NOT_MARIAN = ("normalize_before", "add_final_layer_norm", "normalize_embedding")


class ModelImportError(MtkitError, ValueError):
    """A model folder or Hub repository that mtkit cannot import; the message names the file and field."""


# -- finding the folder ---------------------------------------------------------------------


def locate(source: str, revision: str | None = None) -> tuple[Path, tuple[Path, ...], dict[str, str]]:
    """The folder holding ``source``'s files, the folders its files' links may lead into, and what the import
    records of it: a local folder (by name only, never its path; links stay inside it), a snapshot in
    huggingface_hub's cache given by its path, or a Hub repository id downloaded at ``revision`` (for these two the
    id and commit are recorded, and links may lead into the repository's blobs/, where the cache keeps the files a
    snapshot links to)."""
    path = Path(source)
    if path.is_dir():
        if revision is not None:
            raise ModelImportError(f"{source}: --revision applies to Hub repositories, and this is a local folder")
        cached = cache_snapshot(path)
        if cached is None:
            return path, (path,), {"source": path.resolve().name}
        repo_id, blobs = cached
        return path, (path, blobs), {"source": f"hf:{repo_id}", "revision": path.resolve().name}
    if not _REPO_ID.fullmatch(source):
        raise ModelImportError(f"{source}: no such folder, nor a Hub repository id (OWNER/NAME)")
    folder = _download(source, revision)
    return folder, (folder, folder.parent.parent / "blobs"), {"source": f"hf:{source}", "revision": folder.name}


def cache_snapshot(folder: Path) -> tuple[str, Path] | None:
    """The Hub id and blobs/ folder of ``folder`` when it is a snapshot in huggingface_hub's cache
    (``models--OWNER--NAME/snapshots/REVISION``, whose files are links into ``models--OWNER--NAME/blobs/``);
    None for any other folder."""
    real = folder.resolve()
    repo = real.parent.parent
    name = re.fullmatch(r"models--([\w.-]+?)--([\w.-]+)", repo.name)
    if real.parent.name != "snapshots" or name is None or not (repo / "blobs").is_dir():
        return None
    repo_id = f"{name[1]}/{name[2]}"
    return (repo_id, repo / "blobs") if _REPO_ID.fullmatch(repo_id) else None


def check_inside(path: Path, roots: tuple[Path, ...], hint: str = "") -> None:
    """Refuse ``path`` when it is a link (or lies in a linked folder) leading out of ``roots``: the import reads
    the model's files, never what a link in a downloaded folder points to elsewhere. ``hint`` ends the error."""
    real = path.resolve()
    if not any(real.is_relative_to(root.resolve()) for root in roots):
        raise ModelImportError(
            f"{path}: a link to {real}, outside {roots[0]}; the import reads only the model's files{hint}"
        )


def languages(origin: str, src_lang: str | None, tgt_lang: str | None, tags: list[str]) -> tuple[str, str]:
    """The languages to record: those given, else those an OPUS-MT name states (``origin`` is the folder's name or
    the Hub id), else mtkit's defaults ``src`` and ``tgt``, for both sides when neither is given. A name's code
    that is mul or a group's (``GROUP_CODES``) states no language, nor does its target when the vocabulary holds
    target ``tags`` (opus-mt-en-zh's >>cmn_Hans<<...): such a model translates into the language a tag names.
    ModelImportError for a code that is none, or one side given and the other not stated."""
    named = _OPUS_NAME.fullmatch(origin.rsplit("/", 1)[-1])
    stated = [code if code not in GROUP_CODES else None for code in (named.groups() if named else (None, None))]
    if tags:
        stated[1] = None
    src, tgt = src_lang or stated[0], tgt_lang or stated[1]
    if src_lang is None and tgt_lang is None and None in (src, tgt):
        src, tgt = DataConfig.src_lang, DataConfig.tgt_lang
    elif src is None or tgt is None:
        side, flag = ("source", "--src-lang") if src is None else ("target", "--tgt-lang")
        raise ModelImportError(f"{origin}: its name states no single {side} language; give {flag} too")
    for flag, code in (("--src-lang", src), ("--tgt-lang", tgt)):
        if LANGUAGE_CODE.fullmatch(code) is None:
            raise ModelImportError(
                f"{flag} {untrusted.shown(code)} is not a language code (a letter, then up to 15 letters, digits, "
                "_ or -)"
            )
    if src == tgt:
        raise ModelImportError(f"--src-lang and --tgt-lang are both {src}")
    return src, tgt


def _download(repo_id: str, revision: str | None) -> Path:
    """The repository's snapshot in huggingface_hub's cache: configs, tokenizer files and one weights file."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelImportError(
            "importing from the Hub needs huggingface_hub: pip install -e '.[hf]' in mtkit's clone"
        ) from None
    wanted = [*CONFIG_FILES, *TOKENIZER_FILES]
    try:
        folder = Path(
            huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=[*wanted, WEIGHT_FILES[0]])
        )
        if not (folder / WEIGHT_FILES[0]).is_file():  # older repositories hold pytorch_model.bin only
            folder = Path(
                huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=[WEIGHT_FILES[1]])
            )
    except LocalEntryNotFoundError:
        raise ModelImportError(
            f"hf:{repo_id}: not in the local Hugging Face cache, and the Hub cannot be reached (HF_HUB_OFFLINE?)"
        ) from None
    except HfHubHTTPError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelImportError(f"hf:{repo_id}: {first}") from None
    except (ValueError, OSError) as err:  # a malformed repository id or revision, a full disk
        raise ModelImportError(f"hf:{repo_id}: {err}") from None
    return folder


# -- reading --------------------------------------------------------------------------------


def _read_json(path: Path, limit: int, why: str = "such a file may have") -> Any:
    if path.stat().st_size > limit:
        raise ModelImportError(f"{path}: {path.stat().st_size:,} bytes, more than the {limit:,} {why}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSON, UTF-8 or nesting
        raise ModelImportError(f"{path}: not readable JSON ({str(err)[:200]})") from None


def _read_mapping(path: Path, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    value = _read_json(path, limit)
    if not isinstance(value, dict):
        raise ModelImportError(f"{path}: must hold a JSON object, got {untrusted.shown(value)}")
    return value


def _field(config: dict[str, Any], name: str, path: Path, kind: type, default: Any = None, low: int = 0) -> Any:
    """``config[name]`` checked to be of ``kind`` (an int in [low, 2**31)), or ``default`` when absent."""
    value = config.get(name, default)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and ok:
        ok = low <= value < 2**31
    if not ok:
        raise ModelImportError(
            f"{path}: {name} must be {kind.__name__}{f' >= {low}' if kind is int else ''}, got {untrusted.shown(value)}"
        )
    return value


@dataclass
class MarianConfig:
    """What mtkit reads of config.json: the model it describes, and Marian's special ids."""

    model: ModelConfig
    vocab_size: int  # source (or shared) vocabulary
    decoder_vocab_size: int
    shared: bool  # share_encoder_decoder_embeddings
    pad_id: int  # Marian's pad, which is also its decoder start
    eos_id: int


def read_config(path: Path) -> MarianConfig:
    """config.json as mtkit expresses it; ModelImportError naming the first field it cannot express."""
    config = _read_mapping(path)
    if config.get("model_type") != "marian":
        raise ModelImportError(
            f"{path}: model_type must be marian (a MarianMTModel), got {untrusted.shown(config.get('model_type'))}"
        )
    for name in _NOT_MARIAN:
        if config.get(name):
            raise ModelImportError(f"{path}: {name} is set, and Marian models have no such option")
    if not _field(config, "static_position_embeddings", path, bool, True):
        raise ModelImportError(
            f"{path}: static_position_embeddings false asks for learned positions; Marian's are sinusoids"
        )

    def same(first: str, second: str) -> int:
        value = _field(config, first, path, int, low=1)
        if _field(config, second, path, int, value, low=1) != value:
            raise ModelImportError(
                f"{path}: {second} {config[second]} differs from {first} {value}; mtkit has one for both stacks"
            )
        return value

    heads, ffn = same("encoder_attention_heads", "decoder_attention_heads"), same("encoder_ffn_dim", "decoder_ffn_dim")
    activation = _field(config, "activation_function", path, str, "gelu")
    if activation not in ACTIVATIONS:
        raise ModelImportError(
            f"{path}: activation_function {untrusted.shown(activation)} is not one of {', '.join(ACTIVATIONS)}"
        )
    if not _field(config, "scale_embedding", path, bool, False):
        raise ModelImportError(
            f"{path}: scale_embedding false: mtkit scales embeddings by sqrt(d_model), as OPUS-MT does"
        )
    shared = _field(config, "share_encoder_decoder_embeddings", path, bool, True)
    tie_output = _field(config, "tie_word_embeddings", path, bool, True)
    if shared and not tie_output:
        raise ModelImportError(
            f"{path}: tie_word_embeddings false with share_encoder_decoder_embeddings true: mtkit ties all three "
            "embeddings, or the decoder's to the output"
        )
    vocab_size = _field(config, "vocab_size", path, int, low=5)
    if config.get("decoder_vocab_size") is None:  # absent, or null as older transformers wrote it
        config["decoder_vocab_size"] = vocab_size
    decoder_vocab_size = _field(config, "decoder_vocab_size", path, int, low=5)
    if shared and decoder_vocab_size != vocab_size:
        raise ModelImportError(
            f"{path}: decoder_vocab_size {decoder_vocab_size} is not vocab_size {vocab_size}, and embeddings are shared"
        )
    if max(vocab_size, decoder_vocab_size) > MAX_VOCABULARY:
        raise ModelImportError(f"{path}: a vocabulary of over {MAX_VOCABULARY:,} pieces")
    pad_id = _field(config, "pad_token_id", path, int, 58100)
    start = _field(config, "decoder_start_token_id", path, int, pad_id)
    if start != pad_id:
        raise ModelImportError(f"{path}: decoder_start_token_id {start} is not pad_token_id {pad_id}, as Marian's is")
    eos_id = _field(config, "eos_token_id", path, int, 0)
    d_model = _field(config, "d_model", path, int, low=MIN_D_MODEL)
    layers = [_field(config, name, path, int, low=1) for name in ("encoder_layers", "decoder_layers")]
    positions = _field(config, "max_position_embeddings", path, int, low=8)
    bounds = {
        "d_model": (d_model, MAX_D_MODEL),
        "encoder_ffn_dim": (ffn, MAX_FFN),
        "encoder_layers": (layers[0], MAX_LAYERS),
        "decoder_layers": (layers[1], MAX_LAYERS),
        "max_position_embeddings": (positions, MAX_POSITIONS),
    }
    for name, (value, most) in bounds.items():
        if value > most:
            raise ModelImportError(f"{path}: {name} {value:,} is beyond mtkit's bound of {most:,}")
    if d_model % 2:
        raise ModelImportError(f"{path}: d_model {d_model} is odd; Marian's positions need an even one")
    try:
        model = ModelConfig(
            encoder_layers=layers[0],
            decoder_layers=layers[1],
            d_model=d_model,
            heads=heads,
            ffn=ffn,
            dropout=float(_field(config, "dropout", path, float, 0.1)),
            attention_dropout=float(_field(config, "attention_dropout", path, float, 0.0)),
            activation_dropout=float(_field(config, "activation_dropout", path, float, 0.0)),
            activation=ACTIVATIONS[activation],
            norm="post",
            positions="sinusoidal",
            tie_embeddings=shared,
            tie_output=not shared and tie_output,
            output_bias=True,
            max_positions=positions,
        )
    except ConfigError as err:
        raise ModelImportError(f"{path}: {err}") from None
    return MarianConfig(model, vocab_size, decoder_vocab_size, shared, pad_id, eos_id)


def read_decoding(folder: Path) -> tuple[int, float]:
    """generate's num_beams and length_penalty, as decode.beam and decode.lenpen: generation_config.json's, else
    config.json's (where transformers before 4.26 saved them), else mtkit's beam and transformers' length
    penalty. ModelImportError naming the file for a value mtkit cannot hold."""
    files = (folder / "generation_config.json", folder / "config.json")
    configs = [(path, _read_mapping(path)) for path in files if path.is_file()]

    def setting(name: str, default: Any) -> tuple[Path | None, Any]:
        return next(((path, c[name]) for path, c in configs if c.get(name) is not None), (None, default))

    path, beam = setting("num_beams", DecodeConfig.beam)
    if isinstance(beam, bool) or not isinstance(beam, int) or not 1 <= beam <= MAX_IMPORTED_BEAM:
        raise ModelImportError(
            f"{path}: num_beams {untrusted.shown(beam)} is not a whole number from 1 to {MAX_IMPORTED_BEAM}"
        )
    path, lenpen = setting("length_penalty", GENERATE_LENGTH_PENALTY)
    if isinstance(lenpen, bool) or not isinstance(lenpen, (int, float)) or not 0 <= lenpen <= MAX_LENPEN:
        raise ModelImportError(
            f"{path}: length_penalty {untrusted.shown(lenpen)} is not a number from 0 to {MAX_LENPEN} "
            "(mtkit's decode.lenpen)"
        )
    return beam, float(lenpen)


@dataclass
class Vocabulary:
    """One side's vocab.json (piece -> Marian id) with the names of its special pieces."""

    ids: dict[str, int]
    unk: str
    eos: str
    pad: str
    order: list[int] = field(default_factory=list)  # Marian ids in mtkit id order; order[PAD_ID] is -1 (new)

    def __post_init__(self) -> None:
        special = {self.ids[self.unk], self.ids[self.pad], self.ids[self.eos]}
        rest = sorted(i for i in self.ids.values() if i not in special)
        self.order = [-1, self.ids[self.unk], self.ids[self.pad], self.ids[self.eos], *rest]

    def pieces(self) -> list[str]:
        """The pieces in mtkit id order, the specials named as mtkit's tokenizer models name them."""
        by_id = {i: piece for piece, i in self.ids.items()}
        return [PAD_PIECE, self.unk, START_PIECE, self.eos, *(by_id[i] for i in self.order[4:])]


def read_vocabulary(path: Path, size: int, special: dict[str, str], marian: MarianConfig, target: bool) -> Vocabulary:
    """vocab.json: exactly ``size`` pieces with the ids 0..size-1, holding the special pieces at Marian's ids."""
    limit = min(MAX_VOCAB_BYTES, 1024 + size * MAX_VOCAB_ENTRY_BYTES)
    ids = _read_json(path, limit, f"config.json's {size:,} pieces may take")
    if not isinstance(ids, dict) or len(ids) != size:
        found = f"{len(ids):,} entries" if isinstance(ids, dict) else untrusted.shown(ids)
        raise ModelImportError(f"{path}: must map {size:,} pieces (config.json's vocabulary size) to ids, got {found}")
    if sorted(v if isinstance(v, int) and not isinstance(v, bool) else -1 for v in ids.values()) != list(range(size)):
        raise ModelImportError(f"{path}: its ids must be 0 to {size - 1}, each once")
    for role, piece in special.items():
        if piece not in ids:
            raise ModelImportError(f"{path}: has no {role} piece {untrusted.shown(piece)}")
    for piece in (PAD_PIECE, START_PIECE):
        if piece in ids:
            raise ModelImportError(f"{path}: holds a piece named {piece}, the name mtkit gives a special id")
    vocab = Vocabulary(ids, special["unk"], special["eos"], special["pad"])
    if target and (ids[vocab.pad], ids[vocab.eos]) != (marian.pad_id, marian.eos_id):
        raise ModelImportError(
            f"{path}: pad and eos are ids {ids[vocab.pad]} and {ids[vocab.eos]}, config.json says "
            f"{marian.pad_id} and {marian.eos_id}"
        )
    return vocab


def special_pieces(folder: Path) -> dict[str, str]:
    """tokenizer_config.json's names for unk, eos and pad (MarianTokenizer's defaults when absent)."""
    path = folder / "tokenizer_config.json"
    config = _read_mapping(path) if path.is_file() else {}
    names = {}
    for role, default in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>")):
        value = config.get(f"{role}_token", default)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if not isinstance(value, str) or not value or len(value) > 64:
            raise ModelImportError(f"{path}: {role}_token must be a short string, got {untrusted.shown(value)}")
        names[role] = value
    if len(set(names.values())) < len(names):
        raise ModelImportError(
            f"{path}: unk_token, eos_token and pad_token must be three pieces, got "
            + ", ".join(untrusted.shown(v) for v in names.values())
        )
    return names


def tokenizer_model(spm_path: Path, vocab: Vocabulary, vocab_name: str, language_tags: bool) -> bytes:
    """``spm_path`` rewritten with the vocabulary's pieces in mtkit id order (see the module docstring).

    Pieces keep their SentencePiece type and score, so text segments as before; vocabulary pieces the
    model lacks are unused (never produced, decoded as written); the model's pieces the vocabulary lacks
    come after ``trainer_spec.vocab_size`` ids. With ``language_tags``, tags such as ``>>fr<<`` are
    user-defined pieces, which SentencePiece keeps whole. A model whose pieces the vocabulary
    (``vocab_name``) mostly lacks is refused: it is another model's, or the other side's, and would
    encode most text as unk.
    """
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    if spm_path.stat().st_size > MAX_SPM_BYTES:
        raise ModelImportError(f"{spm_path}: more than {MAX_SPM_BYTES:,} bytes for a SentencePiece model")
    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString(spm_path.read_bytes())
    except Exception:  # protobuf's DecodeError, or a RuntimeWarning-turned-error on odd input
        raise ModelImportError(f"{spm_path}: not a SentencePiece model") from None
    Piece = model_pb2.ModelProto.SentencePiece
    segmenting = (Piece.NORMAL, Piece.USER_DEFINED, Piece.BYTE)
    known = {p.piece: p for p in proto.pieces if p.type in segmenting}
    if not known:
        raise ModelImportError(f"{spm_path}: not a SentencePiece model (no pieces)")
    lowest = min(p.score for p in known.values())
    pieces = vocab.pieces()
    types = [Piece.CONTROL, Piece.UNKNOWN, Piece.CONTROL, Piece.CONTROL]
    rewritten = []
    for i, name in enumerate(pieces):
        if i < len(types):
            rewritten.append(Piece(piece=name, score=0.0, type=types[i]))
        elif name in known:
            rewritten.append(Piece(piece=name, score=known[name].score, type=known[name].type))
        elif language_tags and _LANGUAGE_TAG.fullmatch(name):
            rewritten.append(Piece(piece=name, score=0.0, type=Piece.USER_DEFINED))
        else:
            rewritten.append(Piece(piece=name, score=lowest, type=Piece.UNUSED))
    in_vocabulary = set(pieces)
    lacking = sum(piece not in in_vocabulary for piece in known)
    if 2 * lacking > len(known):
        raise ModelImportError(
            f"{spm_path}: {lacking:,} of its {len(known):,} pieces are not in {vocab_name}: the SentencePiece model "
            "of another vocabulary (another model's, or source and target swapped?)"
        )
    rewritten += [
        Piece(piece=p.piece, score=p.score, type=p.type) for p in known.values() if p.piece not in in_vocabulary
    ]
    del proto.pieces[:]
    proto.pieces.extend(rewritten)
    spec = proto.trainer_spec
    spec.vocab_size = len(pieces)
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    spec.pad_piece, spec.unk_piece, spec.bos_piece, spec.eos_piece = PAD_PIECE, vocab.unk, START_PIECE, vocab.eos
    written = proto.SerializeToString()
    _check_loads(written, pieces, spm_path, vocab_name)
    return written


def _check_loads(model: bytes, pieces: list[str], spm_path: Path, vocab_name: str) -> None:
    """The rewritten model loads in SentencePiece with each vocabulary piece at its id and mtkit's special ids,
    so an import never reports success for a tokenizer that translate would refuse or misread."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(model)
    except (RuntimeError, OSError) as err:
        reason = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
        raise ModelImportError(
            f"{spm_path}: with {vocab_name}'s pieces, not a usable SentencePiece model ({reason})"
        ) from None
    specials = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    moved = next((i for i, piece in enumerate(pieces) if sp.id_to_piece(i) != piece), None)
    if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID) or moved is not None:
        at = f"{untrusted.shown(pieces[moved])} is not at id {moved}" if moved is not None else "special ids moved"
        raise ModelImportError(f"{spm_path}: with {vocab_name}'s pieces, not a usable SentencePiece model ({at})")


@dataclass
class WeightsFile:
    """The folder's weights file, with each tensor's shape as its header states it (safetensors), or as torch
    read it (pytorch_model.bin, bounded by the file's size: ``checkpoint.load_torch_file``)."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    loaded: dict[str, Tensor] | None  # pytorch_model.bin's tensors; None for a safetensors file, read later


def open_weights(folder: Path, marian: MarianConfig) -> WeightsFile:
    """model.safetensors or else pytorch_model.bin (``weights_only``): names and shapes, only the header read of
    the first, bounded by the number of tensors ``marian`` has."""
    path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if path is None:
        raise ModelImportError(f"{folder}: no model.safetensors or pytorch_model.bin")
    if path.suffix == ".safetensors":
        required, optional = expected_shapes(marian, set())
        tensors = len(required) + len(optional) + 1  # and model.shared.weight, the name of a shared table
        return WeightsFile(path, safetensors_shapes(path, HEADER_BYTES + tensors * HEADER_ENTRY_BYTES), None)
    try:
        weights = checkpoint.load_torch_file(path)
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises several types for truncated or foreign files
        raise ModelImportError(f"{path}: not readable weights ({type(err).__name__})") from None
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in weights.items()
    ):
        raise ModelImportError(f"{path}: must hold a mapping of names to tensors")
    return WeightsFile(path, {key: tuple(tensor.shape) for key, tensor in weights.items()}, weights)


def safetensors_shapes(path: Path, limit: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as a safetensors file's header states it, read alone, its length checked against
    ``limit`` before it is read: the file is neither mapped nor read further. Each tensor's dtype, shape and
    offsets must agree, and the tensors fit in the file's data, so that the sizes config.json is checked against
    are those of the tensors the file holds."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > min(limit, MAX_SAFETENSORS_HEADER):
            raise ModelImportError(
                f"{path}: not readable weights (a safetensors header of {length:,} bytes, more than the "
                f"{min(limit, MAX_SAFETENSORS_HEADER):,} its model's tensors may take)"
            )
        if not 2 <= length <= size - 8:
            raise ModelImportError(f"{path}: not readable weights (a safetensors header of {length:,} bytes)")
        text = f.read(length)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise ModelImportError(f"{path}: not readable weights (its safetensors header is not JSON)") from None
    shapes = {}
    for key, entry in (header if isinstance(header, dict) else {"": None}).items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ModelImportError(f"{path}: not readable weights (no shape for {untrusted.shown(key)} in its header)")
        _check_extent(path, key, entry, shape, size - 8 - length)
        shapes[key] = tuple(shape)
    return shapes


def _check_extent(path: Path, key: str, entry: dict[str, Any], shape: list[int], data_bytes: int) -> None:
    """A safetensors header's tensor ``key`` takes the bytes its dtype and shape give, inside the file's data."""
    dtype = entry.get("dtype")
    itemsize = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
    offsets = entry.get("data_offsets")
    fits = (
        itemsize is not None
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
        and all(n >= 0 for n in shape)
        and 0 <= offsets[0] <= offsets[1] <= data_bytes
        and offsets[1] - offsets[0] == itemsize * math.prod(shape)
    )
    if not fits:
        raise ModelImportError(
            f"{path}: not readable weights (its header states {untrusted.shown(key)} as "
            f"{untrusted.shown(entry.get('dtype'))} {tuple(shape)} at bytes {untrusted.shown(offsets)}, and the file "
            f"holds {data_bytes:,} bytes of tensors)"
        )


def expected_shapes(marian: MarianConfig, stored: set[str]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The tensors a weights file of ``marian`` must hold and those it may hold (copies of tied ones, position
    tables), by name, with their shapes; ``stored`` (the file's names) tells which name a shared table has.

    The layers' shapes are the model's own, read from a skeleton of one layer per stack built on the meta device,
    which costs no memory whatever config.json claims, and repeated for each layer config.json names."""
    cfg, d = marian.model, marian.model.d_model
    with skeleton_device():
        skeleton = build_model(replace(cfg, encoder_layers=1, decoder_layers=1), 8, 8, PAD_ID)
    required = {}
    for key, tensor, _ in layer_weights(skeleton):
        side, rest = re.fullmatch(r"model\.(encoder|decoder)\.layers\.0\.(.+)", key).groups()
        for i in range(cfg.encoder_layers if side == "encoder" else cfg.decoder_layers):
            required[f"model.{side}.layers.{i}.{rest}"] = tuple(tensor.shape)
    source, target = (marian.vocab_size, d), (marian.decoder_vocab_size, d)
    optional = {
        "final_logits_bias": (1, marian.decoder_vocab_size),
        **{f"model.{side}.embed_positions.weight": (cfg.max_positions, d) for side in ("encoder", "decoder")},
    }
    if marian.shared:
        key = "model.shared.weight" if "model.shared.weight" in stored else "model.encoder.embed_tokens.weight"
        required[key] = source
        tied = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
        optional.update({name: source for name in tied if name != key})
    else:
        required["model.encoder.embed_tokens.weight"] = source
        required["model.decoder.embed_tokens.weight"] = target
        (optional if cfg.tie_output else required)["lm_head.weight"] = target
    return required, optional


def check_shapes(weights: WeightsFile, marian: MarianConfig, config_path: Path) -> None:
    """The weights file holds exactly the tensors config.json describes, at its shapes: checked on the names and
    shapes alone, before a tensor is read or a model built, so a config.json of a huge model allocates nothing."""
    for side in ("encoder", "decoder"):
        layer = re.compile(rf"model\.{side}\.layers\.(\d{{1,9}})\.")
        held = {int(m[1]) for key in weights.shapes if (m := layer.match(key))}
        count = getattr(marian.model, f"{side}_layers")
        if len(held) != count:  # a gap in the numbering is named by the first tensor missing, below
            raise ModelImportError(
                f"{config_path}: {side}_layers is {count:,}, and {weights.path.name} holds {len(held):,} {side} layers"
            )
    required, optional = expected_shapes(marian, set(weights.shapes))
    for key in required:
        if key not in weights.shapes:
            raise ModelImportError(f"{weights.path}: no {key}, which {config_path.name} describes")
    for key, shape in weights.shapes.items():
        expected = required.get(key, optional.get(key))
        if expected is None:
            raise ModelImportError(f"{weights.path}: holds {key}, which no Marian model of {config_path.name} has")
        if shape != expected:
            raise ModelImportError(f"{weights.path}: {key} is {shape}, {config_path.name} makes it {expected}")


def read_weights(weights: WeightsFile) -> dict[str, Tensor]:
    """The tensors, as float32 (fp16 and bf16 widen exactly); each must be floating-point and finite."""
    path = weights.path
    try:
        if weights.loaded is not None:
            tensors = weights.loaded
        else:
            with safetensors.safe_open(path, framework="pt") as f:
                tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises several types for truncated or foreign files
        raise ModelImportError(f"{path}: not readable weights ({type(err).__name__})") from None
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ModelImportError(f"{path}: {key} is {tensor.dtype}, not a floating-point tensor")
    check_finite(tensors, path)
    return {key: tensor.float() for key, tensor in tensors.items()}


# -- converting -----------------------------------------------------------------------------


def _take(weights: dict[str, Tensor], key: str, path: Path, shape: tuple[int, ...]) -> Tensor:
    if key not in weights:
        raise ModelImportError(f"{path}: no {key}")
    tensor = weights.pop(key)
    if tuple(tensor.shape) != shape:
        raise ModelImportError(f"{path}: {key} is {tuple(tensor.shape)}, config.json makes it {shape}")
    return tensor


def _same(weights: dict[str, Tensor], key: str, expected: Tensor, path: Path) -> None:
    """A copy of a tied tensor that older files store again must be that tensor."""
    if key in weights and not torch.equal(weights.pop(key), expected):
        raise ModelImportError(f"{path}: {key} differs from the tensor config.json ties it to")


def _rows(matrix: Tensor, order: list[int], order_dims: Tensor) -> Tensor:
    """Marian's embedding ``matrix`` in mtkit's id order and residual layout, a zero row at the new pad id."""
    rows = matrix[torch.tensor(order[1:])]
    return torch.cat([rows.new_zeros(1, rows.size(1)), rows])[:, torch.argsort(order_dims)]


def _check_positions(weights: dict[str, Tensor], model: ModelConfig, path: Path) -> None:
    """Stored position tables (older files have them) must be the sinusoids mtkit computes."""
    expected = to_marian(sinusoidal_table(model.max_positions, model.d_model), "reads", residual_order(model.d_model))
    for side in ("encoder", "decoder"):
        key = f"model.{side}.embed_positions.weight"
        if key in weights:
            table = weights.pop(key)
            if table.shape != expected.shape or (table - expected).abs().max() > 1e-5:
                raise ModelImportError(f"{path}: {key} is not Marian's sinusoidal table, the positions mtkit computes")


def convert(
    weights: dict[str, Tensor], marian: MarianConfig, src: Vocabulary, tgt: Vocabulary, path: Path
) -> Transformer:
    """The mtkit model computing what the Marian weights compute (see the module docstring)."""
    cfg, d = marian.model, marian.model.d_model
    order = residual_order(d)
    model = build_model(cfg, len(src.order), len(tgt.order), PAD_ID)
    weights = dict(weights)
    with torch.no_grad():
        if marian.shared:
            key = "model.shared.weight" if "model.shared.weight" in weights else "model.encoder.embed_tokens.weight"
            shared = _take(weights, key, path, (marian.vocab_size, d))
            for tied in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
                _same(weights, tied, shared, path)
            model.encoder.embed.tokens.weight.copy_(_rows(shared, src.order, order))
        else:
            source = _take(weights, "model.encoder.embed_tokens.weight", path, (marian.vocab_size, d))
            target = _take(weights, "model.decoder.embed_tokens.weight", path, (marian.decoder_vocab_size, d))
            model.encoder.embed.tokens.weight.copy_(_rows(source, src.order, order))
            model.decoder.embed.tokens.weight.copy_(_rows(target, tgt.order, order))
            if cfg.tie_output:
                _same(weights, "lm_head.weight", target, path)
            else:
                output = _take(weights, "lm_head.weight", path, (marian.decoder_vocab_size, d))
                model.output.weight.copy_(_rows(output, tgt.order, order))
        bias = weights.pop("final_logits_bias", torch.zeros(1, marian.decoder_vocab_size))
        if tuple(bias.shape) != (1, marian.decoder_vocab_size):
            raise ModelImportError(
                f"{path}: final_logits_bias is {tuple(bias.shape)}, not (1, {marian.decoder_vocab_size})"
            )
        model.output.bias.copy_(torch.cat([torch.tensor([NOT_A_TOKEN]), bias[0, torch.tensor(tgt.order[1:])]]))
        _check_positions(weights, cfg, path)
        for key, tensor, axis in layer_weights(model):
            tensor.copy_(from_marian(_take(weights, key, path, tuple(tensor.shape)), axis, order))
    if weights:
        raise ModelImportError(f"{path}: holds {next(iter(weights))}, which no Marian model of config.json has")
    return model.eval()


# -- the import -----------------------------------------------------------------------------


def import_marian(
    source: str,
    out_dir: Path,
    revision: str | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> Path:
    """Write ``out_dir``, an mtkit checkpoint folder, from a MarianMTModel folder or Hub repository ``source``,
    recording the languages it translates (``languages``)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir}: exists and is not empty; choose another output folder")
    folder, roots, origin = locate(source, revision)
    local = Path(source).is_dir()
    hint = (
        f": copy the folder with the files its links name (cp -rL {folder} COPY) and import the copy" if local else ""
    )
    for name in (*CONFIG_FILES, *TOKENIZER_FILES, *WEIGHT_FILES):
        if (folder / name).exists() or (folder / name).is_symlink():
            check_inside(folder / name, roots, hint)
    for name in ("config.json", "source.spm", "target.spm", "vocab.json"):
        if not (folder / name).is_file():
            raise ModelImportError(
                f"{folder}: no {name}; a MarianMTModel folder has config.json, source.spm, target.spm and vocab.json"
            )
    marian = read_config(folder / "config.json")
    weights_file = open_weights(folder, marian)
    check_shapes(weights_file, marian, folder / "config.json")
    beam, lenpen = read_decoding(folder)
    special = special_pieces(folder)
    separate = (folder / "target_vocab.json").is_file() and not marian.shared
    src = read_vocabulary(folder / "vocab.json", marian.vocab_size, special, marian, target=not separate)
    tgt = src
    if separate:
        tgt = read_vocabulary(folder / "target_vocab.json", marian.decoder_vocab_size, special, marian, target=True)
    elif marian.decoder_vocab_size != marian.vocab_size:
        raise ModelImportError(f"{folder}: two vocabulary sizes in config.json, and no target_vocab.json")
    tags = sorted({piece for vocab in (src, tgt) for piece in vocab.ids if _LANGUAGE_TAG.fullmatch(piece)})
    langs = languages(origin["source"].removeprefix("hf:"), src_lang, tgt_lang, tags)
    vocab_names = {"src": "vocab.json", "tgt": "target_vocab.json" if separate else "vocab.json"}
    models = {
        "src": tokenizer_model(folder / "source.spm", src, vocab_names["src"], language_tags=True),
        "tgt": tokenizer_model(folder / "target.spm", tgt, vocab_names["tgt"], language_tags=False),
    }
    model = convert(read_weights(weights_file), marian, src, tgt, weights_file.path)
    joint = models["src"] == models["tgt"]
    names = (
        {"src": TOKENIZER_NAMES[0], "tgt": TOKENIZER_NAMES[0]}
        if joint
        else {"src": TOKENIZER_NAMES[1], "tgt": TOKENIZER_NAMES[2]}
    )
    files = {names[side]: models[side] for side in ("src", "tgt")}
    cfg = RunConfig(
        data=DataConfig(src_lang=langs[0], tgt_lang=langs[1]),
        tokenizer=TokenizerConfig(joint=joint, vocab_size=len(tgt.order)),
        model=marian.model,
        decode=DecodeConfig(beam=beam, lenpen=lenpen, length_penalty="power", early_stop=False),
    )
    records = {
        side: {"file": names[side], "sha256": hashlib.sha256(models[side]).hexdigest()} for side in ("src", "tgt")
    }
    meta = {
        "config": cfg.to_dict(),
        "tokenizer": records,
        "step": 0,
        "imported": {
            **origin,
            "sha256": file_sha256(weights_file.path),
            **({"language_tags": " ".join(tags)} if tags else {}),
        },
    }
    checkpoint.save(out_dir, model.state_dict(), meta, files=files)
    return out_dir


def tags_note(language_tags: str) -> str:
    """What the import says of a model into several languages, from its record's ``language_tags``."""
    tags = language_tags.split()
    shown = ", ".join(tags[:5]) + (", ..." if len(tags) > 5 else "")
    return (
        "the model translates into the language a tag at the start of its input names: begin each line with one "
        f"of its {len(tags):,} target tags ({shown})"
    )
