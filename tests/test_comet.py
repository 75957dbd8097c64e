"""mtkit's own COMET and CometKiwi: unbabel-comet's scores, other precisions, several systems and references,
and every file of a model read as untrusted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from comet_fixture import HYPOTHESES, REFERENCES, SOURCES, VARIANTS, build_comet

from mtkit.errors import MtkitError
from mtkit.scoring import comet as comet_module
from mtkit.scoring.comet import Comet
from mtkit.scoring.comet_model import CometNetwork, sparsemax
from mtkit.scoring.comet_names import COMET_MODELS

EXPECTED = json.loads((Path(__file__).parent / "data" / "comet_expected.json").read_text())
# Measured on the tiny fixture: bf16 moves system scores by 2e-4 to 4e-4, int8 by 2e-3 (segment scores spread
# over about 0.5 for COMET, 0.2 for CometKiwi).
SYSTEM_TOLERANCE = {"bf16": 0.002, "int8": 0.01}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("comet")
    return {kind: build_comet(root / kind, kind) for kind in ("comet", "cometkiwi")}


@pytest.fixture(scope="module")
def comet(models: dict[str, Path]) -> Comet:
    return Comet.load(str(models["comet"]))


@pytest.fixture(scope="module")
def kiwi(models: dict[str, Path]) -> Comet:
    return Comet.load(str(models["cometkiwi"]))


def copied(model: Path, target: Path) -> Path:
    """A copy of ``model`` whose hparams.yaml names its own encoder (by a path relative to the folder)."""
    shutil.copytree(model, target)
    edit_hparams(target, pretrained_model="encoder")
    return target


def edit_hparams(model: Path, **values: object) -> None:
    path = model / "hparams.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **values}))


def edit_state(model: Path, change) -> None:
    path = model / "checkpoints" / "model.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    change(checkpoint["state_dict"])
    torch.save(checkpoint, path)


def refused(model: Path, *words: str, **load) -> str:
    """Loading ``model`` fails with one line that says each of ``words``."""
    with pytest.raises(MtkitError) as caught:
        Comet.load(str(model), **load)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    return message


# -- scores -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scores_equal_unbabel_comets(variant: str, tmp_path: Path) -> None:
    """Every network option mtkit implements scores as unbabel-comet does (comet_fixture.VARIANTS)."""
    kind, options = VARIANTS[variant]
    scorer = Comet.load(str(build_comet(tmp_path / variant, kind, options=options)))
    (result,) = scorer.score(SOURCES, [HYPOTHESES], [REFERENCES])
    expected = EXPECTED[variant]
    assert result.segments == pytest.approx(expected["segments"], abs=1e-4)
    assert result.system == pytest.approx(expected["system"], abs=1e-4)
    assert result.name == ("COMET" if kind == "comet" else "CometKiwi")
    assert scorer.needs_references is (kind == "comet")
    assert f"refs:{1 if kind == 'comet' else 0}|precision:fp32|" in result.signature
    assert result.signature.startswith(f"model:{variant}|revision:local|refs:")
    assert result.to_dict()["segments"] == result.segments


@pytest.mark.parametrize("kind", ["comet", "cometkiwi"])
def test_texts_are_tokenized_as_unbabel_comet_tokenizes_them(kind: str, comet: Comet, kiwi: Comet) -> None:
    scorer = comet if kind == "comet" else kiwi
    expected = EXPECTED[kind]["input_ids"]
    sources, hypotheses = scorer.tokens.encode(SOURCES), scorer.tokens.encode(HYPOTHESES)
    if kind == "comet":
        assert (sources, hypotheses) == (expected["src"], expected["mt"])
        assert scorer.tokens.encode(REFERENCES) == expected["ref"]
    else:
        assert [scorer.tokens.joined(mt, src) for mt, src in zip(hypotheses, sources)] == expected["mt+src"]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("kind", ["comet", "cometkiwi"])
def test_lower_precisions_stay_close_to_fp32(kind: str, precision: str, models: dict[str, Path]) -> None:
    (result,) = Comet.load(str(models[kind]), precision=precision).score(SOURCES, [HYPOTHESES], [REFERENCES])
    assert f"|precision:{precision}|" in result.signature
    assert result.system == pytest.approx(EXPECTED[kind]["system"], abs=SYSTEM_TOLERANCE[precision])


def test_order_and_batching_leave_each_segments_score(models: dict[str, Path], comet: Comet) -> None:
    """Batches are made by length: each segment's score comes back in its place, whatever the batch size."""
    order = list(reversed(range(len(SOURCES))))
    (whole,) = comet.score(SOURCES, [HYPOTHESES], [REFERENCES])
    one_by_one = Comet.load(str(models["comet"]), batch_size=1)
    (shuffled,) = one_by_one.score(
        [SOURCES[i] for i in order], [[HYPOTHESES[i] for i in order]], [[REFERENCES[i] for i in order]]
    )
    assert shuffled.segments == pytest.approx([whole.segments[i] for i in order], abs=1e-5)


