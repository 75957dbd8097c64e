"""transformers export of models told their languages by tokens: an imported NLLB-200 or M2M100, and a model
fine-tuned from one, written as an M2M100ForConditionalGeneration folder with NllbTokenizer's or M2M100Tokenizer's
files, which generates what `mtkit translate` gives; imported again, the export is the model it came from.

The folders are tests/m2m100_fixture.py's with wider random weights (init_std 0.8) and the language tokens' rows
shrunk, so that greedy outputs are words, of varied lengths, that change with the source and the target language.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import m2m100_fixture as fx
import pytest
import safetensors.torch
import torch
import yaml
from helpers import HAND_BUILT_MODEL, invoke, one_line_error, save_run, with_header

import mtkit
from mtkit.config import DataConfig, ModelConfig, RunConfig, TokenizerConfig
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_spm
from mtkit.interop.export_folder import MANIFEST
from mtkit.interop.hf_import import import_hf
from mtkit.model import checkpoint, loading
from mtkit.model.transformer import build_model

with pytest.MonkeyPatch.context() as env:
    env.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CAP = 16  # tokens after the decoder's start, the target language's token and eos included: mtkit's max_len_b
# sources within the tiny models' 64 positions, which mtkit truncates a source to and transformers does not
SHORT = [line for line in fx.LINES["en"] if len(line) < 70][:10]
LINES = [*SHORT, "Ein älteres Mädchen läuft über die Straße.", "Ørsted, Łódź and Dvořák: çà et là."]


@dataclass
class Exported:
    folder: fx.FairseqFolder
    model: Path  # the mtkit import of the folder
    export: Path
    hf: object  # the export, loaded by transformers
    tokenizer: object

    def language_id(self, code: str) -> int:
        """The id of a language's token in the export (mtkit's is the same)."""
        return language_id(self.tokenizer, code)


def language_id(tok, code: str) -> int:
    """transformers' id of a language's token."""
    return tok.get_lang_id(code) if isinstance(tok, transformers.M2M100Tokenizer) else tok.convert_tokens_to_ids(code)


def varied(folder: fx.FairseqFolder) -> fx.FairseqFolder:
    """The folder's model with its language tokens' rows shrunk, which it would otherwise repeat."""
    ids = [language_id(folder.tokenizer, code) for code in folder.languages]
    with torch.no_grad():
        folder.hf.model.shared.weight[ids] *= 0.1
    folder.hf.save_pretrained(folder.path)
    return folder


def exported(folder: fx.FairseqFolder, root: Path, **languages) -> Exported:
    """``folder`` imported, then exported by `mtkit export --format hf`, and loaded by transformers."""
    import_hf(str(folder.path), root / "model", **languages)
    result = invoke("export", root / "model", "--format", "hf", "-o", root / "export")
    assert result.exit_code == 0 and "M2M100ForConditionalGeneration" in result.output, result.output
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(root / "export").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "export")
    return Exported(folder, root / "model", root / "export", hf, tokenizer)


@pytest.fixture(scope="module")
def nllb(tmp_path_factory) -> Exported:
    """transformers 5's NllbTokenizer ids, a default direction."""
    root = tmp_path_factory.mktemp("nllb")
    folder = varied(fx.nllb_folder(root, seed=4, init_std=0.8))
    return exported(folder, root, src_lang="eng_Latn", tgt_lang="fra_Latn")


@pytest.fixture(scope="module")
def nllb_hub(tmp_path_factory) -> Exported:
    """The Hub's ids (the codes before <mask>), GELU, no default direction."""
    root = tmp_path_factory.mktemp("nllb_hub")
    folder = varied(fx.nllb_folder(root, seed=4, hub_order=True, init_std=0.8, activation_function="gelu"))
    return exported(folder, root)


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory) -> Exported:
    """M2M100Tokenizer (vocab.json in an order of its own, lacking pieces), swish, a default source alone."""
    root = tmp_path_factory.mktemp("m2m100")
    folder = varied(fx.m2m100_folder(root, seed=4, init_std=0.8, activation_function="swish"))
    return exported(folder, root, src_lang="en")


@pytest.fixture(params=["nllb", "nllb_hub", "m2m100"])
def model(request) -> Exported:
    return request.getfixturevalue(request.param)


def languages_of(model: Exported) -> tuple[str, list[str]]:
    """A source language and three targets of the model's languages."""
    codes = model.folder.languages
    if isinstance(model.tokenizer, transformers.M2M100Tokenizer):
        return "en", ["fr", "de", "es"]
    return codes[codes.index("eng_Latn")], ["fra_Latn", "deu_Latn", "spa_Latn"]


