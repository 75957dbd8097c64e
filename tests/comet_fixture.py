"""COMET models with random weights in unbabel-comet's on-disk layout, the same in any environment.

mtkit's COMET is checked against unbabel-comet, which cannot be installed beside mtkit: its scores of these
models are computed once in its own environment (benchmarks/comet_expected.py) and kept in
tests/data/comet_expected.json. So this module imports neither mtkit nor transformers' model classes: every
tensor comes from a generator seeded by the model's seed, its kind and the tensor's name, and the tokenizer is written
as a tokenizers JSON file from an explicit vocabulary, which both transformers 4 and 5 read as it is.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from pathlib import Path

import torch
import yaml

SOURCES = [
    "The cat sits on the mat.",
    "I would like a cup of coffee, please.",
    "The meeting was moved to 3 p.m. on Friday.",
    "Where is the nearest train station?",
    "He didn't say a word.",
    "The committee, which had been meeting every week since the beginning of the year, finally published its "
    "report on the state of the railway network, and it recommended that the government invest heavily in new "
    "tracks, faster trains and better stations before the end of the decade.",
    "Prices rose by 4.5% in 2023.",
    "Read the terms & conditions carefully.",
    "Thank you!",
    "The weather in Zürich is nice today.",
    "She wrote 東京 on the card.",
    "The bank closes at noon.",
]
HYPOTHESES = [
    "Die Katze sitzt auf der Matte.",
    "Ich hätte gern eine Tasse Kaffee, bitte.",
    "Das Treffen wurde auf Freitag, 15 Uhr, verschoben.",
    "",
    "Er sagte kein Wort.",
    "Der Ausschuss, der sich seit Anfang des Jahres jede Woche getroffen hatte, veröffentlichte schließlich "
    "seinen Bericht über den Zustand des Eisenbahnnetzes, und er empfahl, dass die Regierung vor dem Ende des "
    "Jahrzehnts viel Geld in neue Gleise, schnellere Züge und bessere Bahnhöfe investiert, denn die Züge sind "
    "alt, die Gleise sind alt, die Bahnhöfe sind alt, und die Menschen, die jeden Tag mit dem Zug zur Arbeit "
    "fahren, warten jeden Tag auf Züge, die zu spät kommen oder gar nicht kommen.",
    "Die Preise stiegen 2023 um 4,5 %.",
    "Lies die AGB sorgfältig.",
    "Danke schön!",
    "Das Wetter in Zürich ist heute schön.",
    "Sie schrieb 東京 auf die Karte.",
    "Das Ufer schließt mittags.",
]
REFERENCES = [
    "Die Katze sitzt auf der Matte.",
    "Ich möchte bitte eine Tasse Kaffee.",
    "Die Besprechung wurde auf Freitag um 15 Uhr verlegt.",
    "Wo ist der nächste Bahnhof?",
    "Er hat kein Wort gesagt.",
    "Der Ausschuss, der seit Jahresbeginn jede Woche getagt hatte, hat endlich seinen Bericht über den Zustand "
    "des Schienennetzes veröffentlicht und empfiehlt der Regierung, bis zum Ende des Jahrzehnts viel in neue "
    "Gleise, schnellere Züge und bessere Bahnhöfe zu investieren.",
    "Die Preise sind 2023 um 4,5 % gestiegen.",
    "Lesen Sie die Geschäftsbedingungen sorgfältig durch.",
    "Vielen Dank!",
    "In Zürich ist heute schönes Wetter.",
    "Sie schrieb „Tokio“ auf die Karte.",
    "Die Bank schließt um zwölf Uhr.",
]

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
MASK_TOKEN = "<mask>"
WORD_BOUNDARY = "▁"
# Characters the tiny vocabulary spells rare words with; the CJK characters in the texts are not among them, so
# they become <unk>.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZäöüÄÖÜßé0123456789.,;:!?'\"%&()-/„“" + WORD_BOUNDARY
SUFFIXES = ["en", "er", "ch", "sch", "ung", "ie", "ei", "st", "te", "ge", "ing", "ed", "es", "nd"]

# The encoder's and the estimator's shapes: "tiny" for tests (its 128 positions put the long segment past the
# truncation), "xlmr-large" for COMET-22's real shapes (XLM-R large under a [3072, 1024] estimator).
SIZES = {
    "tiny": {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "positions": 130, "estimator": [96, 32]},
    "xlmr-large": {
        "layers": 24,
        "hidden": 1024,
        "heads": 16,
        "ffn": 4096,
        "positions": 514,
        "estimator": [3072, 1024],
        "vocab": 250002,
    },
}
LIGHTNING_VERSION = "2.0.0"  # the oldest version whose checkpoints Lightning loads without migrating them
# Each network option mtkit implements, in a model of its own: the name, the kind and the hyper-parameters changed
# from COMET-22's. Between them they cover every pooling, each layer transformation, layer normalisation on and
# off, a chosen hidden state (the embeddings, a middle layer, the top one), every activation, a final activation,
# and a mix trained without dropout (whose checkpoint lacks the dropout buffers).
VARIANTS: dict[str, tuple[str, dict]] = {
    "comet": ("comet", {}),
    "cometkiwi": ("cometkiwi", {}),
    "comet-softmax-norm-max": (
        "comet",
        {"layer_transformation": "softmax", "layer_norm": True, "pool": "max", "activations": "Sigmoid"},
    ),
    "comet-patch-cls": (
        "comet",
        {"layer_transformation": "sparsemax_patch", "pool": "cls", "dropout": 0.0, "final_activation": "Sigmoid"},
    ),
    "comet-layer0-avg": ("comet", {"layer": 0, "activations": "Softplus"}),
    "comet-layer1-default": ("comet", {"layer": 1, "pool": "default"}),
    "cometkiwi-softmax-norm": ("cometkiwi", {"layer_transformation": "softmax", "layer_norm": True}),
    "cometkiwi-layer2": ("cometkiwi", {"sent_layer": 2, "final_activation": "tanh"}),
}


def build_comet(
    folder: Path,
    kind: str = "comet",
    seed: int = 0,
    size: str = "tiny",
    tokenizer_texts: list[str] | None = None,
    options: dict | None = None,
) -> Path:
    """A COMET model with random weights: folder/hparams.yaml, folder/checkpoints/model.ckpt, folder/encoder/.

    kind "comet" is a regression_metric with Unbabel/wmt22-comet-da's hyper-parameters, kind "cometkiwi" a
    unified_metric with Unbabel/wmt22-cometkiwi-da's; options replace some of them (VARIANTS' values), in
    hparams.yaml and in the checkpoint alike, and the state dict holds what the network they describe has. size
    "xlmr-large" needs tokenizer_texts: a SentencePiece model trained on them stands in for XLM-R's, which cannot
    be downloaded here. Returns folder.
    """
    if kind not in ("comet", "cometkiwi"):
        raise ValueError(f"unknown COMET kind {kind!r}")
    shape = SIZES[size]
    folder = Path(folder)
    encoder = folder / "encoder"
    encoder.mkdir(parents=True, exist_ok=True)
    if size == "tiny":
        pieces = tiny_vocabulary(SOURCES + HYPOTHESES + REFERENCES)
    else:
        if not tokenizer_texts:
            raise ValueError("a COMET-22-size model needs tokenizer_texts to train its tokenizer on")
        pieces = trained_vocabulary(tokenizer_texts, encoder)
    vocab_size = shape.get("vocab", len(SPECIAL_TOKENS) + len(pieces) + 1)
    write_tokenizer(encoder, pieces)
    write_json(encoder / "config.json", encoder_config(shape, vocab_size))
    hparams = {**comet_hparams(kind, shape, encoder.resolve()), **(options or {})}
    (folder / "hparams.yaml").write_text(yaml.safe_dump(hparams, sort_keys=False), encoding="utf-8")
    checkpoint = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": LIGHTNING_VERSION,
        "state_dict": comet_state_dict(kind, shape, vocab_size, seed, hparams),
        "hparams_name": "kwargs",
        "hyper_parameters": hparams,
    }
    (folder / "checkpoints").mkdir(exist_ok=True)
    torch.save(checkpoint, folder / "checkpoints" / "model.ckpt")
    return folder


# -- hyper-parameters -----------------------------------------------------------------------------------------


def comet_hparams(kind: str, shape: dict, encoder: Path) -> dict:
    """hparams.yaml as unbabel-comet writes it for the two COMET-22 models, the encoder named by its path."""
    common = {
        "nr_frozen_epochs": 0.3,
        "keep_embeddings_frozen": True,
        "optimizer": "AdamW",
        "warmup_steps": 0,
        "encoder_learning_rate": 1.0e-06,
        "learning_rate": 1.5e-05,
        "layerwise_decay": 0.95,
        "encoder_model": "XLM-RoBERTa",
        "pretrained_model": str(encoder),
        "pool": "avg",
        "layer": "mix",
        "layer_transformation": "sparsemax",
        "layer_norm": False,
        "loss": "mse",
        "dropout": 0.1,
        "batch_size": 16,
        "train_data": ["data/1720-da.csv"],
        "validation_data": ["data/wmt-ende-newstest2021.csv"],
        "hidden_sizes": list(shape["estimator"]),
        "activations": "Tanh",
        "final_activation": None,
        "load_pretrained_weights": True,
        "local_files_only": False,
    }
    if kind == "comet":
        return {**common, "class_identifier": "regression_metric"}
    return {
        **common,
        "class_identifier": "unified_metric",
        "sent_layer": "mix",
        "word_layer": shape["layers"],
        "input_segments": ["mt", "src"],
        "word_level_training": False,
        "loss_lambda": 0.65,
        "error_labels": ["minor", "major"],
        "cross_entropy_weights": None,
        "word_weights": [0.15, 0.85],
    }


def encoder_config(shape: dict, vocab_size: int) -> dict:
    """The encoder's config.json, as XLM-R's reads in transformers."""
    return {
        "architectures": ["XLMRobertaModel"],
        "attention_probs_dropout_prob": 0.1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": shape["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": shape["ffn"],
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": shape["positions"],
        "model_type": "xlm-roberta",
        "num_attention_heads": shape["heads"],
        "num_hidden_layers": shape["layers"],
        "output_past": True,
        "pad_token_id": 1,
        "position_embedding_type": "absolute",
        "type_vocab_size": 1,
        "vocab_size": vocab_size,
    }


# -- weights --------------------------------------------------------------------------------------------------


def comet_state_dict(kind: str, shape: dict, vocab_size: int, seed: int, hparams: dict) -> dict[str, torch.Tensor]:
    """The Lightning module's state dict: the encoder under encoder.model., the layer mix (when ``hparams`` mix
    the layers; its dropout buffers when they train it with dropout), the estimator."""
    hidden, ffn, positions = shape["hidden"], shape["ffn"], shape["positions"]
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (vocab_size, hidden),
        "embeddings.position_embeddings.weight": (positions, hidden),
        "embeddings.token_type_embeddings.weight": (1, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
    }
    for layer in range(shape["layers"]):
        prefix = f"encoder.layer.{layer}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes[prefix + name + ".weight"] = (hidden, hidden)
            shapes[prefix + name + ".bias"] = (hidden,)
        shapes[prefix + "attention.output.LayerNorm.weight"] = (hidden,)
        shapes[prefix + "attention.output.LayerNorm.bias"] = (hidden,)
        shapes[prefix + "intermediate.dense.weight"] = (ffn, hidden)
        shapes[prefix + "intermediate.dense.bias"] = (ffn,)
        shapes[prefix + "output.dense.weight"] = (hidden, ffn)
        shapes[prefix + "output.dense.bias"] = (hidden,)
        shapes[prefix + "output.LayerNorm.weight"] = (hidden,)
        shapes[prefix + "output.LayerNorm.bias"] = (hidden,)
    seed = seed * 2 + (kind == "cometkiwi")  # the two kinds' weights differ as the real models' do
    state = {"encoder.model." + name: random_tensor(name, size, seed) for name, size in shapes.items()}
    # The position ids buffer that the transformers of 2022, which trained COMET-22, saved with the weights.
    state["encoder.model.embeddings.position_ids"] = torch.arange(positions).unsqueeze(0)

    if hparams["sent_layer" if kind == "cometkiwi" else "layer"] == "mix":
        state.update(layer_mix(shape, seed, with_dropout=bool(hparams["dropout"])))

    sizes = [hidden * 6 if kind == "comet" else hidden, *shape["estimator"], 1]
    for index, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        name = f"estimator.ff.{3 * index}"  # each Linear is followed by its activation and dropout
        state[name + ".weight"] = random_tensor(name + ".weight", (fan_out, fan_in), seed)
        state[name + ".bias"] = random_tensor(name + ".bias", (fan_out,), seed)
    return state


def layer_mix(shape: dict, seed: int, with_dropout: bool) -> dict[str, torch.Tensor]:
    """The layer mix's weights, and the buffers of the dropout it was trained with, if any."""
    mixed = shape["layers"] + 1  # the embeddings' output and each layer's
    state = {}
    for index in range(mixed):
        # The tiny models draw the mix's weights, so that the layers it skips are tested; the large one keeps
        # unbabel-comet's initial equal weights, so that every layer runs and a speed measures all 24.
        weight = random_tensor(f"layer_weight.{index}", (1,), seed) if shape is SIZES["tiny"] else torch.zeros(1)
        state[f"layerwise_attention.scalar_parameters.{index}"] = weight
    state["layerwise_attention.gamma"] = random_tensor("layer_mix.gamma", (1,), seed)
    if with_dropout:
        state["layerwise_attention.dropout_mask"] = torch.zeros(mixed)
        state["layerwise_attention.dropout_fill"] = torch.full((mixed,), -1e20)
    return state


