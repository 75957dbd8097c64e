"""transformers import of NLLB-200 and M2M100: an M2M100ForConditionalGeneration folder becomes an mtkit model that
computes what transformers computes, with a tokenizer that gives transformers' ids.

The folders are built by tests/m2m100_fixture.py: random models, SentencePiece BPE models trained on captions,
NllbTokenizer (transformers 5's ids and the Hub's) and M2M100Tokenizer saved as transformers saves them.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import m2m100_fixture as fx
import pytest
import safetensors.torch
import torch
from helpers import invoke, one_line_error

from mtkit.config import DataConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from mtkit.interop.hf_import import import_hf
from mtkit.interop.hf_weights import open_weights
from mtkit.interop.m2m100_config import TABLE_NAMES, check_shapes, read_config, tensor_count
from mtkit.model import checkpoint, loading

with pytest.MonkeyPatch.context() as env:
    env.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
# accents, digits, characters the tokenizer has never seen, runs of spaces, tabs, punctuation of other scripts
TEXTS = [
    "A man is reading a book in the park.",
    "Ein älteres Mädchen läuft über die Straße.",
    "Une femme âgée chante près de la fenêtre.",
    "  Two   dogs  play in the   park.",
    "The 3 children ate 12 apples at 10:30.",
    "Ørsted, Łódź and Dvořák: çà et là.",
    "日本語のテキスト 😀 and ☃",
    "naïve café — “quoted” ‘text’…",
    "tab\tseparated\twords",
    "UPPER CASE WORDS AND lower ones",
    "x",
    "ﬁne ｆｕｌｌｗｉｄｔｈ ①",
]


@dataclass
class Imported:
    folder: fx.FairseqFolder
    model_dir: Path
    bundle: loading.InferenceBundle


def imported(folder: fx.FairseqFolder, out: Path, **languages) -> Imported:
    import_hf(str(folder.path), out, **languages)
    return Imported(folder, out, loading.load_for_inference(out, CPU, "fp32"))


@pytest.fixture(scope="module")
def nllb(tmp_path_factory) -> Imported:
    """transformers 5's NllbTokenizer ids (<mask> first, then the 202 codes), two padding rows."""
    root = tmp_path_factory.mktemp("nllb")
    folder = fx.nllb_folder(root, seed=1)
    return imported(folder, root / "model", src_lang="eng_Latn", tgt_lang="fra_Latn")


@pytest.fixture(scope="module")
def nllb_hub(tmp_path_factory) -> Imported:
    """The Hub's tokenizer.json ids (the codes first, <mask> after them), GELU."""
    root = tmp_path_factory.mktemp("nllb_hub")
    folder = fx.nllb_folder(root, seed=2, hub_order=True, activation_function="gelu")
    return imported(folder, root / "model")


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory) -> Imported:
    """M2M100Tokenizer: vocab.json in its own order, lacking some pieces; swish."""
    root = tmp_path_factory.mktemp("m2m100")
    folder = fx.m2m100_folder(root, seed=3, activation_function="swish")
    return imported(folder, root / "model", src_lang="en")


@pytest.fixture(params=["nllb", "nllb_hub", "m2m100"])
def model(request) -> Imported:
    return request.getfixturevalue(request.param)


def language_id(folder: fx.FairseqFolder, code: str) -> int:
    """transformers' id of a language's token."""
    tok = folder.tokenizer
    return tok.get_lang_id(code) if isinstance(tok, transformers.M2M100Tokenizer) else tok.convert_tokens_to_ids(code)


def test_the_tokenizer_gives_transformers_ids(model):
    """Text to ids as transformers' tokenizer gives them, less the language token and eos, which mtkit adds."""
    tok, src_tok = model.folder.tokenizer, model.bundle.src_tok
    ours = src_tok.encode(TEXTS)
    for code in model.folder.languages[:2]:
        tok.src_lang = code
        for text, ids in zip(TEXTS, ours):
            theirs = fx.to_mtkit(torch.tensor(tok(text)["input_ids"])).tolist()
            assert theirs == [language_id(model.folder, code), *ids, EOS_ID], text
    assert sum(ids.count(1) for ids in ours) >= 3  # characters the model has never seen are unk, as there