def test_the_folder_holds_the_original_model_and_tokenizer(model):
    """The export of an import is the folder imported: the same weights, the same sentencepiece.bpe.model byte for
    byte, a tokenizer giving every text and language the same ids."""
    original = transformers.M2M100ForConditionalGeneration.from_pretrained(model.folder.path).state_dict()
    ours = model.hf.state_dict()
    assert original.keys() == ours.keys()
    assert all(torch.equal(original[name], ours[name]) for name in original)
    spm = "sentencepiece.bpe.model"
    assert (model.export / spm).read_bytes() == (model.folder.path / spm).read_bytes()
    source, targets = languages_of(model)
    theirs = model.folder.tokenizer
    for lang in (source, *targets):
        theirs.src_lang = model.tokenizer.src_lang = lang
        assert model.tokenizer(LINES)["input_ids"] == theirs(LINES)["input_ids"]
        assert model.language_id(lang) == language_id(theirs, lang)
    config = json.loads((model.export / "config.json").read_text())
    assert config["model_type"] == "m2m_100" and config["architectures"] == ["M2M100ForConditionalGeneration"]
    fairseq_ids = ("bos_token_id", "pad_token_id", "eos_token_id", "decoder_start_token_id")
    assert [config[name] for name in fairseq_ids] == [0, 1, 2, 2]
    assert config["scale_embedding"] and config["vocab_size"] == model.folder.hf.config.vocab_size


def mtkit_ids(generated: torch.Tensor, lead: int) -> list[list[int]]:
    """transformers' outputs (the decoder's start, the language's token, the translation, eos, padding) as mtkit's
    ids of the translation alone."""
    rows = []
    for row in fx.to_mtkit(generated).tolist():
        assert row[:2] == [EOS_ID, lead], row
        words = row[2:]
        rows.append(words[: words.index(EOS_ID)] if EOS_ID in words else words)
    return rows


@pytest.mark.parametrize("name", ["nllb_hub", "m2m100"])  # the third, nllb, in the fine-tuning test below
def test_generate_gives_what_mtkit_translate_gives(name, request, tmp_path):
    """Greedy: transformers' generate with the target language's token forced first, and mtkit told the languages
    (`mtkit translate --src-lang X --tgt-lang Y`, and the Python API), give the same translations, into each of three
    languages."""
    model = request.getfixturevalue(name)
    source, targets = languages_of(model)
    tok, bundle = model.tokenizer, loading.load_for_inference(model.model, CPU)
    tok.src_lang = source
    batch = tok(LINES, return_tensors="pt", padding=True)
    translator = mtkit.load(model.model, precision="fp32", beam=1, max_len_a=0.0, max_len_b=CAP)
    outputs = []
    for target in targets:
        lead = model.language_id(target)
        with torch.no_grad():
            generated = model.hf.generate(**batch, forced_bos_token_id=lead, num_beams=1, max_new_tokens=CAP)
        expected = bundle.tgt_tok.decode(mtkit_ids(generated, lead))
        assert translator.translate(LINES, tgt_lang=target, src_lang=source) == expected
        outputs.append(expected)
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    options = ("--src-lang", source, "--tgt-lang", targets[0], "--beam", "1", "--max-len-a", "0", "--max-len-b", CAP)
    result = invoke("translate", model.model, "-i", tmp_path / "in.txt", "--precision", "fp32", *options)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == outputs[0]
    assert len(set(map(tuple, outputs))) == len(targets)  # the target language matters,
    assert len(set(outputs[0])) > len(LINES) // 2  # and the source


def test_the_logits_are_mtkits(model):
    """Teacher-forced, the export's logits are mtkit's, the ids renumbered, to 1e-4."""
    source, targets = languages_of(model)
    tok, bundle = model.tokenizer, loading.load_for_inference(model.model, CPU)
    tok.src_lang, tok.tgt_lang = source, targets[0]
    batch = tok(LINES[:6], text_target=fx.LINES["fr"][:6], return_tensors="pt", padding=True)
    labels = batch["labels"]
    decoder_in = torch.cat([torch.full_like(labels[:, :1], 2), labels[:, :-1]], dim=1)
    real = decoder_in != 1
    with torch.no_grad():
        theirs = model.hf(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_in
        )
        src, tgt_in = fx.to_mtkit(batch["input_ids"]), fx.to_mtkit(decoder_in)
        tgt_in[:, 0] = BOS_ID  # mtkit's search starts from bos, which the decoder reads as eos
        ours = bundle.model(src, src == PAD_ID, tgt_in.masked_fill(~real, PAD_ID))
    columns = fx.to_mtkit(torch.arange(theirs.logits.size(-1)))
    torch.testing.assert_close(ours[real][:, columns], theirs.logits[real], atol=1e-4, rtol=1e-4)


def test_the_export_imports_back_as_the_same_model(model, tmp_path):
    import_hf(str(model.export), tmp_path / "again")
    first, again = (checkpoint.read_checkpoint(path) for path in (model.model, tmp_path / "again"))
    assert first.weights.keys() == again.weights.keys()
    assert all(torch.equal(first.weights[name], again.weights[name]) for name in first.weights)
    assert (model.model / "spm.model").read_bytes() == (tmp_path / "again" / "spm.model").read_bytes()
    data, data_again = first.cfg.data, again.cfg.data
    assert (data_again.languages, data_again.language_token) == (data.languages, data.language_token)
    if data.tgt_lang in data.languages:  # the default target is the export's forced_bos_token_id, and back
        assert model.hf.generation_config.forced_bos_token_id == model.language_id(data.tgt_lang)


