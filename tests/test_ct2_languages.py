"""CTranslate2 export of models told their languages by tokens (an imported NLLB-200 and M2M100): fairseq's position
table and eos as the decoder's start exported, the languages recorded in the manifest rather than every direction,
and the language tokens put in place by the translator (the source's before the source, the target's as
CTranslate2's target prefix, left out of the translation and of its score), so that `mtkit translate --engine
ctranslate2` and `mtkit score --engine ctranslate2` give what mtkit's engine gives.

The folders are tests/m2m100_fixture.py's with wider random weights (init_std 0.4), the language tokens' rows shrunk
and eos's grown, so that greedy outputs are words, of varied lengths, that change with the source and the target
language.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import m2m100_fixture as fx
import pytest
import torch
from helpers import invoke, one_line_error

import mtkit
from mtkit.interop.ct2_export import read_manifest
from mtkit.interop.export_folder import MANIFEST
from mtkit.interop.hf_import import import_hf
from mtkit.model.checkpoint import CheckpointError

# CTranslate2 brings its own OpenMP, whose threads spin for a while after each call (tests/test_export.py)
with pytest.MonkeyPatch.context() as env:
    env.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env.setenv("HF_HUB_OFFLINE", "1")
    ctranslate2 = pytest.importorskip("ctranslate2")
    transformers = pytest.importorskip("transformers")

SHORT = [line for line in fx.LINES["en"] if len(line) < 70][:12]  # within the tiny models' 64 positions
LINES = [*SHORT[:6], "", *SHORT[6:], "Ein älteres Mädchen läuft über die Straße."]
TARGETS = [*fx.LINES["fr"][:5], "", "Ein Hund", *fx.LINES["de"][5:8], "x", "Un homme lit.", "", "Le chat"]
assert len(TARGETS) == len(LINES)


@dataclass
class Exported:
    model: Path  # the mtkit import
    export: Path  # its CTranslate2 export
    source: str
    targets: list[str]


def exported(folder: fx.FairseqFolder, root: Path, source: str, targets: list[str], **languages) -> Exported:
    """``folder``'s model with its language tokens' rows shrunk (it would repeat them) and eos's grown (so that
    hypotheses end at varied lengths), imported, and exported by `mtkit export`."""
    tok = folder.tokenizer
    is_m2m100 = isinstance(tok, transformers.M2M100Tokenizer)
    ids = [tok.get_lang_id(c) if is_m2m100 else tok.convert_tokens_to_ids(c) for c in folder.languages]
    with torch.no_grad():
        folder.hf.model.shared.weight[ids] *= 0.1
        folder.hf.model.shared.weight[2] *= 1.5
    folder.hf.save_pretrained(folder.path)
    import_hf(str(folder.path), root / "model", **languages)
    result = invoke("export", root / "model", "-o", root / "ct2")
    assert result.exit_code == 0, result.output
    return Exported(root / "model", root / "ct2", source, targets)


@pytest.fixture(scope="module")
def nllb(tmp_path_factory) -> Exported:
    root = tmp_path_factory.mktemp("nllb")
    folder = fx.nllb_folder(root, seed=4, init_std=0.4)
    return exported(folder, root, "eng_Latn", ["fra_Latn", "deu_Latn", "spa_Latn"], src_lang="eng_Latn")


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory) -> Exported:
    root = tmp_path_factory.mktemp("m2m100")
    folder = fx.m2m100_folder(root, seed=4, init_std=0.4, activation_function="swish")
    return exported(folder, root, "en", ["fr", "de", "es"], src_lang="en", tgt_lang="de")


@pytest.fixture(params=["nllb", "m2m100"])
def model(request) -> Exported:
    return request.getfixturevalue(request.param)


def engines(model: Exported, **decode):
    """mtkit's engine over the import and CTranslate2 over its export, with the same decoding settings."""
    ours = mtkit.load(model.model, precision="fp32", **decode)
    theirs = mtkit.load(model.export, engine="ctranslate2", **decode)
    return ours, theirs


