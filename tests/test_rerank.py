"""N-best reranking in `mtkit translate --rerank`: the noisy channel ranking by the direct model's log-probability
per token at λ = 0 and choosing what the reverse model prefers when λ is large, minimum Bayes risk choosing the
consensus by chrF and by COMET, quality estimation by CometKiwi in fp32 whatever the translation's precision, one
output line per input line across chunks, and the combinations refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from comet_fixture import build_comet
from helpers import invoke, one_line_error, train_direction
from sacrebleu.metrics import CHRF

import mtkit
from mtkit.decoding import line_translator
from mtkit.decoding.line_translator import Translation
from mtkit.scoring.comet import Comet
from mtkit.translation.reranking import MbrChrf, NoisyChannel, RerankSettings, load_reranker, reranked

TRAINING = {"max_steps": 300, "valid_every": 300, "save_every": 300, "threads": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus_files) -> tuple[Path, Path]:
    """(en->de, de->en): tiny models of 300 updates, each writing words of its own."""
    root = tmp_path_factory.mktemp("rerank")
    forward = train_direction(root, corpus_files, "en", "de", TRAINING)
    return forward, train_direction(root, corpus_files, "de", "en", TRAINING)


@pytest.fixture(scope="module")
def comets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("comet")
    return {kind: build_comet(root / kind, kind) for kind in ("comet", "cometkiwi")}


@pytest.fixture(scope="module")
def source_file(tmp_path_factory, corpus_files) -> Path:
    """Twelve validation sources with an empty line among them."""
    lines = corpus_files["val.en"].read_text().splitlines()[:12]
    lines.insert(5, "")
    path = tmp_path_factory.mktemp("sources") / "src.en"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def translated(*args) -> list[str]:
    result = invoke("translate", *args, "--device", "cpu", "--precision", "fp32")
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def candidates(forward: Path, lines: list[str], n: int) -> list[list[Translation]]:
    translator = mtkit.load(forward, device="cpu", precision="fp32")
    return list(translator.hypotheses(lines, nbest=n, beam=n))


def per_token(scores) -> list[float]:
    """log p / tokens of each PairScore: the log-probability per token, eos included, as `mtkit score` counts."""
    return [pair.logprob / pair.tokens for pair in scores]


def test_the_channel_at_weight_0_ranks_by_the_direct_models_log_probability_per_token(models, source_file):
    forward, reverse = models
    rerank = ["--rerank", "channel", "--reverse-model", reverse, "--channel-weight", "0", "--candidates", "4"]
    chosen = translated(forward, "-i", source_file, *rerank)
    assert len(chosen) == 13 and chosen[5] == ""
    lines = source_file.read_text().splitlines()
    direct = mtkit.load(forward, device="cpu", precision="fp32")
    beam_best = 0
    for line, hyps, pick in zip(lines, candidates(forward, lines, 4), chosen, strict=True):
        texts = [h.text for h in hyps]
        values = per_token(direct.score([line] * len(texts), texts))
        assert pick == texts[max(range(len(texts)), key=lambda k: (values[k], -k))]
        beam_best += pick == texts[0]
    assert beam_best < 13  # the beam's length penalty ranks otherwise somewhere: the search's score is not used


def test_a_heavy_channel_chooses_the_candidate_the_reverse_model_finds_most_probable(models, corpus_files):
    forward, reverse = models
    sources = corpus_files["val.en"].read_text().splitlines()[:16]
    hypotheses = candidates(forward, sources, 4)
    direct = mtkit.load(forward, device="cpu", precision="fp32")
    channel = mtkit.load(reverse, device="cpu", precision="fp32")
    weight = 50.0
    chosen = NoisyChannel(direct, channel, weight).choose(sources, hypotheses)
    changed = 0
    for source, hyps, pick in zip(sources, hypotheses, chosen, strict=True):
        texts = [h.text for h in hyps]
        there = per_token(direct.score([source] * len(texts), texts))
        back = per_token(channel.score(texts, [source] * len(texts)))
        by_hand = [a + weight * b for a, b in zip(there, back, strict=True)]
        assert pick == hyps[max(range(len(hyps)), key=lambda k: (by_hand[k], -k))]
        changed += pick != hyps[0]
    assert changed  # the channel disagrees with the beam somewhere


def test_chunks_of_three_lines_keep_each_choice_with_its_own_line(models, source_file, monkeypatch):
    forward, reverse = models
    rerank = ["--rerank", "channel", "--reverse-model", reverse, "--candidates", "3"]
    whole = translated(forward, "-i", source_file, *rerank)
    monkeypatch.setattr(line_translator, "CHUNK_LINES", 3)  # 13 lines: 5 chunks, the empty line ending the second
    in_threes = translated(forward, "-i", source_file, *rerank)
    assert in_threes == whole and len(whole) == 13 and whole[5] == "" and all(whole[i] for i in range(13) if i != 5)


def test_an_empty_chunk_gives_nothing_and_shifts_nothing(models, source_file):
    lines = [line for line in source_file.read_text().splitlines() if line][:5]
    translator = mtkit.load(models[0], device="cpu", precision="fp32", nbest=3, beam=3)
    together = [pick.text for (pick,) in reranked(translator, MbrChrf(), [lines])]
    apart = [pick.text for (pick,) in reranked(translator, MbrChrf(), [lines[:2], [], lines[2:]])]
    assert apart == together and len(together) == 5


def test_mbr_with_chrf_chooses_the_consensus_of_a_hand_made_list():
    texts = [
        "Zebras fly over snow.",
        "A dog runs on the beach.",
        "A dog runs on a beach.",
        "The dog runs on the beach.",
    ]
    hyps = [Translation(text, -float(i), -float(i)) for i, text in enumerate(texts)]
    reranker = MbrChrf()
    (utility,) = reranker.utilities(["x"], [texts], [[h.score for h in hyps]])
    chrf = CHRF()
    assert utility[0] == pytest.approx(sum(chrf.sentence_score(texts[0], [t]).score for t in texts[1:]) / 3)
    assert reranker.choose(["x"], [hyps]) == [hyps[1]]
    assert reranker.choose(["x", ""], [hyps[:1], [hyps[2]]]) == [hyps[0], hyps[2]]  # one candidate: as it is


def test_mbr_with_samples_keeps_one_line_per_input_line_from_stdin(models, source_file):
    text = source_file.read_text()
    result = invoke("translate", models[0], "--rerank", "mbr", "--sample", "--candidates", "4", "--device", "cpu",
                    input=text)  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 13 and lines[5] == "" and all(lines[i] for i in range(13) if i != 5)


def test_qe_chooses_the_candidate_cometkiwi_scores_highest(models, comets, corpus_files, tmp_path):
    sources = corpus_files["val.en"].read_text().splitlines()[:6]
    path = tmp_path / "src.en"
    path.write_text("\n".join(sources) + "\n")
    chosen = translated(
        models[0], "-i", path, "--rerank", "qe", "--candidates", "3", "--comet-model", comets["cometkiwi"]
    )
    kiwi = Comet.load(str(comets["cometkiwi"]))
    for source, hyps, pick in zip(sources, candidates(models[0], sources, 3), chosen, strict=True):
        (result,) = kiwi.score([source] * len(hyps), [[h.text for h in hyps]])
        best = max(range(len(hyps)), key=lambda k: (result.segments[k], -k))
        assert pick == hyps[best].text


def test_the_comet_judge_scores_in_fp32_whatever_the_translations_precision(models, comets):
    translator = mtkit.load(models[0], device="cpu", precision="bf16", nbest=2, beam=2)
    settings = RerankSettings("qe", 2, comet_model=str(comets["cometkiwi"]))
    judge = load_reranker(settings, translator, "cpu", "bf16")
    (result,) = judge.comet.score(["A dog runs."], [["Ein Hund rennt."]])
    assert "precision:fp32" in result.signature


def test_mbr_with_comet_chooses_the_candidate_of_highest_mean_score_against_the_others(models, comets, corpus_files):
    sources = corpus_files["val.en"].read_text().splitlines()[:6]
    hypotheses = candidates(models[0], sources, 3)
    translator = mtkit.load(models[0], device="cpu", precision="fp32", nbest=3, beam=3)
    settings = RerankSettings("mbr", 3, mbr_utility="comet", comet_model=str(comets["comet"]))
    chosen = [pick for (pick,) in reranked(translator, load_reranker(settings, translator, "cpu", "fp32"), [sources])]
    comet = Comet.load(str(comets["comet"]))
    for source, hyps, pick in zip(sources, hypotheses, chosen, strict=True):
        (matrix,) = comet.pairwise([source], [[h.text for h in hyps]])
        means = [(sum(matrix[i].tolist()) - matrix[i, i].item()) / 2 for i in range(3)]
        assert pick == hyps[max(range(3), key=lambda k: (means[k], -k))]


def test_combinations_that_make_no_sense_are_refused_in_one_line(models, comets, source_file, tmp_path):
    forward, reverse = models
    base = [forward, "-i", source_file, "--device", "cpu"]
    cases = [
        (["--rerank", "channel"], "needs --reverse-model"),
        (["--rerank", "channel", "--reverse-model", reverse, "--sample"], "drop --sample"),
        (["--rerank", "mbr", "--nbest", "2"], "no --nbest"),
        (["--rerank", "mbr", "--alignments"], "no --alignments"),
        (["--candidates", "4"], "go with --rerank"),
        (["--rerank", "mbr", "--beam", "2", "--candidates", "4"], "needs a beam of at least 4"),
        (["--rerank", "mbr", "--reverse-model", reverse], "--reverse-model is for --rerank channel"),
        (["--rerank", "qe", "--mbr-utility", "comet"], "--mbr-utility is for --rerank mbr"),
        (["--rerank", "mbr", "--comet-model", "comet"], "--comet-model is for"),
        (["--rerank", "channel", "--reverse-model", reverse, "--channel-weight", "-1"], "--channel-weight must be"),
        (["--rerank", "qe", "--comet-model", comets["comet"]], "reference-free"),
        (["--rerank", "mbr", "--mbr-utility", "comet", "--comet-model", comets["cometkiwi"]], "reference-based"),
        (["--rerank", "channel", "--reverse-model", forward], "translates en->de, not de->en"),
        (["--rerank", "qe", "--comet-model", tmp_path / "none"], f"--rerank qe: {tmp_path / 'none'}: no such folder"),
    ]
    for options, message in cases:
        one_line_error(invoke("translate", *base, *options), message)