def test_several_systems_and_references(comet: Comet) -> None:
    """One result per system in order; with two reference sets a segment scores the mean of its two scores."""
    other = [text.upper() for text in REFERENCES]
    first, second = comet.score(SOURCES, [HYPOTHESES, REFERENCES], [REFERENCES, other])
    (alone,) = comet.score(SOURCES, [HYPOTHESES], [REFERENCES])
    (against_other,) = comet.score(SOURCES, [HYPOTHESES], [other])
    means = [(a + b) / 2 for a, b in zip(alone.segments, against_other.segments)]
    assert first.segments == pytest.approx(means, abs=1e-6)
    assert "|refs:2|" in first.signature
    (references_alone,) = comet.score(SOURCES, [REFERENCES], [REFERENCES, other])
    assert second.segments == pytest.approx(references_alone.segments, abs=1e-6)
    assert second.system != pytest.approx(first.system)


def test_cometkiwi_reads_no_references(kiwi: Comet) -> None:
    with_references, without = kiwi.score(SOURCES, [HYPOTHESES], [REFERENCES]), kiwi.score(SOURCES, [HYPOTHESES])
    assert with_references[0].segments == without[0].segments
    assert "|refs:0|" in without[0].signature


def test_empty_segments_score(comet: Comet, kiwi: Comet) -> None:
    for scorer in (comet, kiwi):
        (result,) = scorer.score(["", "a"], [["", ""]], [["", "b"]])
        assert all(torch.isfinite(torch.tensor(result.segments)))


def test_bad_segments_are_refused(comet: Comet) -> None:
    with pytest.raises(MtkitError, match="give references"):
        comet.score(SOURCES, [HYPOTHESES])
    with pytest.raises(MtkitError, match="system 2 has 11 segments, and there are 12 sources"):
        comet.score(SOURCES, [HYPOTHESES, HYPOTHESES[:-1]], [REFERENCES])
    with pytest.raises(MtkitError, match="reference set 1 has 11 segments"):
        comet.score(SOURCES, [HYPOTHESES], [REFERENCES[1:]])
    with pytest.raises(MtkitError, match="nothing to score"):
        comet.score([], [[]], [[]])


def test_segments_are_scored_a_chunk_at_a_time(comet: Comet, kiwi: Comet, monkeypatch) -> None:
    """However many segments there are, no more than TEXTS_PER_CHUNK embeddings are held at once, and chunks
    change no score."""
    other = [text.upper() for text in REFERENCES]
    whole = comet.score(SOURCES, [HYPOTHESES, REFERENCES], [REFERENCES, other])
    whole_kiwi = kiwi.score(SOURCES, [HYPOTHESES, REFERENCES])
    held: list[int] = []
    embeddings = Comet._embeddings
    monkeypatch.setattr(
        Comet, "_embeddings", lambda self, texts: held.append(len(set(texts))) or embeddings(self, texts)
    )
    monkeypatch.setattr(comet_module, "TEXTS_PER_CHUNK", 10)
    chunked = comet.score(SOURCES, [HYPOTHESES, REFERENCES], [REFERENCES, other])
    assert len(held) == 6 and max(held) <= 10  # 12 segments of 5 texts each, 2 segments a chunk
    for result, expected in zip(chunked + kiwi.score(SOURCES, [HYPOTHESES, REFERENCES]), whole + whole_kiwi):
        assert result.segments == pytest.approx(expected.segments, abs=1e-6)


