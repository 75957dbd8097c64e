"""Models told their source and target language by tokens (data.languages, as NLLB-200 and M2M100 are): the source
language's token before each source, the target language's forced first and left out of the translation, the
decoder reading eos where the search starts, fairseq's sinusoids; every engine path and training agree with a
plain reference computed here step by step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import yaml

import mtkit
from mtkit.config import ConfigError, DataConfig, DecodeConfig, ModelConfig, RunConfig, TokenizerConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_spm
from mtkit.decoding.continuous import LineSearch
from mtkit.decoding.forced import forced_log_probs
from mtkit.decoding.search import beam_search
from mtkit.model.transformer import build_model
from tests.helpers import HAND_BUILT_MODEL, invoke, joint_run, one_line_error, randomise_norms_, save_run

LANGS = ("en", "de", "fr")
TOKEN = "__{lang}__"
LINES = ["A dog runs in the park.", "Two men are playing football.", "A woman rides a red bicycle.", "Hello"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, trilingual_files) -> Tokenizer:
    lines = [line for lang in LANGS for line in trilingual_files[f"train.{lang}"].read_text().splitlines()]
    symbols = [TOKEN.format(lang=lang) for lang in LANGS]
    return Tokenizer(
        train_spm(lines, tmp_path_factory.mktemp("spm") / "spm", TokenizerConfig(vocab_size=300), symbols=symbols)
    )


def language_run(root, tok: Tokenizer, src_lang: str = "en", tgt_lang: str = "de", **model):
    """A hand-built pre-norm model with fairseq positions and eos as its decoder start, told en/de/fr by tokens."""
    model_cfg = ModelConfig(
        **{
            **HAND_BUILT_MODEL,
            "norm": "pre",
            "positions": "fairseq",
            "decoder_start": "eos",
            "tie_embeddings": False,
            **model,
        }
    )
    data = DataConfig(languages=LANGS, language_token=TOKEN, src_lang=src_lang, tgt_lang=tgt_lang)
    torch.manual_seed(3)
    built = build_model(model_cfg, tok.vocab_size, tok.vocab_size, PAD_ID)
    randomise_norms_(built, seed=4)
    with torch.no_grad():
        built.output.weight[EOS_ID] *= 2.5  # outputs of varied lengths, ending before the cap
        built.output.weight[[token_id(tok, lang) for lang in LANGS]] = 0.0  # outputs of words, not tokens
    cfg = RunConfig(model=model_cfg, data=data)
    return save_run(root / "run", cfg, built, {"src": tok, "tgt": tok}), built.eval()


@pytest.fixture(scope="module")
def run_and_model(tmp_path_factory, tokenizer):
    return language_run(tmp_path_factory.mktemp("langtok"), tokenizer)


def token_id(tok: Tokenizer, lang: str) -> int:
    return tok.sp.piece_to_id(TOKEN.format(lang=lang))


def reference_greedy(model, tok: Tokenizer, line: str, src: str, tgt: str, cap: int) -> list[int]:
    """Greedy search as plainly as it can be written: the whole decoder input again at every step, the source
    language's token before the source, bos then the target language's token before the output, at most ``cap``
    tokens after bos (the language's token and eos included)."""
    source = torch.tensor([[token_id(tok, src), *tok.encode([line])[0], EOS_ID]])
    decoded = [BOS_ID, token_id(tok, tgt)]
    while len(decoded) < cap:  # the tokens after bos, and the eos it takes next
        logits = model(source, source == PAD_ID, torch.tensor([decoded]))[0, -1]
        logits[[PAD_ID, BOS_ID]] = -math.inf
        if int(logits.argmax()) == EOS_ID:
            break
        decoded.append(int(logits.argmax()))
    return decoded[2:]


def test_greedy_translation_starts_from_the_languages_tokens(run_and_model, tokenizer):
    run, model = run_and_model
    translator = mtkit.load(run, precision="fp32", beam=1, max_len_a=0.0, max_len_b=12)
    for src, tgt in (("en", "de"), ("en", "fr"), ("fr", "de")):
        wanted = [tokenizer.decode([reference_greedy(model, tokenizer, line, src, tgt, 12)])[0] for line in LINES]
        assert translator.translate(LINES, tgt_lang=tgt, src_lang=src) == wanted
    outputs = {tgt: translator.translate(LINES, tgt_lang=tgt) for tgt in ("de", "fr")}
    assert outputs["de"] != outputs["fr"]  # the target language's token is what differs
    assert translator.translate(LINES) == outputs["de"]  # the config's default direction, en->de


def test_the_decoder_reads_eos_where_the_search_starts(run_and_model, tokenizer):
    _, model = run_and_model
    source = torch.tensor([[token_id(tokenizer, "en"), *tokenizer.encode([LINES[0]])[0], EOS_ID]])
    mask = source == PAD_ID
    start = [token_id(tokenizer, "de"), 17, 23]
    from_bos = model(source, mask, torch.tensor([[BOS_ID, *start]]))
    from_eos = model(source, mask, torch.tensor([[EOS_ID, *start]]))
    torch.testing.assert_close(from_bos, from_eos, rtol=0, atol=0)
    model.decoder.start_reads_eos = False
    try:
        assert not torch.allclose(model(source, mask, torch.tensor([[BOS_ID, *start]])), from_eos)
    finally:
        model.decoder.start_reads_eos = True


def test_beam_search_and_continuous_batching_agree(run_and_model):
    run, _ = run_and_model
    translator = mtkit.load(run, precision="fp32", beam=4, max_len_a=0.0, max_len_b=12).into("fr", "de")
    wanted = translator.translate(LINES)
    search = LineSearch(translator)
    for key, line in enumerate(LINES):
        search.add(key, line)
    found: dict[int, str] = {}
    while len(found) < len(LINES):
        found.update((key, hyps[0].text) for key, hyps in search.step())
    assert [found[key] for key in range(len(LINES))] == wanted


def test_scores_leave_the_target_languages_token_out(run_and_model, tokenizer):
    run, model = run_and_model
    translator = mtkit.load(run, precision="fp32")
    targets = ["Ein Hund läuft.", "", "Zwei Männer"]
    scores = list(translator.score(LINES[:3], targets, tgt_lang="de", tokens=True))
    for line, target, score in zip(LINES, targets, scores):
        ids = tokenizer.encode([target])[0]
        source = torch.tensor([[token_id(tokenizer, "en"), *tokenizer.encode([line])[0], EOS_ID]])
        logits = model(source, source == PAD_ID, torch.tensor([[BOS_ID, token_id(tokenizer, "de"), *ids]]))[0, 1:]
        wanted = F.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor([*ids, EOS_ID])[:, None]).squeeze(-1)
        assert score.tokens == len(ids) + 1
        assert score.token_logprobs == pytest.approx(wanted.tolist(), abs=1e-4)


