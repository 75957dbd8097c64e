"""Scores of given translations (`mtkit score`, ``LineTranslator.score``): the same numbers as CTranslate2's
``score_batch`` and a MarianMTModel's loss on mtkit's exports, the log-probability search reports for its own
output, batch-mates that change nothing, and the command's line alignment, format and errors."""

from __future__ import annotations

import gzip
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import invoke, one_line_error

import mtkit
from mtkit.data.parallel import pad, source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtkit.decoding.forced import forced_log_probs
from mtkit.decoding.line_translator import PairMismatch, paired_chunks, source_ids
from mtkit.decoding.search import beam_search
from mtkit.interop.ct2_export import export_ctranslate2
from mtkit.interop.hf_export import export_transformers
from mtkit.model.loading import load_for_inference
from mtkit.model.run_folder import run_checkpoints

with pytest.MonkeyPatch.context() as env:
    env.setenv("OMP_WAIT_POLICY", "PASSIVE")  # CTranslate2's threads beside torch's (see test_export.py)
    env.setenv("HF_HUB_OFFLINE", "1")
    ctranslate2 = pytest.importorskip("ctranslate2")
    transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PER_TOKEN = 1e-4  # parity with other engines' fp32 numbers, per token
# What batch-mates may move a pair's score by, per token: in fp32 and bf16 only float rounding (other row counts
# and padding in the products and attention sums; measured up to 2.4e-6 in fp32 and 0 in bf16), in int8 that
# rounding carried, rarely, across a quantization step of the next layer's input (measured up to 0.019).
BATCH_MATES = {"fp32": 1e-5, "bf16": 1e-5, "int8": 0.1}


@pytest.fixture(scope="module")
def pairs(corpus_files) -> tuple[list[str], list[str]]:
    """Twelve validation pairs of varied lengths, one whose source is empty and one whose target is."""
    sources = corpus_files["val.en"].read_text().splitlines()[:12]
    targets = corpus_files["val.de"].read_text().splitlines()[:12]
    sources[3], targets[7] = "", ""
    return sources, targets


@pytest.fixture(scope="module")
def translator(trained_run):
    return mtkit.load(trained_run, device="cpu", precision="fp32")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# -- parity with other engines -----------------------------------------------------------------------------------


def test_scores_equal_ctranslate2_score_batch_on_the_export(trained_run, translator, pairs, tmp_path):
    ct2_dir = export_ctranslate2(trained_run, tmp_path / "ct2")
    sources, targets = pairs
    ours = list(translator.score(sources, targets, tokens=True))
    sp_src, sp_tgt = translator.src_tok.sp, translator.tgt_tok.sp
    engine = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32")
    theirs = engine.score_batch(
        [sp_src.encode(line, out_type=str) for line in sources], [sp_tgt.encode(line, out_type=str) for line in targets]
    )
    for mine, result in zip(ours, theirs, strict=True):
        assert mine.tokens == len(result.log_probs)
        assert mine.token_logprobs == pytest.approx(result.log_probs, abs=PER_TOKEN)
    through_engine = mtkit.load(ct2_dir, device="cpu", engine="ctranslate2", precision="fp32")
    for mine, other in zip(ours, through_engine.score(sources, targets, tokens=True), strict=True):
        assert other.tokens == mine.tokens
        assert other.token_logprobs == pytest.approx(mine.token_logprobs, abs=PER_TOKEN)


def test_scores_equal_marian_mt_models_log_probabilities_on_the_export(trained_run, translator, pairs, tmp_path):
    hf_dir = export_transformers(trained_run, tmp_path / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    sources, targets = pairs
    batch = tokenizer(sources, text_target=targets, return_tensors="pt", padding=True)
    labels = batch["labels"].masked_fill(batch["labels"] == hf.config.pad_token_id, -100)
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).logits
    lprobs = F.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    for mine, row, wanted in zip(translator.score(sources, targets, tokens=True), lprobs, labels, strict=True):
        theirs = row[wanted != -100].tolist()
        assert mine.tokens == len(theirs)
        assert mine.token_logprobs == pytest.approx(theirs, abs=PER_TOKEN)