def test_pairwise_scores_each_candidate_against_each_other(comet: Comet, kiwi: Comet, monkeypatch) -> None:
    """Each line's matrix holds its candidates' scores against each other; lines are encoded together, as many as
    TEXTS_PER_CHUNK allows."""
    sources = [SOURCES[1], SOURCES[0], SOURCES[2]]
    candidates = [[HYPOTHESES[1], REFERENCES[1], "Kaffee.", ""], [HYPOTHESES[0]], [HYPOTHESES[2], REFERENCES[2]]]
    calls: list[int] = []
    embeddings = Comet._embeddings
    monkeypatch.setattr(Comet, "_embeddings", lambda self, texts: calls.append(len(texts)) or embeddings(self, texts))
    matrices = comet.pairwise(sources, candidates)
    assert calls == [3 + 7]
    assert [tuple(matrix.shape) for matrix in matrices] == [(4, 4), (1, 1), (2, 2)]
    for source, line, matrix in zip(sources, candidates, matrices):
        for j, reference in enumerate(line):
            (column,) = comet.score([source] * len(line), [line], [[reference] * len(line)])
            assert matrix[:, j].tolist() == pytest.approx(column.segments, abs=1e-5)
    monkeypatch.setattr(comet_module, "TEXTS_PER_CHUNK", 6)
    calls.clear()
    for small, whole in zip(comet.pairwise(sources, candidates), matrices, strict=True):
        assert torch.allclose(small, whole, atol=1e-6)
    assert calls == [5, 2 + 3]  # lines taken together until the next would pass the bound
    with pytest.raises(MtkitError, match="without references"):
        kiwi.pairwise(sources, candidates)
    with pytest.raises(MtkitError, match="one list of candidates per source"):
        comet.pairwise(sources, candidates[:2])


def test_sparsemax_projects_onto_the_simplex() -> None:
    assert sparsemax(torch.tensor([1.0, 0.5, -2.0])).tolist() == pytest.approx([0.75, 0.25, 0.0])
    assert sparsemax(torch.tensor([0.3, 0.3])).tolist() == pytest.approx([0.5, 0.5])