def test_text_ending_in_spaces_is_segmented_as_sentencepiece_segments_it(model):
    """Trailing spaces give no piece, as SentencePiece segments text: fairseq trained these models on its pieces,
    and M2M100Tokenizer calls it. transformers' NllbTokenizer (the tokenizers library) ends such a text with a piece
    "▁" of its own."""
    import sentencepiece

    original = sentencepiece.SentencePieceProcessor(model_file=str(model.folder.path / "sentencepiece.bpe.model"))
    tok = model.folder.tokenizer
    texts = ["Two dogs play.  ", "A man reads. ", "Ein Mann liest.\t"]
    for text, ids in zip(texts, model.bundle.src_tok.encode(texts)):
        theirs = tok(text)["input_ids"][1:-1]
        if isinstance(tok, transformers.M2M100Tokenizer):
            assert fx.to_mtkit(torch.tensor(theirs)).tolist() == ids
        else:
            assert model.bundle.src_tok.sp.id_to_piece(ids) == original.encode(text, out_type=str)
            assert tok.convert_ids_to_tokens(theirs) == [*original.encode(text, out_type=str), "▁"]


def test_the_language_tokens_are_control_pieces_at_transformers_ids(model):
    """Each language the tokenizer knows is recorded, its token at transformers' id; no text produces one, and
    decoding one gives nothing."""
    cfg, sp = model.bundle.cfg.data, model.bundle.tgt_tok.sp
    assert cfg.languages == tuple(model.folder.languages)
    for code in cfg.languages:
        assert sp.piece_to_id(cfg.language_token.format(lang=code)) == language_id(model.folder, code)
    token = cfg.language_token.format(lang=cfg.languages[0])
    assert language_id(model.folder, cfg.languages[0]) not in model.bundle.src_tok.encode([f"a {token} b"])[0]
    ids = model.bundle.tgt_tok.encode(["Un homme lit."])[0]
    assert sp.decode([language_id(model.folder, cfg.languages[1]), *ids]) == sp.decode(ids) == "Un homme lit."
    if isinstance(model.folder.tokenizer, transformers.NllbTokenizer):
        assert sp.piece_to_id("<mask>") == model.folder.tokenizer.convert_tokens_to_ids("<mask>")


@pytest.mark.parametrize("pair", [0, 1])
def test_logits_equal_transformers_teacher_forced(model, pair):
    """transformers' input: the source language token, text, eos; the decoder reads eos, then the target language
    token and the target. mtkit's: the same ids renumbered, the decoder starting from bos (read as eos)."""
    codes = model.folder.languages
    src_lang, tgt_lang = [(codes[0], codes[1]), (codes[2], codes[0])][pair]
    tok = model.folder.tokenizer
    tok.src_lang, tok.tgt_lang = src_lang, tgt_lang
    sources, targets = fx.LINES["en"][:8], fx.LINES[["fr", "de"][pair]][:8]
    batch = tok(sources, text_target=targets, return_tensors="pt", padding=True)
    labels = batch["labels"]
    real = torch.cat([torch.ones_like(labels[:, :1], dtype=torch.bool), (labels != 1)[:, :-1]], dim=1)
    decoder_in = torch.cat([torch.full_like(labels[:, :1], 2), labels[:, :-1]], dim=1).masked_fill(~real, 1)
    with torch.no_grad():
        expected = model.folder.hf(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_in
        ).logits
        src = fx.to_mtkit(batch["input_ids"])
        tgt_in = fx.to_mtkit(decoder_in)
        assert (tgt_in[:, 0] == EOS_ID).all()
        tgt_in[:, 0] = BOS_ID
        got = model.bundle.model(src, src == PAD_ID, tgt_in)
    columns = fx.to_mtkit(torch.arange(expected.size(-1)))
    torch.testing.assert_close(got[real][:, columns], expected[real], atol=1e-4, rtol=1e-4)
    assert expected[real].std() > 1.0  # logits that differ: a wrong row or norm would show