def test_a_beam_translation_scores_as_scoring_gives_it(run_and_model, tokenizer):
    """Search counts the target language's token as certain (log-probability 0, as transformers' forced first
    token), and scoring reads it without scoring it: the two agree on every hypothesis."""
    _, model = run_and_model
    lead = token_id(tokenizer, "fr")
    sources = [[token_id(tokenizer, "de"), *ids] for ids in tokenizer.encode(LINES)]
    src, mask = source_tensor(sources)
    found = beam_search(model, src, mask, DecodeConfig(beam=3, max_len_a=0.0, max_len_b=12), 3, [[lead]] * 4, lead=1)
    for row, hyps in enumerate(found):
        assert all(h.tokens[0] == lead for h in hyps)
        outputs = [h.tokens[1:] for h in hyps]
        n = len(outputs)
        scored = forced_log_probs(
            model, src[row : row + 1].expand(n, -1), mask[row : row + 1].expand(n, -1), outputs, (lead,)
        )
        for hyp, logprobs in zip(hyps, scored):
            assert sum(logprobs) == pytest.approx(hyp.logprob, abs=1e-4)


def test_languages_are_chosen_or_refused_in_one_line(tmp_path, tokenizer, run_and_model):
    run, _ = run_and_model
    translator = mtkit.load(run, precision="fp32")
    with pytest.raises(ConfigError, match="'es' is not one of this model's 3 languages"):
        translator.translate(LINES, tgt_lang="es")
    undecided, _ = language_run(tmp_path, tokenizer, src_lang="src", tgt_lang="tgt")
    loaded = mtkit.load(undecided, precision="fp32")
    with pytest.raises(ConfigError, match="say the target language with --tgt-lang"):
        loaded.translate(LINES)
    with pytest.raises(ConfigError, match="say the source language with --src-lang"):
        loaded.translate(LINES, tgt_lang="de")
    assert loaded.translate(LINES, tgt_lang="de", src_lang="en") == translator.translate(LINES)
    source = tmp_path / "in.en"
    source.write_text("\n".join(LINES) + "\n")
    result = invoke("translate", str(undecided), "-i", str(source), "--tgt-lang", "de")
    one_line_error(result, "say the source language with --src-lang")
    result = invoke("translate", str(undecided), "-i", str(source), "--tgt-lang", "de", "--src-lang", "en")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == translator.translate(LINES)