def random_tensor(name: str, size: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor drawn from a generator seeded by the model's seed and the tensor's name, scaled by its role.

    Scales keep signals at unit size through the random network (weights ~ 1/sqrt(fan_in)), and queries and
    keys three times that, so that attention is sharp enough for each segment's first token to depend on its
    words and segment scores differ from one another; the layer-mix weights are spread wider than sparsemax's
    support, so that some layers get weight 0 and others share the rest.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(size, generator=generator)
    if name.endswith((".query.weight", ".key.weight")):
        return 3.0 * values / size[-1] ** 0.5
    if "LayerNorm.weight" in name or name == "layer_mix.gamma":
        return 1.0 + 0.1 * values
    if name.startswith("layer_weight."):
        return 0.5 * values
    if name.endswith(".bias"):
        return 0.1 * values
    if "embeddings" in name:
        return values
    return values / size[-1] ** 0.5


# -- tokenizer ------------------------------------------------------------------------------------------------


def tiny_vocabulary(texts: list[str]) -> list[tuple[str, float]]:
    """An explicit unigram vocabulary: the texts' repeated words whole, the rest spelt by suffixes and letters."""
    words = Counter(WORD_BOUNDARY + word for text in texts for word in text.split())
    repeated = sorted(word for word, count in words.items() if count >= 2 and len(word) > 2)
    pieces = [(word, -4.0 - 0.01 * rank) for rank, word in enumerate(repeated)]
    pieces += [(suffix, -6.0) for suffix in SUFFIXES]
    pieces += [(character, -9.0) for character in ALPHABET]
    return pieces


def trained_vocabulary(texts: list[str], encoder: Path) -> list[tuple[str, float]]:
    """A SentencePiece unigram model trained on texts (kept as sentencepiece.bpe.model), as pieces and scores."""
    import sentencepiece

    corpus = encoder / "tokenizer_texts.txt"
    corpus.write_text("\n".join(text for text in texts if text.strip()) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(encoder / "sentencepiece.bpe"),
        model_type="unigram",
        vocab_size=min(8000, max(200, len(set(" ".join(texts).split())))),
        hard_vocab_limit=False,
        character_coverage=1.0,
        num_threads=1,
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        minloglevel=2,
    )
    corpus.unlink()
    (encoder / "sentencepiece.bpe.vocab").unlink()
    model = sentencepiece.SentencePieceProcessor(model_file=str(encoder / "sentencepiece.bpe.model"))
    return [(model.id_to_piece(i), model.get_score(i)) for i in range(1, model.get_piece_size())]


def write_tokenizer(encoder: Path, pieces: list[tuple[str, float]]) -> None:
    """tokenizer.json (XLM-R's pipeline over the given pieces), tokenizer_config.json, special_tokens_map.json.

    The ids follow XLM-R's: <s> <pad> </s> <unk>, the pieces, then <mask>. The pipeline is the one transformers 5
    builds for XLM-R when no normalizer comes with the vocabulary (split on whitespace, then ▁ before each word),
    so that transformers 4, which reads tokenizer.json as it is, and 5 give the same ids.
    """
    vocabulary = [[token, 0.0] for token in SPECIAL_TOKENS] + [[piece, score] for piece, score in pieces]
    vocabulary.append([MASK_TOKEN, 0.0])
    mask_id = len(vocabulary) - 1
    added = [special_token(i, token) for i, token in enumerate(SPECIAL_TOKENS)] + [special_token(mask_id, MASK_TOKEN)]
    metaspace = {"replacement": WORD_BOUNDARY, "prepend_scheme": "always", "split": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "WhitespaceSplit"}, {"type": "Metaspace", **metaspace}],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [special("<s>"), sequence("A"), special("</s>")],
            "pair": [special("<s>"), sequence("A"), special("</s>"), special("</s>"), sequence("B"), special("</s>")],
            "special_tokens": {
                "<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]},
            },
        },
        "decoder": {"type": "Metaspace", **metaspace},
        "model": {"type": "Unigram", "unk_id": 3, "vocab": vocabulary, "byte_fallback": False},
    }
    write_json(encoder / "tokenizer.json", tokenizer)
    write_json(encoder / "tokenizer_config.json", {"model_max_length": 512, "tokenizer_class": "XLMRobertaTokenizer"})
    write_json(
        encoder / "special_tokens_map.json",
        {
            "bos_token": "<s>",
            "cls_token": "<s>",
            "eos_token": "</s>",
            "mask_token": {"content": MASK_TOKEN, "lstrip": True, "normalized": False, "rstrip": False},
            "pad_token": "<pad>",
            "sep_token": "</s>",
            "unk_token": "<unk>",
        },
    )


def special_token(token_id: int, content: str) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": content == MASK_TOKEN,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def special(token: str) -> dict:
    return {"SpecialToken": {"id": token, "type_id": 0}}


def sequence(name: str) -> dict:
    return {"Sequence": {"id": name, "type_id": 0}}


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