def test_the_checkpoint_records_the_model_its_languages_and_generate_settings(nllb, nllb_hub, m2m100):
    cfg = nllb.bundle.cfg
    assert (cfg.model.norm, cfg.model.positions, cfg.model.decoder_start) == ("pre", "fairseq", "eos")
    assert cfg.model.tie_embeddings and not cfg.model.output_bias and cfg.model.activation == "relu"
    assert (cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.language_token) == ("eng_Latn", "fra_Latn", "{lang}")
    assert cfg.tokenizer.joint and cfg.tokenizer.vocab_size == nllb.folder.hf.config.vocab_size
    assert nllb.bundle.src_tok.vocab_size == nllb.folder.hf.config.vocab_size == len(nllb.folder.tokenizer) + 2
    assert (nllb_hub.bundle.cfg.data.src_lang, nllb_hub.bundle.cfg.data.tgt_lang) == (
        DataConfig.src_lang,
        DataConfig.tgt_lang,
    )
    assert nllb_hub.bundle.cfg.model.activation == "gelu"
    cfg = m2m100.bundle.cfg
    assert (cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.language_token) == ("en", "tgt", "__{lang}__")
    assert (cfg.decode.beam, cfg.decode.lenpen, cfg.model.activation) == (5, 1.0, "swish")
    meta = checkpoint.read_meta(nllb.model_dir)[0]
    assert meta["imported"]["source"] == "nllb"
    weights = (nllb.folder.path / "model.safetensors").read_bytes()
    assert meta["imported"]["sha256"] == hashlib.sha256(weights).hexdigest()


def test_the_wmt21_language_list_numbers_its_tokens(tmp_path):
    folder = fx.m2m100_folder(tmp_path, seed=4, language_codes="wmt21")
    bundle = imported(folder, tmp_path / "model").bundle
    assert bundle.cfg.data.languages == ("en", "ha", "is", "ja", "cs", "ru", "zh", "de")
    for code in bundle.cfg.data.languages:
        assert bundle.src_tok.sp.piece_to_id(f"__{code}__") == folder.tokenizer.get_lang_id(code)
    assert bundle.src_tok.sp.id_to_piece(folder.hf.config.vocab_size - 1) == "madeupword0007"


def broken_copy(source: Path, tmp_path: Path, edit=None) -> Path:
    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    if edit is not None:
        edit(folder)
    return folder


def same_state(model_dir: Path, expected: dict[str, torch.Tensor], widen=lambda t: t) -> bool:
    state = loading.load_for_inference(model_dir, CPU).model.state_dict()
    return all(torch.equal(state[key], widen(value)) for key, value in expected.items())


def rewrite_weights(change):
    def edit(folder: Path) -> None:
        weights = safetensors.torch.load_file(folder / "model.safetensors")
        change(weights)
        safetensors.torch.save_file(weights, folder / "model.safetensors")

    return edit


def test_fp16_pytorch_model_bin_and_bf16_safetensors_import_the_same_model(nllb, tmp_path):
    """Older repositories hold pytorch_model.bin, often in fp16; widening to float32 keeps every value."""

    def to_bin(folder: Path) -> None:
        weights = safetensors.torch.load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save({key: value.half() for key, value in weights.items()}, folder / "pytorch_model.bin")

    full = nllb.bundle.model.state_dict()
    import_hf(str(broken_copy(nllb.folder.path, tmp_path / "bin", to_bin)), tmp_path / "half")
    assert same_state(tmp_path / "half", full, lambda t: t.half().float())
    bf16 = rewrite_weights(lambda weights: weights.update({k: v.bfloat16() for k, v in weights.items()}))
    import_hf(str(broken_copy(nllb.folder.path, tmp_path / "bf16", bf16)), tmp_path / "brain")
    assert same_state(tmp_path / "brain", full, lambda t: t.bfloat16().float())


@pytest.mark.parametrize(
    "names",
    [TABLE_NAMES, ("lm_head.weight",)],
    ids=["every-tied-name", "lm-head-only"],
)
def test_the_tied_table_is_read_under_any_of_its_names(m2m100, tmp_path, names):
    """Older files repeat the tied table under each name; a file converted elsewhere may keep one other name."""

    def rename(weights: dict[str, torch.Tensor]) -> None:
        table = weights.pop("model.shared.weight")
        weights.update({name: table.clone() for name in names})

    import_hf(str(broken_copy(m2m100.folder.path, tmp_path, rewrite_weights(rename))), tmp_path / "model")
    assert same_state(tmp_path / "model", m2m100.bundle.model.state_dict())