def assert_close_logprobs(expected, got) -> None:
    for e, g in zip(expected, got):
        # Float rounding, and CTranslate2's renormalising after it bans pad and bos (higher by their share).
        assert -1e-3 < g.logprob - e.logprob < 0.01 * abs(e.logprob) + 1e-3, (e, g)


def test_the_manifest_records_the_languages_not_each_direction(nllb, m2m100):
    for model, token, default in ((nllb, "{lang}", []), (m2m100, "__{lang}__", [["en", "de"]])):
        manifest = json.loads((model.export / MANIFEST).read_text())
        data = mtkit.load(model.model).data
        assert manifest["languages"] == list(data.languages) and manifest["language_token"] == token
        assert [pair for pair in manifest["directions"] if set(pair) <= set(data.languages)] == default
        read = read_manifest(model.export)["data"]
        assert (read.languages, read.language_token) == (data.languages, data.language_token)
        assert (read.src_lang, read.tgt_lang) == (data.src_lang, data.tgt_lang)
    assert (nllb.export / MANIFEST).stat().st_size < 20_000  # 202 languages, not their 40,602 directions


def test_greedy_translations_are_mtkits(model, tmp_path):
    """`mtkit translate EXPORT --engine ctranslate2 --src-lang X --tgt-lang Y` gives what mtkit's engine gives,
    into each of three languages; the log-probabilities agree as for any export (tests/test_export.py)."""
    ours, theirs = engines(model, beam=1, max_len_a=0.0, max_len_b=16)
    outputs = []
    for target in model.targets:
        expected = list(ours.hypotheses(LINES, tgt_lang=target, src_lang=model.source))
        got = list(theirs.hypotheses(LINES, tgt_lang=target, src_lang=model.source))
        assert [h[0].text for h in got] == [h[0].text for h in expected]
        assert_close_logprobs([h[0] for h in expected], [h[0] for h in got])
        outputs.append([h[0].text for h in expected])
    assert len({tuple(texts) for texts in outputs}) == len(model.targets) and len(set(outputs[0])) > len(LINES) // 2
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    options = ("--src-lang", model.source, "--tgt-lang", model.targets[0], "--beam", "1", "--max-len-a", "0")
    options += ("--max-len-b", "16")
    result = invoke("translate", model.export, "--engine", "ctranslate2", "-i", tmp_path / "in.txt", *options)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == outputs[0]


@pytest.mark.parametrize(("a", "b"), [(0.5, 2), (0.0, 1)])
def test_greedy_translations_under_binding_caps_are_mtkits(model, a, b):
    """Caps that bind: half the source's length and 2, and 1, where mtkit's search still takes the target language's
    token and eos (an empty translation scored by eos's log-probability after it)."""
    ours, theirs = engines(model, beam=1, max_len_a=a, max_len_b=b)
    for target in model.targets[:2]:
        expected = list(ours.hypotheses(LINES, tgt_lang=target, src_lang=model.source))
        got = list(theirs.hypotheses(LINES, tgt_lang=target, src_lang=model.source))
        assert [h[0].text for h in got] == [h[0].text for h in expected]
        assert_close_logprobs([h[0] for h in expected], [h[0] for h in got])
        if b == 1:
            assert all(h[0].text == "" and (h[0].logprob < 0 or not line) for h, line in zip(got, LINES))


def test_beam_search_mostly_agrees(model):
    """Beam 4: most best translations are mtkit's (measured: 11 to 13 of 14), with their log-probabilities. Where
    they differ, CTranslate2 kept hypotheses the length cap cut, which it ranks without the eos mtkit ends them with
    (see CTranslate2Translator), over shorter ones that mtkit's search finds and ranks higher."""
    ours, theirs = engines(model, beam=4, max_len_a=0.0, max_len_b=16, lenpen=1.0)
    for target in model.targets[:2]:
        expected = list(ours.hypotheses(LINES, tgt_lang=target, src_lang=model.source))
        got = list(theirs.hypotheses(LINES, tgt_lang=target, src_lang=model.source))
        same = [(e[0], g[0]) for e, g in zip(expected, got) if e[0].text == g[0].text]
        assert len(same) >= len(LINES) - 4, f"{len(same)} of {len(LINES)} best translations equal"
        assert_close_logprobs(*zip(*same))