def test_layers_weighing_nothing_are_not_run(models: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    """With the top layer's weight zero, the encoder stops below it, and the scores are those of the whole."""
    model = copied(models["comet"], tmp_path / "model")
    weights = {f"layerwise_attention.scalar_parameters.{i}": torch.tensor([w]) for i, w in enumerate([1.0, 0.5, -2.0])}
    edit_state(model, lambda state: state.update(weights))
    cut = Comet.load(str(model))
    assert len(cut.network.encoder.model.encoder.layer) == 1
    monkeypatch.setattr(CometNetwork, "layers_used", lambda network: len(network.encoder.model.encoder.layer))
    whole = Comet.load(str(model))
    assert len(whole.network.encoder.model.encoder.layer) == 2
    (expected,) = whole.score(SOURCES, [HYPOTHESES], [REFERENCES])
    assert cut.score(SOURCES, [HYPOTHESES], [REFERENCES])[0].segments == pytest.approx(expected.segments, abs=1e-6)


# -- finding a model ------------------------------------------------------------------------------


def cached(model: Path, cache: Path, repo_id: str, revision: str) -> Path:
    """``model`` placed in a huggingface_hub cache as ``repo_id`` at ``revision``, its main branch, the checkpoint
    a link into the repository's blobs/ as huggingface_hub leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = copied(model, repo / "snapshots" / revision)
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / "0f1e2d3c"
    shutil.move(snapshot / "checkpoints" / "model.ckpt", blob)
    (snapshot / "checkpoints" / "model.ckpt").symlink_to(Path("..", "..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_ids_resolve_offline_in_a_cache(models: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    """A Hub id (or COMET_MODELS' name for one) is read from the cache at the revision its main branch names,
    which the signature records; the encoder may be a Hub id of its own."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cached(models["comet"], tmp_path, COMET_MODELS["comet"], revision)
    encoder = tmp_path / "models--Org--encoder" / "snapshots" / revision
    shutil.move(snapshot / "encoder", encoder)
    (encoder.parent.parent / "refs").mkdir()
    (encoder.parent.parent / "refs" / "main").write_text(revision)
    edit_hparams(snapshot, pretrained_model="Org/encoder")
    (result,) = Comet.load("comet", cache_dir=tmp_path).score(SOURCES, [HYPOTHESES], [REFERENCES])
    assert result.signature.startswith(
        f"model:Unbabel/wmt22-comet-da|revision:{revision}|encoder:Org/encoder@{revision}|"
    )
    assert result.segments == pytest.approx(EXPECTED["comet"]["segments"], abs=1e-4)
    pinned = Comet.load("comet", cache_dir=tmp_path, encoder_revision=revision)
    assert pinned.score(SOURCES, [HYPOTHESES], [REFERENCES])[0].signature == result.signature
    refused(Path("comet"), "hf:Org/encoder", cache_dir=tmp_path, encoder_revision="f" * 40)
    refused(Path("Org/absent"), "hf:Org/absent", "not in the Hugging Face cache", cache_dir=tmp_path)


def test_an_encoder_in_the_model_folder_takes_no_revision(models: dict[str, Path]) -> None:
    refused(models["comet"], "an encoder revision applies to a Hub encoder", encoder_revision="main")


def test_a_folder_takes_no_revision(models: dict[str, Path]) -> None:
    refused(models["comet"], "revision applies to Hub repositories", revision="main")


def test_unknown_names_are_refused() -> None:
    refused(Path("no-such-model"), "no such folder, nor a Hub repository id")


# -- untrusted files ----------------------------------------------------------------------------


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_carrying_code_is_refused_unrun(models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "hyper_parameters": RunsCode(marker)}, model / "checkpoints" / "model.ckpt")
    refused(model, "model.ckpt", "pickled Python objects")
    assert not marker.exists()


def test_a_truncated_checkpoint_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    path = model / "checkpoints" / "model.ckpt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(model, "model.ckpt", "truncated or damaged")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s.update({"estimator.ff.0.weight": torch.zeros(3, 3)}), ["estimator.ff.0.weight is (3, 3)"]),
        (lambda s: s.pop("layerwise_attention.gamma"), ["no layerwise_attention.gamma"]),
        (lambda s: s.update({"encoder.model.pooler.dense.bias": torch.zeros(32)}), ["an extra encoder.model.pooler"]),
        (lambda s: s["estimator.ff.6.bias"].fill_(float("nan")), ["estimator.ff.6.bias holds NaN"]),
    ],
    ids=["shape", "missing", "extra", "nan"],
)
def test_a_tampered_checkpoint_is_refused(change, words: list[str], models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    edit_state(model, change)
    refused(model, "model.ckpt", *words)


@pytest.mark.parametrize(
    ("hparams", "words"),
    [
        ("class_identifier: [regression_metric\n", ["hparams.yaml", "not readable YAML"]),
        ("- a list\n", ["hparams.yaml", "must be a mapping"]),
        ("pool: avg\n", ["hparams.yaml", "has no 'class_identifier'"]),
    ],
    ids=["syntax", "list", "no-class"],
)
def test_a_malformed_hparams_yaml_is_refused(hparams: str, words: list[str], models: dict, tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    (model / "hparams.yaml").write_text(hparams)
    refused(model, *words)


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"class_identifier": "ranking_metric"}, ["class_identifier must be one of", "ranking_metric"]),
        ({"layer_transformation": "entmax"}, ["layer_transformation must be one of"]),
        ({"word_level_training": True}, ["word_level_training is not implemented"]),
        ({"input_segments": ["mt", "src", "ref"]}, ["input_segments", "not implemented"]),
        ({"error_spans": True}, ["unknown option 'error_spans'"]),
        ({"hidden_sizes": [32, -1]}, ["hidden_sizes[1] must be between 1"]),
    ],
    ids=["class", "transformation", "word-level", "segments", "unknown", "width"],
)
def test_options_the_network_lacks_are_refused(values: dict, words: list[str], models: dict, tmp_path: Path) -> None:
    model = copied(models["cometkiwi"], tmp_path / "model")
    edit_hparams(model, **values)
    refused(model, "hparams.yaml", *words)