def test_without_tokenizer_json_the_ids_come_from_added_tokens_decoder(nllb_hub, tmp_path):
    """A folder transformers 4's slow NllbTokenizer saved has no tokenizer.json: tokenizer_config.json's
    added_tokens_decoder gives the ids, and the tokenizer is the same."""

    def to_decoder(folder: Path) -> None:
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
        (folder / "tokenizer.json").unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["added_tokens_decoder"] = {str(token["id"]): {"content": token["content"]} for token in added}
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")

    import_hf(str(broken_copy(nllb_hub.folder.path, tmp_path, to_decoder)), tmp_path / "model")
    again = loading.load_for_inference(tmp_path / "model", CPU)
    assert again.src_tok.sha256 == nllb_hub.bundle.src_tok.sha256


def test_the_command_imports_and_names_the_languages(nllb, tmp_path):
    args = ("--src-lang", "fra_Latn", "--tgt-lang", "deu_Latn", "-o", tmp_path / "model")
    result = invoke("import", "hf", nllb.folder.path, *args)
    assert result.exit_code == 0 and "(202 languages, fra_Latn->deu_Latn)" in result.output, result.output
    one_line_error(
        invoke("import", "hf", nllb.folder.path, "--src-lang", "en", "-o", tmp_path / "other"),
        "--src-lang 'en' is not one of the model's 202 languages (ace_Arab, ace_Latn,",
    )
    one_line_error(
        invoke(
            "import", "hf", nllb.folder.path, "--src-lang", "eng_Latn", "--tgt-lang", "eng_Latn", "-o", tmp_path / "x"
        ),
        "--src-lang and --tgt-lang are both eng_Latn",
    )


def test_a_hub_id_resolves_through_the_cache_offline(m2m100, hf_offline, tmp_path, monkeypatch):
    """A Hub id is downloaded with the files its family needs (offline: found in huggingface_hub's cache)."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--facebook--m2m100_418M"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in m2m100.folder.path.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (repo / "snapshots" / ("0" * 40) / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    result = invoke("import", "hf", "facebook/m2m100_418M", "-o", tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert checkpoint.read_meta(tmp_path / "model")[0]["imported"]["source"] == "hf:facebook/m2m100_418M"
    assert same_state(tmp_path / "model", m2m100.bundle.model.state_dict())


# -- refusals ---------------------------------------------------------------------------------------------------


def edit_json(name: str, **changes):
    def edit(folder: Path) -> None:
        values = json.loads((folder / name).read_text(encoding="utf-8"))
        values.update(changes)
        (folder / name).write_text(json.dumps(values, ensure_ascii=False), encoding="utf-8")

    return edit


def edit_added_tokens(change):
    """tokenizer.json with its added_tokens (a list of {"id", "content", ...}) changed by ``change``."""

    def edit(folder: Path) -> None:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        change(data["added_tokens"], data)
        (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")

    return edit


def escaped_json(name: str, change):
    """``name`` changed by ``change`` and written with JSON's \\u escapes, which can spell a lone surrogate."""

    def edit(folder: Path) -> None:
        data = json.loads((folder / name).read_text(encoding="utf-8"))
        change(data)
        (folder / name).write_text(json.dumps(data), encoding="ascii")

    return edit


def decoder_only(decoder: dict):
    """No tokenizer.json: tokenizer_config.json's added_tokens_decoder alone gives the added tokens' ids."""

    def edit(folder: Path) -> None:
        (folder / "tokenizer.json").unlink()
        edit_json("tokenizer_config.json", added_tokens_decoder=decoder)(folder)

    return edit


def token_id(tokens: list[dict], content: str) -> dict:
    return next(token for token in tokens if token["content"] == content)