def test_a_model_of_one_direction_checks_the_source_language(tmp_path, spm_model):
    translator = mtkit.load(joint_run(tmp_path, spm_model, seed=1), precision="fp32")
    with pytest.raises(ConfigError, match="not trained to translate 'fr' into 'tgt'"):
        translator.translate(LINES, src_lang="fr")
    assert translator.translate(LINES[:1], src_lang="src") == translator.translate(LINES[:1])


def test_fine_tuning_reads_and_predicts_the_languages_tokens(tmp_path, run_and_model, tokenizer, trilingual_files):
    run, _ = run_and_model
    config = {
        "data": {
            "train_src": str(trilingual_files["train.en"]),
            "train_tgt": str(trilingual_files["train.fr"]),
            "valid_src": str(trilingual_files["val.en"]),
            "valid_tgt": str(trilingual_files["val.fr"]),
            "src_lang": "en",
            "tgt_lang": "fr",
            "cache_dir": str(tmp_path / "cache"),
            "max_tokens": 100,
        },
        "train": {"init_from": str(run), "max_steps": 4, "valid_every": 4, "save_every": 4, "batch_tokens": 512},
    }
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config))
    result = invoke("train", str(tmp_path / "ft.yaml"), "--out", str(tmp_path / "ft"))
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((tmp_path / "ft" / "config.yaml").read_text())
    assert tuple(saved["data"]["languages"]) == LANGS and saved["data"]["language_token"] == TOKEN
    from mtkit.data.token_store import TokenStore

    (store_dir,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    store = TokenStore(store_dir, (tokenizer.vocab_size, tokenizer.vocab_size))
    first = store.collate([0])
    assert int(first.src[0, 0]) == token_id(tokenizer, "en")
    assert int(first.tgt_in[0, 0]) == BOS_ID and int(first.tgt_in[0, 1]) == token_id(tokenizer, "fr")
    tuned = mtkit.load(tmp_path / "ft")
    assert tuned.into("fr").languages == ("en", "fr")
    assert len(tuned.translate(LINES, tgt_lang="fr")) == len(LINES)


def test_fine_tuning_keeps_the_models_language_tokens(tmp_path, run_and_model, trilingual_files):
    run, _ = run_and_model
    config = {
        "data": {
            "train_src": str(trilingual_files["train.en"]),
            "train_tgt": str(trilingual_files["train.fr"]),
            "src_lang": "en",
            "tgt_lang": "fr",
            "language_token": "<{lang}>",
            "languages": list(LANGS),
        },
        "train": {"init_from": str(run), "max_steps": 1},
    }
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config))
    result = invoke("train", str(tmp_path / "ft.yaml"), "--out", str(tmp_path / "ft"))
    one_line_error(result, "data.language_token", "leave data.language_token out")


