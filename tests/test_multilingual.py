"""Several corpora in one model: the config, batches drawn by weight and temperature, language tags, exact resume,
per-direction validation, and choosing the target language in the command line, the API and the exports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from helpers import invoke, multilingual_raw, one_line_error

import mtkit
from mtkit.config import ConfigError, CorpusConfig, DataConfig, TokenizerConfig, from_dict, read_config
from mtkit.data import directions
from mtkit.data.parallel import collate, token_batches
from mtkit.data.sampling import CorpusMix, corpus_probabilities
from mtkit.data.tokenizer import EOS_ID, Tokenizer, train_spm
from mtkit.decoding.continuous import LineSearch
from mtkit.decoding.line_translator import source_ids
from mtkit.model import checkpoint
from mtkit.model.loading import load_for_inference
from mtkit.model.loss import TrainingObjective
from mtkit.model.transformer import Transformer
from mtkit.training.tokenizers import balanced_sentences
from mtkit.training.trainer import Trainer


def _config(files, **sections):
    return from_dict(multilingual_raw(files, **sections))


# -- the config ------------------------------------------------------------------------------------------------


def test_corpora_are_read_from_yaml_with_their_weights(tmp_path, trilingual_files):
    raw = multilingual_raw(trilingual_files)
    raw["data"]["corpora"][1]["weight"] = 2.5
    raw["data"]["temperature"] = 3
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = read_config(tmp_path / "c.yaml")
    assert [(c.direction, c.weight) for c in cfg.data.corpora] == [("en-de", 1.0), ("en-fr", 2.5)]
    assert cfg.data.temperature == 3.0
    assert from_dict(cfg.to_dict()) == cfg  # as a checkpoint header stores it and reads it back
    assert directions.directions(cfg.data) == [("en", "de"), ("en", "fr")]
    assert directions.reserved_symbols(cfg.data) == ["<2de>", "<2fr>"]


@pytest.mark.parametrize(
    ("corpus", "message"),
    [
        ({"weight": 0}, "data.corpora[1]: weight must be > 0, got 0"),
        ({"weight": -1.5}, "data.corpora[1]: weight must be > 0, got -1.5"),
        ({"tgt_lang": "f r"}, "data.corpora[1]: tgt_lang 'f r' is not a language code"),
        ({"tgt_lang": "en"}, "data.corpora[1]: src_lang and tgt_lang are both en"),
        ({"prepared": "somewhere"}, "data.corpora[1]: give one of train_src, prepared and corpus"),
        ({"colour": "red"}, "unknown config key data.corpora[1].colour"),
    ],
)
def test_a_bad_corpus_is_one_line_naming_it(tmp_path, trilingual_files, corpus, message):
    raw = multilingual_raw(trilingual_files)
    raw["data"]["corpora"][1].update(corpus)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: " + message.replace("[", r"\[").replace("]", r"\]")):
        read_config(tmp_path / "c.yaml")


def test_corpora_do_not_mix_with_the_single_corpus_keys(trilingual_files):
    raw = multilingual_raw(trilingual_files)
    raw["data"]["train_src"] = str(trilingual_files["train.en"])
    with pytest.raises(ConfigError, match="data.corpora replaces data.train_src"):
        from_dict(raw)
    raw = multilingual_raw(trilingual_files)
    raw["data"]["corpora"].append(dict(raw["data"]["corpora"][0]))
    with pytest.raises(ConfigError, match="two validation sets for en-de"):
        from_dict(raw)
    with pytest.raises(ConfigError, match="data.temperature must be > 0"):
        DataConfig(temperature=0)


def test_a_file_named_for_another_language_than_its_side_is_refused(trilingual_files):
    raw = multilingual_raw(trilingual_files)
    raw["data"]["corpora"][1]["train_tgt"] = str(trilingual_files["train.de"])  # en-fr given the German side
    with pytest.raises(ConfigError, match=r"data.corpora\[1\] \(en-fr\): .*train.de is named as de text, but the "):
        directions.corpus_files(from_dict(raw).data)


# -- drawing batches -------------------------------------------------------------------------------------------


def test_probabilities_follow_weighted_sizes_flattened_by_the_temperature():
    assert corpus_probabilities([100, 300], [1, 1], 1.0) == pytest.approx([0.25, 0.75])
    assert corpus_probabilities([100, 300], [3, 1], 1.0) == pytest.approx([0.5, 0.5])
    p = corpus_probabilities([100, 900], [1, 1], 2.0)  # (0.1, 0.9) ** 0.5 = (0.316, 0.949)
    assert p == pytest.approx([0.25, 0.75])
    assert corpus_probabilities([1, 10**9], [1, 1], 1e6) == pytest.approx([0.5, 0.5], abs=1e-4)


class _Store:
    """What CorpusMix asks of a token store: its batches of an epoch (here a corpus of ``pairs`` one-pair batches)."""

    def __init__(self, pairs: int) -> None:
        self.pairs = pairs

    def batch_indices(self, batch_tokens: int, seed: int, multiple: int = 1) -> list[np.ndarray]:
        return [np.array([i]) for i in np.random.default_rng(seed).permutation(self.pairs)]


def test_corpora_are_drawn_within_binomial_bounds_and_each_walks_its_epochs_in_order():
    stores = [_Store(7), _Store(50), _Store(13)]
    p = corpus_probabilities([7, 50, 13], [4, 1, 1], 1.5)
    mix = CorpusMix(stores, p, batch_tokens=100, seed=3)
    position, draws = mix.start(), 20_000
    taken: list[list[int]] = [[], [], []]
    for _ in range(draws):
        corpus, indices = mix.next(position)
        taken[corpus].append(int(indices[0]))
    for corpus, share in enumerate(p):
        sd = math.sqrt(draws * share * (1 - share))
        assert abs(len(taken[corpus]) - draws * share) < 5 * sd, (corpus, len(taken[corpus]), draws * share)
        # each corpus gives its epochs' batches in order, every pair once per epoch, a new order each epoch
        size = stores[corpus].pairs
        epochs = [taken[corpus][i : i + size] for i in range(0, len(taken[corpus]), size)]
        full = [e for e in epochs if len(e) == size]
        assert all(sorted(e) == list(range(size)) for e in full)
        assert len({tuple(e) for e in full}) > 1
        assert position[1 + 2 * corpus] == len(full) + (len(epochs) > len(full) or 0)
    assert position[0] == draws


def test_a_mix_goes_on_from_a_copied_position_as_if_never_stopped():
    stores = [_Store(5), _Store(9)]
    mix = CorpusMix(stores, corpus_probabilities([5, 9], [1, 1], 1.0), 100, seed=11)
    straight = mix.start()
    uninterrupted = [(c, int(i[0])) for c, i in (mix.next(straight) for _ in range(60))]
    position = mix.start()
    first = [(c, int(i[0])) for c, i in (mix.next(position) for _ in range(23))]
    saved = json.loads(json.dumps(position))  # as a checkpoint stores it
    fresh = CorpusMix(stores, corpus_probabilities([5, 9], [1, 1], 1.0), 100, seed=11)  # a new process
    rest = [(c, int(i[0])) for c, i in (fresh.next(saved) for _ in range(37))]
    assert first + rest == uninterrupted


# -- training --------------------------------------------------------------------------------------------------


def test_resumed_mid_epoch_with_several_corpora_equals_uninterrupted_training(tmp_path, trilingual_files):
    def config(steps):
        train = {"max_steps": steps, "batch_tokens": 256, "save_every": 1, "valid_every": 0, "log_every": 1}
        return _config(trilingual_files, train={**train, "valid_bleu": False, "best_metric": "loss"})

    straight = Trainer(config(8), tmp_path / "a")
    straight.run()
    Trainer(config(5), tmp_path / "b").run()
    resumed = Trainer(config(8), tmp_path / "b")
    assert resumed.progress.step == 5 and 0 < resumed.progress.mix[0] == 5
    assert all(batch < 50 for batch in resumed.progress.mix[2::2])  # mid-epoch: an epoch here is dozens of batches
    resumed.run()
    assert resumed.progress.mix == straight.progress.mix
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    # Each corpus walks its own epochs: the metrics give each one's, in the config's order, not one run epoch.
    lines = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    last_train = [r for r in lines if r["event"] == "train"][-1]
    assert last_train["epochs"] == straight.progress.mix[1::2] and "epoch" not in last_train


def test_a_single_corpus_config_trains_on_the_batches_it_always_has(tmp_path, corpus_files, spm_model):
    """The one-corpus path draws each epoch's batches as before corpora existed: the store's token batches in
    the order its seed gives, no corpus draws, a store key without tags."""
    from helpers import small_config

    cfg = small_config(corpus_files, spm_model, max_steps=4, save_every=0)
    trainer = Trainer(cfg, tmp_path)
    assert trainer.mix is None and "source_prefix" not in trainer.corpus.meta["key"]
    store = trainer.corpus
    seed = cfg.train.seed * 100_003 + 1  # epoch 1
    expected = token_batches(store.src_lengths, store.tgt_lengths, cfg.train.batch_tokens, seed=seed)
    groups = trainer.update_groups()
    for indices in expected[:4]:
        (batch,) = next(groups).batches
        assert torch.equal(batch.src, store.collate(indices).src)
    trainer.cleanup()


def test_tags_are_pieces_the_tokenizer_never_splits(multilingual_run):
    tok = Tokenizer(multilingual_run / "spm.model")
    for tag in ("<2de>", "<2fr>"):
        tag_id = tok.sp.piece_to_id(tag)
        assert tag_id > 3 and tok.sp.id_to_piece(tag_id) == tag
        assert tag_id in tok.encode([f"{tag} A man reads."])[0]
        assert tag_id in tok.encode([f"x{tag}y"])[0]  # even glued to words
    assert tok.missing_symbols(["<2de>", "<2es>"]) == ["<2es>"]


def test_each_language_gets_an_equal_share_of_the_tokenizer_sample(trilingual_files):
    cfg = _config(trilingual_files)
    corpora = directions.corpus_files(cfg.data)
    by_language = {lang: set(trilingual_files[f"train.{lang}"].read_text().splitlines()) for lang in ("en", "de", "fr")}
    sample = balanced_sentences(corpora, None, 300, seed=1)  # English is in both corpora, but counted once
    counts = {lang: sum(s in lines for s in sample) for lang, lines in by_language.items()}
    assert len(sample) == 300 and counts == {"en": 100, "de": 100, "fr": 100}
    whole = balanced_sentences(corpora, None, 0, seed=1)
    assert sorted(whole) == sorted(set().union(*by_language.values()))
    assert balanced_sentences(corpora, "tgt", 100, seed=1) == balanced_sentences(corpora, "tgt", 100, seed=1)


def test_validation_scores_each_direction_and_follows_their_mean(multilingual_run):
    records = [json.loads(line) for line in (multilingual_run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["event"] == "valid"]
    assert [r["step"] for r in valid] == [150, 300]
    for r in valid:
        assert set(r["valid_bleu_by_direction"]) == {"en-de", "en-fr"}
        assert r["valid_bleu"] == pytest.approx(sum(r["valid_bleu_by_direction"].values()) / 2)
    best = checkpoint.read_checkpoint(multilingual_run / "best", with_state=False)
    assert set(best.meta["validation"]["valid_bleu_by_direction"]) == {"en-de", "en-fr"}


# -- translating -----------------------------------------------------------------------------------------------


def test_the_tag_chooses_the_language_of_the_output(multilingual_run, trilingual_files):
    """Each language's references are likelier after their own tag than after the other's, and the translations
    into the two languages differ."""
    bundle = load_for_inference(multilingual_run, torch.device("cpu"))
    objective = TrainingObjective(bundle.model, 0.0, torch.float32)
    sources = trilingual_files["val.en"].read_text().splitlines()
    refs = {lang: trilingual_files[f"val.{lang}"].read_text().splitlines() for lang in ("de", "fr")}

    def nll(tag: str, lang: str) -> float:
        batch = collate(bundle.src_tok.encode([f"{tag} {s}" for s in sources]), bundle.tgt_tok.encode(refs[lang]))
        with torch.no_grad():
            _, total = objective(batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_out)
        return float(total) / batch.target_tokens

    for lang, other in (("de", "fr"), ("fr", "de")):
        assert nll(f"<2{lang}>", lang) < nll(f"<2{other}>", lang) - 0.02, lang
    translator = mtkit.load(multilingual_run, device="cpu")
    outputs = {lang: translator.translate(sources, tgt_lang=lang) for lang in ("de", "fr")}
    assert sum(a != b for a, b in zip(outputs["de"], outputs["fr"])) > 0.9 * len(sources)


def test_tgt_lang_in_the_command_line_is_the_apis(multilingual_run, tmp_path):
    lines = ["A man in a red shirt reads a book.", "", "Two dogs play in the park."]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n")
    translator = mtkit.load(multilingual_run, device="cpu")
    for lang in ("de", "fr"):
        result = invoke("translate", multilingual_run, "-i", tmp_path / "in.en", "--tgt-lang", lang, "--device", "cpu")
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines() == translator.translate(lines, tgt_lang=lang)
        assert mtkit.load(multilingual_run, device="cpu", tgt_lang=lang).translate(lines) == result.stdout.splitlines()
    assert translator.translate(lines, tgt_lang="de")[1] == ""


def test_a_tag_typed_in_the_text_never_chooses_the_language(multilingual_run, trilingual_files, monkeypatch):
    """`<2fr>` typed in a text was the reserved piece, after the `<2de>` the translator puts first, and could
    override it. The sources the model reads (the command line's, the API's and the server's) now hold one tag id,
    the translator's; the typed tag is its characters, and a line without one encodes as before."""
    tok = Tokenizer(multilingual_run / "spm.model")
    de, fr = tok.sp.piece_to_id("<2de>"), tok.sp.piece_to_id("<2fr>")
    sources = trilingual_files["val.en"].read_text().splitlines()[:6]
    typed = [f"<2fr> {s}" for s in sources[:3]] + [f"{s} <2fr>" for s in sources[3:]]
    encoded = source_ids(tok, typed + sources, 128, prefix="<2de> ")
    assert [encoded[len(typed) + i] for i in range(len(sources))] == tok.encode([f"<2de> {s}" for s in sources])
    read: list[list[int]] = []
    encode = Transformer.encode

    def reading(model, src, src_pad_mask):
        read.extend(row[~pad].tolist() for row, pad in zip(src, src_pad_mask))
        return encode(model, src, src_pad_mask)

    monkeypatch.setattr(Transformer, "encode", reading)
    result = invoke("translate", multilingual_run, "--tgt-lang", "de", "--device", "cpu", input="\n".join(typed))
    assert result.exit_code == 0, result.output
    translator = mtkit.load(multilingual_run, device="cpu")
    assert translator.translate(typed, tgt_lang="de") == result.stdout.splitlines()
    search = LineSearch(translator.into("de"))  # what the server steps
    for key, line in enumerate(typed):
        search.add(key, line)
    while len(search):
        search.step()
    assert len(read) == 3 * len(typed)
    assert all(ids.count(de) == 1 and fr not in ids and ids[-1] == EOS_ID for ids in read)
    assert sorted(map(tuple, read)) == sorted([tuple(encoded[i] + [EOS_ID]) for i in range(len(typed))] * 3)


def test_only_mtkits_own_tags_typed_in_a_text_become_text(tmp_path, trilingual_files):
    """<BT> typed in a text is text too, glued to a word or alone; a reserved symbol of another kind (an imported
    Marian model's >>fr<<, which its users type to choose the language) stays its piece."""
    lines = trilingual_files["train.en"].read_text().splitlines()
    symbols = ["<2de>", "<BT>", ">>fr<<"]
    tok = Tokenizer(train_spm(lines, tmp_path / "spm", TokenizerConfig(vocab_size=200), symbols=symbols))
    ids = {s: tok.sp.piece_to_id(s) for s in symbols}
    assert directions.typed_tags(tok.user_defined) == {"<2de>": ids["<2de>"], "<BT>": ids["<BT>"]}
    encoded = source_ids(tok, ["<BT> A dog.", "A<BT>dog <2de>", "<BT>", ">>fr<< A dog."], 128)
    assert all(ids["<BT>"] not in seq and ids["<2de>"] not in seq for seq in encoded.values())
    assert len(encoded[1]) > 5 and len(encoded[2]) > 1  # the characters, not one piece each
    assert encoded[3] == tok.encode([">>fr<< A dog."])[0] and ids[">>fr<<"] in encoded[3]


def test_a_direction_the_model_lacks_is_one_line_listing_those_it_has(multilingual_run, tmp_path, trained_run):
    (tmp_path / "in.en").write_text("A dog.\n")
    result = invoke("translate", multilingual_run, "-i", tmp_path / "in.en", "--tgt-lang", "cs", "--device", "cpu")
    assert result.exit_code == 1
    one_line_error(result, "not trained to translate into 'cs'", "en->de, en->fr")
    result = invoke("translate", multilingual_run, "-i", tmp_path / "in.en", "--device", "cpu")
    assert result.exit_code == 1
    one_line_error(result, "translates into de, fr: say which with --tgt-lang")
    with pytest.raises(ConfigError, match="say which"):
        mtkit.load(multilingual_run, device="cpu").translate(["A dog."])
    # a model of one pair needs no target language, takes its own, and refuses another
    source = ["-i", tmp_path / "in.en", "--device", "cpu"]
    assert invoke("translate", trained_run, *source, "--tgt-lang", "de").exit_code == 0
    result = invoke("translate", trained_run, *source, "--tgt-lang", "fr")
    assert result.exit_code == 1
    one_line_error(result, "not trained to translate into 'fr'", "en->de")


def test_ctranslate2_export_takes_the_tag_and_transformers_export_refuses_in_one_line(multilingual_run, tmp_path):
    pytest.importorskip("ctranslate2")
    lines = ["A man in a red shirt reads a book.", "Two dogs play in the park."]
    result = invoke("export", multilingual_run, "-o", tmp_path / "ct2")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "ct2" / "mtkit.json").read_text())
    assert manifest["directions"] == [["en", "de"], ["en", "fr"]]
    assert manifest["source_tags"] == {"de": "<2de>", "fr": "<2fr>"}
    ct2 = mtkit.load(tmp_path / "ct2", device="cpu", engine="ctranslate2")
    ours = mtkit.load(multilingual_run, device="cpu", precision="fp32")  # as the export's weights
    for lang in ("de", "fr"):
        assert ct2.translate(lines, tgt_lang=lang) == ours.translate(lines, tgt_lang=lang)
    with pytest.raises(ConfigError, match="say which"):
        ct2.translate(lines)
    pytest.importorskip("transformers")
    result = invoke("export", multilingual_run, "--format", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 1
    one_line_error(result, "cannot export to transformers", "de, fr", "CTranslate2")


# -- bad input -------------------------------------------------------------------------------------------------


def test_a_corpus_empty_after_cleaning_is_one_line_naming_it_before_any_update(tmp_path, trilingual_files):
    (tmp_path / "long.en").write_text("a b c d e f g h i j k l m n o p\n" * 5)
    (tmp_path / "long.fr").write_text("x\n" * 5)  # every pair beyond the length ratio
    raw = multilingual_raw(trilingual_files)
    raw["data"]["corpora"][1].update(train_src=str(tmp_path / "long.en"), train_tgt=str(tmp_path / "long.fr"))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    result = invoke("train", tmp_path / "c.yaml", "--out", tmp_path / "run")
    assert result.exit_code == 1
    one_line_error(result, "data.corpora[1] (en-fr)", "no usable training pairs")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_prepared_folder_of_other_languages_is_refused(tmp_path, trilingual_files):
    folder = tmp_path / "prepared"
    folder.mkdir()
    for lang in ("en", "de"):
        (folder / f"train.{lang}").write_text(trilingual_files[f"train.{lang}"].read_text())
    data = DataConfig(corpora=(CorpusConfig("en", "fr", prepared=str(folder)),))
    with pytest.raises(Exception, match=r"has no train.fr: its languages \(de, en\) are not en and fr"):
        directions.corpus_files(data)
    found = directions.corpus_files(DataConfig(corpora=(CorpusConfig("en", "de", prepared=str(folder)),)))
    assert found[0].train_tgt == str(folder / "train.de") and found[0].valid_src == ""


def test_a_catalogue_corpus_needs_mtkit_run(trilingual_files):
    data = DataConfig(corpora=(CorpusConfig("en", "de", corpus="multi30k_en_de"),))
    with pytest.raises(ConfigError, match="prepared by `mtkit run`"):
        directions.corpus_files(data)