# -- mtkit's own numbers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beam", [1, 4])
def test_forced_decoding_of_the_search_output_gives_the_searchs_log_probability(translator, pairs, beam):
    sources = [line for line in pairs[0] if line]
    best = [hyps[0] for hyps in translator.hypotheses(sources, beam=beam)]
    scored = list(translator.score(sources, [t.text for t in best]))
    for found, score in zip(best, scored, strict=True):
        assert score.logprob == pytest.approx(found.logprob, abs=PER_TOKEN * score.tokens)
    model, tok = translator.model, translator.src_tok  # the search's own tokens, whatever their text re-encodes to
    ids = source_ids(tok, sources, model.max_source_positions)
    src, mask = source_tensor([ids[i] for i in range(len(sources))])
    hyps = beam_search(model, src, mask, replace(translator.decode, beam=beam))
    forced = forced_log_probs(model, src, mask, [h[0].tokens for h in hyps])
    for (h,), lps in zip(hyps, forced, strict=True):
        assert sum(lps) == pytest.approx(h.logprob, abs=PER_TOKEN * len(lps))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_pairs_score_does_not_depend_on_its_batch_mates(trained_run, pairs, precision):
    scorer = mtkit.load(trained_run, device="cpu", precision=precision)
    sources, targets = pairs
    together = list(scorer.score(sources, targets, tokens=True))
    for i in range(len(sources)):
        (alone,) = scorer.score([sources[i]], [targets[i]], tokens=True)
        assert alone.token_logprobs == pytest.approx(together[i].token_logprobs, abs=BATCH_MATES[precision])
    in_pairs = mtkit.load(trained_run, device="cpu", precision=precision, batch_size=2)
    for mine, other in zip(together, in_pairs.score(sources, targets, tokens=True), strict=True):
        assert other.token_logprobs == pytest.approx(mine.token_logprobs, abs=BATCH_MATES[precision])
    if precision != "fp32":  # the model as loaded in that precision: close to fp32's, not its numbers
        fp32 = mtkit.load(trained_run, device="cpu", precision="fp32").score(sources, targets)
        assert [s.logprob for s in together] == pytest.approx([s.logprob for s in fp32], rel=0.05, abs=0.5)


def test_empty_lines_are_scored_as_eos_alone(translator):
    scores = list(translator.score(["", "A dog runs.", "", "  "], ["", "", "Ein Hund.", "\n"]))
    assert [s.tokens for s in scores] == [1, 1, len(translator.tgt_tok.encode(["Ein Hund."])[0]) + 1, 1]
    assert all(s.logprob < 0 for s in scores)
    assert scores[3].logprob == pytest.approx(scores[0].logprob, abs=1e-6)  # blank lines are empty ones


def test_an_ensemble_scores_with_its_members_averaged_log_probabilities(trained_run, pairs):
    first, last = run_checkpoints(trained_run)[0], run_checkpoints(trained_run)[-1]
    sources, targets = pairs
    ensemble = mtkit.load([first, last], device="cpu", precision="fp32")
    members = [load_for_inference(path, CPU, "fp32") for path in (first, last)]
    tok = members[0].src_tok
    ids = source_ids(tok, sources, members[0].model.max_source_positions)
    src, mask = source_tensor([ids.get(i, []) for i in range(len(sources))])
    tgt = members[0].tgt_tok.encode(targets)
    tgt_in, tgt_out = pad(tgt, prefix=[BOS_ID]), pad(tgt, suffix=[EOS_ID])
    with torch.no_grad():
        mean = torch.stack([F.log_softmax(m.model(src, mask, tgt_in).float(), -1) for m in members]).mean(0)
    wanted = F.log_softmax(mean, -1).gather(-1, tgt_out[..., None]).squeeze(-1)
    for score, row, out in zip(ensemble.score(sources, targets), wanted, tgt_out, strict=True):
        assert score.logprob == pytest.approx(row[out != PAD_ID].sum().item(), abs=1e-4)
    alone = list(mtkit.load(last, device="cpu", precision="fp32").score(sources, targets))
    assert [s.logprob for s in ensemble.score(sources, targets)] != pytest.approx([s.logprob for s in alone])