def swap_vocab(tokens, data) -> None:
    """tokenizer.json's vocabulary with the first two pieces' ids swapped."""
    vocab = data["model"]["vocab"]
    first, second = (next(piece for piece, i in vocab.items() if i == wanted) for wanted in (4, 5))
    vocab[first], vocab[second] = 5, 4


def rewrite_safetensors(folder: Path, header_bytes: int = 0, drop_data: int = 0) -> None:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header, data = raw[8 : 8 + length], raw[8 + length :]
    header += b" " * max(0, header_bytes - len(header))
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[: len(data) - drop_data])


def nan_weight(weights: dict[str, torch.Tensor]) -> None:
    weights["model.decoder.layers.1.fc1.weight"][3, 5] = float("nan")


def link_out(name: str):
    def edit(folder: Path) -> None:
        outside = folder.parent / f"elsewhere-{name}"
        shutil.copy(folder / name, outside)
        (folder / name).unlink()
        (folder / name).symlink_to(outside)

    return edit


NLLB_REFUSALS = [
    (edit_json("config.json", model_type="nllb_moe"), "model_type must be marian (a MarianMTModel) or m2m_100"),
    (edit_json("config.json", scale_embedding=False), "scale_embedding false"),
    (edit_json("config.json", normalize_before=False), "normalize_before false asks for post-norm layers"),
    (edit_json("config.json", layernorm_embedding=True), "layernorm_embedding is set"),
    (edit_json("config.json", decoder_attention_heads=8), "decoder_attention_heads 8 differs from encoder_attention"),
    (edit_json("config.json", decoder_ffn_dim=128), "decoder_ffn_dim 128 differs from encoder_ffn_dim 64"),
    (edit_json("config.json", tie_word_embeddings=False), "tie_word_embeddings false asks for an lm_head of its own"),
    (edit_json("config.json", activation_function="tanh"), "activation_function 'tanh' is not one of"),
    (edit_json("config.json", vocab_size=2**21), "a vocabulary of over 1,048,576 pieces"),
    (edit_json("config.json", d_model="32"), "d_model must be int"),
    (edit_json("config.json", d_model=1 << 17), "d_model 131,072 is beyond mtkit's bound of 65,536"),
    (edit_json("config.json", encoder_ffn_dim=1 << 30, decoder_ffn_dim=1 << 30), "encoder_ffn_dim 1,073,741,824 is"),
    (edit_json("config.json", num_hidden_layers=3), "num_hidden_layers 3 differs from encoder_layers 2"),
    (edit_json("config.json", decoder_start_token_id=0), "decoder_start_token_id is 0, not fairseq's 2"),
    (edit_json("config.json", pad_token_id=0), "pad_token_id is 0, not fairseq's 1"),
    (edit_json("config.json", eos_token_id=[2, 3]), "eos_token_id must be int"),
    (rewrite_weights(lambda w: w.update(extra=torch.zeros(1))), "holds extra, which no M2M100 model of config.json"),
    (rewrite_weights(lambda w: w.pop("model.encoder.layer_norm.bias")), "no model.encoder.layer_norm.bias, which"),
    (
        rewrite_weights(lambda w: w.update({"model.shared.weight": torch.zeros(506, 16)})),
        "model.shared.weight is (506, 16), config.json makes it (506, 32)",
    ),
    (
        rewrite_weights(lambda w: w.update({"lm_head.weight": torch.zeros(506, 32)})),
        "lm_head.weight differs from the tensor config.json ties it to",
    ),
    (rewrite_weights(nan_weight), "model.decoder.layers.1.fc1.weight holds NaN or infinite values"),
    (lambda f: rewrite_safetensors(f, drop_data=4), "model.safetensors: not readable weights (its header states"),
    (lambda f: rewrite_safetensors(f, header_bytes=1 << 20), "a safetensors header of 1,048,576 bytes, more than"),
    (lambda f: (f / "tokenizer.json").write_text("{" * 100_000), "tokenizer.json: not readable JSON"),
    (
        lambda f: (f / "tokenizer.json").write_text(" " * (2 << 20) + "{}"),
        "tokenizer.json: 2,097,154 bytes, more than the 1,129,536 config.json's 506 ids may take",
    ),
    (lambda f: (f / "tokenizer.json").write_text("[]"), "tokenizer.json: holds no list of added_tokens"),
    (
        edit_added_tokens(lambda t, _: token_id(t, "fra_Latn").update(id=token_id(t, "eng_Latn")["id"])),
        "added token 'fra_Latn' (id 348): 'eng_Latn' has that id too",
    ),
    (
        edit_added_tokens(lambda t, _: token_id(t, "eng_Latn").update(id=10**6)),
        "added token 'eng_Latn' (id 1000000): ids are 0 to 505",
    ),
    (edit_added_tokens(lambda t, _: token_id(t, "eng_Latn").update(id=10)), "(id 10): that id is the piece"),
    (edit_added_tokens(lambda t, _: token_id(t, "eng_Latn").update(content="fra_Latn")), "'fra_Latn' has two ids"),
    (edit_added_tokens(lambda t, _: token_id(t, "eng_Latn").update(id=0)), "fairseq's ids 0 to 3 are <s>, <pad>"),
    (edit_added_tokens(swap_vocab), "the files of two tokenizers"),
    (
        edit_added_tokens(lambda t, _: t.remove(token_id(t, "eng_Latn"))),
        "extra_special_tokens lists 'eng_Latn', which tokenizer.json gives no id",
    ),
    (
        edit_added_tokens(lambda t, _: t.__setitem__(slice(None), [*t[:4], token_id(t, "<mask>")])),
        "tokenizer.json: gives no language token",
    ),
    (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer.json, nor added_tokens_decoder in tokenizer_config"),
    (
        escaped_json("tokenizer.json", lambda d: token_id(d["added_tokens"], "eng_Latn").update(content="\ud800")),
        "added token '\\ud800' (id",
    ),
    (escaped_json("tokenizer.json", lambda d: d["model"].update(vocab=[[["x"], 0.0]])), "the files of two tokenizers"),
    (decoder_only({"²": {"content": "eng_Latn"}}), "added token 'eng_Latn' (id '²'): ids are 0 to 505"),
    (lambda f: (f / "sentencepiece.bpe.model").write_bytes(b"\x00garbage"), "bpe.model: not a SentencePiece model"),
    (lambda f: (f / "sentencepiece.bpe.model").unlink(), "no sentencepiece.bpe.model; NllbTokenizer segments"),
    (edit_json("tokenizer_config.json", tokenizer_class="BertTokenizer"), "tokenizer_class 'BertTokenizer'; mtkit"),
    (edit_json("tokenizer_config.json", unk_token="<oov>"), "unk_token is '<oov>'; these models' is fairseq's <unk>"),
    (link_out("tokenizer.json"), "tokenizer.json: a link to"),
]


@pytest.mark.parametrize(("edit", "message"), NLLB_REFUSALS)
def test_an_nllb_folder_mtkit_cannot_express_or_trust_is_refused_in_one_line(nllb, tmp_path, edit, message):
    folder = broken_copy(nllb.folder.path, tmp_path, edit)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), message)
    assert not (tmp_path / "model").exists()