def test_language_settings_are_checked():
    with pytest.raises(ConfigError, match="names en twice"):
        DataConfig(languages=("en", "en"), language_token=TOKEN)
    with pytest.raises(ConfigError, match="needs data.languages"):
        DataConfig(language_token=TOKEN)
    with pytest.raises(ConfigError, match=r"must hold \{lang\} once"):
        DataConfig(languages=LANGS, language_token="lang")
    with pytest.raises(ConfigError, match="not a language code"):
        DataConfig(languages=("en", "x y"), language_token=TOKEN)
    with pytest.raises(ConfigError, match="fairseq needs an even d_model"):
        ModelConfig(d_model=33, heads=1, positions="fairseq")


@pytest.fixture(scope="module", params=["nllb", "m2m100"])
def imported(request, tmp_path_factory):
    """A tiny NLLB-200 or M2M100 folder (tests/m2m100_fixture.py) and its import, with no default direction."""
    from mtkit.interop.hf_import import import_hf
    from tests import m2m100_fixture

    root = tmp_path_factory.mktemp(request.param)
    build = m2m100_fixture.nllb_folder if request.param == "nllb" else m2m100_fixture.m2m100_folder
    folder = build(root)
    return folder, import_hf(str(folder.path), root / "imported"), request.param


@pytest.mark.parametrize("src_lang, tgt_lang", [(0, 1), (1, 2), (2, 0)])
def test_an_imported_model_translates_as_generate_with_its_forced_first_token(imported, src_lang, tgt_lang):
    """mtkit's greedy translation into a language chosen by --tgt-lang is transformers' generate with that
    language's token forced first (and <s>, which mtkit never outputs, suppressed)."""
    folder, model, kind = imported
    codes = {"nllb": ("eng_Latn", "deu_Latn", "fra_Latn"), "m2m100": ("en", "de", "fr")}[kind]
    src, tgt = codes[src_lang], codes[tgt_lang]
    lines = m2m100_fixture_lines(src)
    translator = mtkit.load(model, precision="fp32", beam=1, max_len_a=0.0, max_len_b=24)
    tokenizer = folder.tokenizer
    tokenizer.src_lang = src
    forced = tokenizer.convert_tokens_to_ids(tgt) if kind == "nllb" else tokenizer.get_lang_id(tgt)
    language_ids = {
        tokenizer.convert_tokens_to_ids(code) if kind == "nllb" else tokenizer.get_lang_id(code)
        for code in folder.languages
    }
    wanted = []
    for line in lines:
        encoded = tokenizer([line], return_tensors="pt")
        generated = folder.hf.generate(
            **encoded, forced_bos_token_id=forced, num_beams=1, do_sample=False, max_new_tokens=23, suppress_tokens=[0]
        )
        # a random model also outputs language tokens, which mtkit decodes as nothing (M2M100Tokenizer writes them)
        kept = [i for i in generated[0].tolist() if i not in language_ids]
        wanted.append(tokenizer.decode(kept, skip_special_tokens=True))
    assert translator.translate(lines, tgt_lang=tgt, src_lang=src) == wanted


def m2m100_fixture_lines(lang: str) -> list[str]:
    from tests import m2m100_fixture

    return m2m100_fixture.LINES[{"eng_Latn": "en", "deu_Latn": "de", "fra_Latn": "fr"}.get(lang, lang)][:6]


def test_attention_maps_are_refused_for_a_model_told_its_languages(run_and_model, tmp_path):
    run, _ = run_and_model
    result = invoke("attention", str(run), "--src", LINES[0], "-o", str(tmp_path / "a.png"))
    one_line_error(result, "draws a model of one direction")


def test_a_scorer_of_any_two_languages_for_filtering_and_reranking(run_and_model):
    from mtkit.translation.pair_filter import load_scorer

    run, _ = run_and_model
    scorer = load_scorer(run, "de", "fr", "the --reverse-model", device="cpu", precision="fp32")
    assert scorer.languages == ("de", "fr")
    plain = mtkit.load(run, precision="fp32")
    targets = ["Un chien.", "Deux hommes."]
    assert list(scorer.score(LINES[:2], targets)) == list(plain.score(LINES[:2], targets, "fr", src_lang="de"))
    with pytest.raises(ConfigError, match="'es' is not one of this model's 3 languages"):
        load_scorer(run, "es", "fr", "the forward model", device="cpu", precision="fp32")