def test_a_multilingual_models_tag_goes_before_each_source(multilingual_run, trilingual_files):
    sources = trilingual_files["val.en"].read_text().splitlines()[:4]
    targets = trilingual_files["val.fr"].read_text().splitlines()[:4]
    scorer = mtkit.load(multilingual_run, device="cpu", precision="fp32")
    with pytest.raises(mtkit.MtkitError, match="en->de, en->fr"):
        list(scorer.score(sources, targets))
    into_fr = list(scorer.score(sources, targets, tgt_lang="fr"))
    into_de = list(scorer.score(sources, targets, tgt_lang="de"))
    ids = source_ids(scorer.src_tok, sources, scorer.model.max_source_positions, prefix="<2fr> ")
    src, mask = source_tensor([ids[i] for i in range(len(sources))])
    forced = forced_log_probs(scorer.model, src, mask, scorer.tgt_tok.encode(targets))
    assert [s.logprob for s in into_fr] == pytest.approx([sum(lps) for lps in forced], abs=1e-4)
    assert sum(s.logprob for s in into_fr) > sum(s.logprob for s in into_de)  # French is likelier into French
    empty = next(scorer.score([""], targets[:1], tgt_lang="fr"))  # the tag alone, as training showed the model
    tag = scorer.src_tok.encode(["<2fr> "])[0]
    src, mask = source_tensor([tag])
    assert empty.logprob == pytest.approx(
        sum(forced_log_probs(scorer.model, src, mask, scorer.tgt_tok.encode(targets[:1]))[0]), abs=1e-4
    )
    src_file, tgt_file = trilingual_files["val.en"], trilingual_files["val.fr"]
    result = invoke(
        "score", multilingual_run, "--src", src_file, "--tgt", tgt_file, "--tgt-lang", "fr", "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == len(src_file.read_text().splitlines())


def test_pairs_that_run_out_name_the_line(translator):
    with pytest.raises(PairMismatch, match="the targets end before line 3, the sources go on"):
        list(translator.score(["a", "b", "c"], ["x", "y"]))
    with pytest.raises(PairMismatch, match="the sources end before line 2"):
        list(translator.score(["a"], iter(["x", "y"])))


# -- the command -------------------------------------------------------------------------------------------------


def test_the_command_prints_one_line_per_pair_with_tokens_on_request(trained_run, translator, pairs, tmp_path):
    src, tgt = write_lines(tmp_path / "s.en", pairs[0]), write_lines(tmp_path / "t.de", pairs[1])
    result = invoke("score", trained_run, "--src", src, "--tgt", tgt, "--device", "cpu", "--precision", "fp32")
    assert result.exit_code == 0, result.output
    rows = [row.split("\t") for row in result.stdout.splitlines()]
    expected = list(translator.score(*pairs))
    assert [(float(logprob), int(tokens)) for logprob, tokens in rows] == [
        (pytest.approx(s.logprob, abs=1e-6), s.tokens) for s in expected
    ]
    out = tmp_path / "scores.txt"
    result = invoke("score", trained_run, "--src", src, "--tgt", tgt, "-o", out, "--tokens", "--precision", "fp32")
    assert result.exit_code == 0, result.output
    for row, score in zip(out.read_text().splitlines(), expected, strict=True):
        logprob, tokens, each = row.split("\t")
        values = [float(v) for v in each.split(" ")]
        assert int(tokens) == len(values) == score.tokens
        assert float(logprob) == pytest.approx(sum(values), abs=1e-5 * len(values))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_the_command_scores_in_bf16_and_int8(trained_run, pairs, tmp_path, precision):
    src, tgt = write_lines(tmp_path / "s.en", pairs[0]), write_lines(tmp_path / "t.de", pairs[1])
    result = invoke("score", trained_run, "--src", src, "--tgt", tgt, "--device", "cpu", "--precision", precision)
    assert result.exit_code == 0, result.output
    logprobs = [float(row.split("\t")[0]) for row in result.stdout.splitlines()]
    expected = mtkit.load(trained_run, device="cpu", precision=precision).score(*pairs)
    assert logprobs == [pytest.approx(s.logprob, abs=1e-5) for s in expected]
    assert all(math.isfinite(v) and v < 0 for v in logprobs)


@pytest.mark.parametrize("gzipped", [False, True], ids=["counted first", "found as read"])
@pytest.mark.parametrize(
    ("src_lines", "tgt_lines", "message"),
    [(3, 2, ("t.de: has no line 3, which ", "s.en has")), (1, 2, ("s.en: has no line 2, which ", "t.de has"))],
)
def test_files_of_different_lengths_are_one_error_line_and_no_output(
    trained_run, tmp_path, src_lines, tgt_lines, message, gzipped
):
    """Two plain files are counted before the model loads; a gzipped one (lines unknown until read) is found
    short as the two are read in step. Either way one error line names the shorter file, and nothing is written."""
    src = write_lines(tmp_path / "s.en", ["A dog runs."] * src_lines)
    tgt = write_lines(tmp_path / "t.de", ["Ein Hund läuft."] * tgt_lines)
    if gzipped:
        tgt.with_name("t.de.gz").write_bytes(gzip.compress(tgt.read_bytes()))
        tgt.unlink()
        tgt = tgt.with_name("t.de.gz")
    out = tmp_path / "scores.txt"
    result = invoke("score", trained_run, "--src", src, "--tgt", tgt, "-o", out, "--device", "cpu")
    one_line_error(result, *(fragment.replace("t.de", tgt.name) for fragment in message))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["s.en", tgt.name]  # no output, no temporary file


def test_both_sides_from_standard_input_are_refused(trained_run):
    result = invoke("score", trained_run, "--src", "-", "--tgt", "-", "--device", "cpu", input="A dog.\nEin Hund.\n")
    one_line_error(result, "read one stream")


def test_a_mismatch_across_a_chunk_boundary_names_its_line():
    chunks = paired_chunks(iter(["a", "b", "c", "d"]), iter(["w", "x", "y", "z", "extra"]), size=2)
    assert next(chunks) == (["a", "b"], ["w", "x"]) and next(chunks) == (["c", "d"], ["y", "z"])
    with pytest.raises(PairMismatch, match="the sources end before line 5"):
        next(chunks)


def test_a_line_over_the_models_positions_is_truncated_with_a_warning(trained_run, translator, tmp_path):
    long = " ".join(["dog"] * (4 * translator.model.max_source_positions))
    src = write_lines(tmp_path / "s.en", ["A dog.", long])
    tgt = write_lines(tmp_path / "t.de", [long, "Ein Hund."])
    result = invoke("score", trained_run, "--src", src, "--tgt", tgt, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert f"line 2: over {translator.model.max_source_positions - 1} source tokens" in result.stderr
    assert f"line 1: over {translator.model.max_target_positions - 1} target tokens" in result.stderr
    assert int(result.stdout.splitlines()[0].split("\t")[1]) == translator.model.max_target_positions