def grow_vocab(pieces: int):
    """vocab.json with ``pieces`` more pieces, so that the language tokens no longer fit config.json's vocab_size."""

    def edit(folder: Path) -> None:
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        vocab |= {f"▁extra{i}": len(vocab) + i for i in range(pieces)}
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")

    return edit


def edit_vocab(change):
    def edit(folder: Path) -> None:
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        (folder / "vocab.json").write_text(json.dumps(change(vocab)), encoding="utf-8")

    return edit


M2M100_REFUSALS = [
    (edit_vocab(lambda v: v | {"▁a": 0}), "its ids must be 0 to"),
    (edit_vocab(lambda v: {k: i for i, k in enumerate(["<s>", "<unk>", "<pad>", "</s>", *list(v)[4:]])}), "<pad> mu"),
    (edit_vocab(lambda v: {f"x{k}" if i >= 4 else k: i for k, i in v.items()}), "pieces are not in vocab.json"),
    (edit_vocab(lambda v: v | {"__de__": len(v)}), "holds __de__, the token M2M100Tokenizer gives an id of its own"),
    (grow_vocab(10), "vocab_size 397 leaves no id for the language token __zh__"),
    (grow_vocab(400), "vocab.json: must map at most 397 pieces"),
    (lambda f: (f / "vocab.json").write_text("[1, 2]"), "vocab.json: must map at most 397 pieces"),
    (edit_json("tokenizer_config.json", language_codes="xx"), "language_codes 'xx' is not one of M2M100Tokenizer's"),
    (lambda f: (f / "vocab.json").unlink(), "no vocab.json; M2M100Tokenizer numbers the pieces by it"),
    (escaped_json("vocab.json", lambda v: v.update({"\udc80": len(v)})), "the piece '\\udc80' is not text of 1 to"),
    (link_out("sentencepiece.bpe.model"), "sentencepiece.bpe.model: a link to"),
]