def test_hparams_and_checkpoint_must_describe_one_network(models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    edit_hparams(model, layer_norm=True)
    refused(model, "model.ckpt", "hyper_parameters describe another network")


def test_an_encoder_outside_the_model_folder_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    edit_hparams(model, pretrained_model=str(models["cometkiwi"] / "encoder"))
    refused(model, "pretrained_model", "not a folder inside the model's folder")
    edit_hparams(model, pretrained_model="../model/../../x")
    refused(model, "pretrained_model", "neither a Hub id nor a folder inside")


def test_links_out_of_the_model_folder_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    (model / "encoder" / "tokenizer.json").unlink()
    (model / "encoder" / "tokenizer.json").symlink_to(models["cometkiwi"] / "encoder" / "tokenizer.json")
    refused(model, "tokenizer.json", "a link to", "only the model's own files are read")


def test_the_tokenizer_reads_its_checked_files_alone(models: dict[str, Path], tmp_path: Path) -> None:
    """tokenizer_config.json could name any file as the vocabulary, and added_tokens.json add tokens: neither is
    read, and the model tokenizes and scores as its own files say."""
    model = copied(models["comet"], tmp_path / "model")
    encoder = model / "encoder"
    other = json.loads((encoder / "tokenizer.json").read_text())
    other["model"]["vocab"] = other["model"]["vocab"][:4] + other["model"]["vocab"][4:-1][::-1] + [["<mask>", 0.0]]
    (tmp_path / "other.json").write_text(json.dumps(other))
    (tmp_path / "garbage.model").write_bytes(b"not a SentencePiece model")
    config = {"tokenizer_file": str(tmp_path / "other.json"), "vocab_file": str(tmp_path / "garbage.model")}
    (encoder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 8}))
    (encoder / "added_tokens.json").write_text(json.dumps({"Katze": 4, "Matte": 1000}))
    (encoder / "chat_template.jinja").write_text("{{ raise_exception('read') }}")
    scorer = Comet.load(str(model))
    assert scorer.tokens.encode(SOURCES) == EXPECTED["comet"]["input_ids"]["src"]
    (result,) = scorer.score(SOURCES, [HYPOTHESES], [REFERENCES])
    assert result.segments == pytest.approx(EXPECTED["comet"]["segments"], abs=1e-4)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    """A token id past the encoder's embeddings would fail at the first score (a device assert on a GPU)."""
    model = copied(models["cometkiwi"], tmp_path / "model")
    path = model / "encoder" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["model"]["vocab"].append(["▁Zusatz", -5.0])
    path.write_text(json.dumps(tokenizer))
    refused(model, "encoder", "the tokenizer has", "tokens, more than the", "vocab_size in its config.json")


@pytest.mark.parametrize(("kind", "field"), [("comet", "layer"), ("cometkiwi", "sent_layer")])
def test_a_layer_the_encoder_lacks_is_refused(kind: str, field: str, models: dict, tmp_path: Path) -> None:
    """The tiny encoder has 2 layers: hidden states 0 to 2, and 3 is none of them (unbabel-comet's rule)."""
    model = copied(models[kind], tmp_path / "model")
    edit_hparams(model, **{field: 3})
    refused(model, "hparams.yaml", f"{field} is 3", "hidden states 0 (its embeddings) to 2")


def test_a_damaged_encoder_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    model = copied(models["comet"], tmp_path / "model")
    config = model / "encoder" / "config.json"
    values = json.loads(config.read_text())
    config.write_text(json.dumps({**values, "hidden_size": 1 << 30}))
    refused(model, "config.json", "hidden_size must be between 1 and 8192")
    config.write_text(json.dumps(values))
    (model / "encoder" / "tokenizer.json").write_text("{not json")
    refused(model, "encoder", "not a readable XLM-R tokenizer")