def test_a_fine_tuned_model_exports_and_translates_as_mtkit(nllb, tmp_path):
    """`mtkit train` from the import (its language tokens kept), then the export: generate and mtkit agree."""
    for lang in ("en", "fr"):
        (tmp_path / f"train.{lang}").write_text("\n".join(fx.LINES[lang][:200]) + "\n", encoding="utf-8")
    config = {
        "data": {
            "train_src": str(tmp_path / "train.en"),
            "train_tgt": str(tmp_path / "train.fr"),
            "src_lang": "eng_Latn",
            "tgt_lang": "fra_Latn",
            "max_tokens": 60,
        },
        "train": {
            **{"init_from": str(nllb.model), "max_steps": 3, "lr": 3e-3, "warmup": 1, "batch_tokens": 1024},
            **{"save_every": 3, "valid_every": 3, "device": "cpu", "precision": "fp32"},
        },
    }
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config))
    result = invoke("train", tmp_path / "ft.yaml", "--out", tmp_path / "ft")
    assert result.exit_code == 0, result.output
    result = invoke("export", tmp_path / "ft", "--format", "hf", "-o", tmp_path / "export")
    assert result.exit_code == 0, result.output
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    tuned = loading.load_for_inference(tmp_path / "ft", CPU)
    base = loading.load_for_inference(nllb.model, CPU)
    assert not torch.equal(tuned.model.decoder.final_norm.weight, base.model.decoder.final_norm.weight)
    tok.src_lang, lead = "eng_Latn", tok.convert_tokens_to_ids("deu_Latn")
    with torch.no_grad():
        generated = hf.generate(**tok(LINES, return_tensors="pt", padding=True), forced_bos_token_id=lead,
                                num_beams=1, max_new_tokens=CAP)  # fmt: skip
    translator = mtkit.load(tmp_path / "ft", precision="fp32", beam=1, max_len_a=0.0, max_len_b=CAP)
    assert translator.translate(LINES, tgt_lang="deu_Latn") == tuned.tgt_tok.decode(mtkit_ids(generated, lead))


def language_token_run(root: Path, trilingual_files) -> Path:
    """A model mtkit trains itself with language tokens of its own: pieces among the text's (user-defined)."""
    lines = [line for lang in ("en", "de") for line in trilingual_files[f"train.{lang}"].read_text().splitlines()]
    symbols = ["__en__", "__de__"]
    tok = Tokenizer(train_spm(lines, root / "spm", TokenizerConfig(vocab_size=200), symbols=symbols))
    model_cfg = ModelConfig(
        **{**HAND_BUILT_MODEL, "norm": "pre", "positions": "fairseq", "decoder_start": "eos", "tie_embeddings": True}
    )
    data = DataConfig(languages=("en", "de"), language_token="__{lang}__", src_lang="en", tgt_lang="de")
    model = build_model(model_cfg, tok.vocab_size, tok.vocab_size, PAD_ID)
    return save_run(root / "run", RunConfig(model=model_cfg, data=data), model, {"src": tok, "tgt": tok})


def test_models_m2m100_cannot_express_are_refused_in_one_line(nllb, tmp_path, trilingual_files):
    own = language_token_run(tmp_path, trilingual_files)
    one_line_error(
        invoke("export", own, "--format", "hf", "-o", tmp_path / "out"),
        "cannot export to transformers",
        "no control piece after the text's",
        "export it to CTranslate2",
    )
    assert not (tmp_path / "out").exists()
    sinusoidal = tmp_path / "sinusoidal.safetensors"

    def edit(meta):
        meta["config"]["model"]["positions"] = "sinusoidal"

    with_header(nllb.model / "model.safetensors", sinusoidal, edit)
    (tmp_path / "spm.model").write_bytes((nllb.model / "spm.model").read_bytes())
    one_line_error(
        invoke("export", sinusoidal, "--format", "hf", "-o", tmp_path / "out"),
        "M2M100ForConditionalGeneration has model.positions fairseq; this model has sinusoidal",
    )


def test_the_manifest_marks_the_export_and_a_second_export_replaces_it(nllb, tmp_path):
    manifest = json.loads((nllb.export / MANIFEST).read_text())
    assert manifest["runtime"] == "transformers" and manifest["step"] == 0
    weights = safetensors.torch.load_file(nllb.export / "model.safetensors")
    assert weights["model.shared.weight"].dtype == torch.float32
    result = invoke("export", nllb.model, "--format", "hf", "-o", nllb.export)
    assert result.exit_code == 0, result.output
    assert json.loads((nllb.export / MANIFEST).read_text()) == manifest