@pytest.mark.parametrize(("edit", "message"), M2M100_REFUSALS)
def test_an_m2m100_folder_mtkit_cannot_trust_is_refused_in_one_line(m2m100, tmp_path, edit, message):
    folder = broken_copy(m2m100.folder.path, tmp_path, edit)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), message)
    assert not (tmp_path / "model").exists()


def test_a_pickle_that_runs_code_is_refused_and_does_not_run(m2m100, tmp_path):
    witness = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (witness,))

    def edit(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        torch.save({"model.shared.weight": Payload()}, folder / "pytorch_model.bin")

    folder = broken_copy(m2m100.folder.path, tmp_path, edit)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), "refused: it holds pickled Python")
    assert not witness.exists()


def import_in_3_gib(folder: Path, out: Path) -> subprocess.CompletedProcess:
    """`mtkit import hf FOLDER -o OUT` in a process limited to 3 GiB of address space."""
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
        "from mtkit.cli import main; sys.argv = ['mtkit', 'import', 'hf', sys.argv[1], '-o', sys.argv[2]]; main()"
    )
    return subprocess.run([sys.executable, "-c", script, folder, out], capture_output=True, text=True, timeout=120)


def test_a_config_json_of_a_huge_model_is_refused_before_anything_is_allocated(nllb, tmp_path):
    """config.json is compared with the weights file's header, never built first."""
    changes = {"encoder_layers": 1000, "decoder_layers": 1000, "d_model": 1024, "vocab_size": 1_000_000}
    folder = broken_copy(nllb.folder.path, tmp_path, edit_json("config.json", **changes))
    done = import_in_3_gib(folder, tmp_path / "model")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "config.json: encoder_layers is 1,000, and model.safetensors holds 2 encoder layers" in done.stderr


# -- NLLB-200 600M's shape --------------------------------------------------------------------------------------

NLLB_600M = {
    "model_type": "m2m_100",
    "vocab_size": 256_206,
    "d_model": 1024,
    "encoder_layers": 12,
    "decoder_layers": 12,
    "encoder_attention_heads": 16,
    "decoder_attention_heads": 16,
    "encoder_ffn_dim": 4096,
    "decoder_ffn_dim": 4096,
    "max_position_embeddings": 1024,
    "activation_function": "relu",
    "scale_embedding": True,
    "dropout": 0.1,
    "attention_dropout": 0.1,
    "activation_dropout": 0.0,
    "encoder_layerdrop": 0,
    "decoder_layerdrop": 0,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
    "num_hidden_layers": 12,
    "tokenizer_class": "NllbTokenizer",
}


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file stating float32 tensors of ``shapes``, its data a hole in a sparse file."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def test_nllb_200_600m_shape_is_accepted_by_its_header_alone(tmp_path):
    """NLLB-200-distilled-600M's config.json and a weights file of its 2.4 GB stated by its header alone: the shape
    checks accept it, reading no tensor (the file's data is a hole)."""
    (tmp_path / "config.json").write_text(json.dumps(NLLB_600M))
    settings = read_config(tmp_path / "config.json")
    reference = transformers.M2M100Config(**{k: v for k, v in NLLB_600M.items() if k != "tokenizer_class"})
    with torch.device("meta"):
        shapes = {
            key: tuple(value.shape)
            for key, value in transformers.M2M100ForConditionalGeneration(reference).state_dict().items()
            if key not in ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
        }
    sparse_safetensors(tmp_path / "model.safetensors", shapes)
    weights = open_weights(tmp_path, tensor_count(settings))
    check_shapes(weights, settings, tmp_path / "config.json")
    assert sum(math.prod(shape) for shape in weights.shapes.values()) > 600_000_000
    assert (settings.model.d_model, settings.model.heads, settings.model.ffn, settings.vocab_size) == (
        1024,
        16,
        4096,
        256_206,
    )