def test_scores_are_mtkits(model, tmp_path):
    """`mtkit score --engine ctranslate2`: each token's log-probability to 1e-4, and their sum, the target
    language's token read and not scored, as mtkit's engine scores it (empty sources and targets included)."""
    (tmp_path / "src.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("\n".join(TARGETS) + "\n", encoding="utf-8")
    files = ("--src", tmp_path / "src.txt", "--tgt", tmp_path / "tgt.txt", "--tokens", "--precision", "fp32")
    rows = {}
    for engine, path in (("mtkit", model.model), ("ctranslate2", model.export)):
        languages = ("--src-lang", model.source, "--tgt-lang", model.targets[1])
        result = invoke("score", path, "--engine", engine, *files, *languages)
        assert result.exit_code == 0, result.output
        rows[engine] = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows["mtkit"]) == len(LINES)
    for ours, theirs in zip(rows["mtkit"], rows["ctranslate2"]):
        assert ours[1] == theirs[1]  # the tokens scored: the target's and eos
        assert float(theirs[0]) == pytest.approx(float(ours[0]), abs=1e-4 * int(ours[1]))
        assert [float(v) for v in theirs[2].split()] == pytest.approx([float(v) for v in ours[2].split()], abs=1e-4)


def test_languages_are_checked_in_one_line(nllb, tmp_path):
    (tmp_path / "in.txt").write_text("A dog.\n", encoding="utf-8")
    args = ("translate", nllb.export, "--engine", "ctranslate2", "-i", tmp_path / "in.txt")
    one_line_error(invoke(*args, "--tgt-lang", "xx_Latn"), "'xx_Latn' is not one of this model's 202 languages")
    one_line_error(invoke(*args, "--tgt-lang", "fra_Latn", "--src-lang", "en"), "'en' is not one of this model's")
    one_line_error(invoke(*args), "say the target language with --tgt-lang")


def edited(export: Path, tmp_path: Path, change) -> Path:
    """A copy of ``export`` whose manifest ``change`` edits."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for path in export.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((copy / MANIFEST).read_text())
    change(manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


MALFORMED = {
    "not a list": (lambda m: m.update(languages="en de"), "languages must be a list of 1 to 1,024 language codes"),
    "too many": (lambda m: m.update(languages=[f"l{i}" for i in range(1025)]), "a list of 1 to 1,024"),
    "not a code": (lambda m: m["languages"].append("x y"), "'x y' is not a language code"),
    "named twice": (lambda m: m["languages"].append(m["languages"][0]), "names ace_Arab twice"),
    "no template": (lambda m: m.update(language_token="lang"), "data.language_token must hold {lang} once"),
    "no token": (lambda m: m.pop("language_token"), "language_token must be a string, got None"),
    "directions": (
        lambda m: m.update(directions=[["eng_Latn", "fra_Latn"], ["eng_Latn", "deu_Latn"]]),
        "directions must hold the one default [source, target] pair",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_manifest_is_refused_in_one_line(nllb, tmp_path, case):
    change, message = MALFORMED[case]
    copy = edited(nllb.export, tmp_path, change)
    with pytest.raises(CheckpointError, match="malformed export manifest") as caught:
        read_manifest(copy)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    if case == "not a code":
        (tmp_path / "in.txt").write_text("A dog.\n", encoding="utf-8")
        one_line_error(invoke("translate", copy, "--engine", "ctranslate2", "-i", tmp_path / "in.txt"), message)


def test_a_manifest_without_languages_reads_as_before(nllb, tmp_path):
    """An export made before languages were recorded: its one direction, no languages."""
    copy = edited(nllb.export, tmp_path, lambda m: (m.pop("languages"), m.pop("language_token")))
    data = read_manifest(copy)["data"]
    assert (data.src_lang, data.tgt_lang, data.languages) == ("eng_Latn", "tgt", ())