def nllb_vocabulary_folder(folder: Path, spm_pieces: int) -> None:
    """NLLB-200's tokenizer files at its full size: a SentencePiece model of ``spm_pieces`` pieces made up here, and a
    tokenizer.json giving the 202 codes and <mask> the ids the Hub's does."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    proto = model_pb2.ModelProto()
    proto.ParseFromString(fx.fairseq_spm(folder / "small.model").read_bytes())
    (folder / "small.model").unlink()
    Piece = proto.SentencePiece
    have = {p.piece for p in proto.pieces}
    made_up = (f"▁w{i}" for i in range(spm_pieces) if f"▁w{i}" not in have)
    proto.pieces.extend(
        Piece(piece=next(made_up), score=-1e6 - i, type=Piece.NORMAL) for i in range(spm_pieces - len(proto.pieces))
    )
    proto.trainer_spec.vocab_size = spm_pieces
    (folder / "sentencepiece.bpe.model").write_bytes(proto.SerializeToString())
    codes = list(FAIRSEQ_LANGUAGE_CODES)
    added = [{"id": i, "content": piece} for i, piece in enumerate(("<s>", "<pad>", "</s>", "<unk>"))]
    added += [{"id": spm_pieces + 1 + i, "content": code} for i, code in enumerate(codes)]
    added += [{"id": spm_pieces + 1 + len(codes), "content": "<mask>"}]
    (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": added}), encoding="utf-8")


@pytest.mark.slow
def test_a_model_of_nllb_200_600m_width_and_vocabulary_imports_whole(tmp_path):
    """One layer per stack at NLLB-200-distilled-600M's width, heads and vocabulary (256,206 ids, 0.5 GB of
    embeddings in float16, a tokenizer of the Hub's ids): imported through every check in about 20 s, its table's
    rows renumbered and every other weight as it is (the small models above show that this computes
    transformers' logits)."""
    config = {**NLLB_600M, "encoder_layers": 1, "decoder_layers": 1, "num_hidden_layers": 1}
    folder = tmp_path / "nllb"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    reference = transformers.M2M100Config(**{k: v for k, v in config.items() if k != "tokenizer_class"})
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.M2M100ForConditionalGeneration(reference).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    weights = {
        key: (torch.randn(shape, generator=generator) * 0.05).half()
        for key, shape in shapes.items()
        if key not in ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
    }
    safetensors.torch.save_file(weights, folder / "model.safetensors")
    nllb_vocabulary_folder(folder, 256_000)
    import_hf(str(folder), tmp_path / "model", src_lang="eng_Latn", tgt_lang="fra_Latn")
    state = safetensors.torch.load_file(tmp_path / "model" / checkpoint.WEIGHTS_FILE)
    table = weights["model.shared.weight"].float()
    assert torch.equal(state["encoder.embed.tokens.weight"][:4], table[[1, 3, 0, 2]])
    assert torch.equal(state["encoder.embed.tokens.weight"][4:], table[4:])
    assert torch.equal(state["decoder.layers.0.ffn.up.weight"], weights["model.decoder.layers.0.fc1.weight"].float())
    assert torch.equal(state["decoder.final_norm.bias"], weights["model.decoder.layer_norm.bias"].float())
    tokenizer = Tokenizer(tmp_path / "model" / checkpoint.TOKENIZER_NAMES[0])
    assert tokenizer.vocab_size == 256_206
    assert [tokenizer.sp.piece_to_id(piece) for piece in ("eng_Latn", "fra_Latn", "zul_Latn", "<mask>")] == [
        256_047,  # NLLB-200's ids
        256_057,
        256_202,
        256_203,
    ]
