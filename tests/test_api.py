"""The Python API (`import mtkit`): what the command line is built on, called directly."""

from __future__ import annotations

import subprocess
import sys

import captions
import pytest
from helpers import invoke

import mtkit
import mtkit.decoding.line_translator
from mtkit.config import SamplingConfig
from mtkit.decoding.search import beam_search


@pytest.fixture
def searches(monkeypatch) -> list[dict]:
    """The settings of every beam search run, as the translator passes them."""
    seen = []

    def recording(model, src, src_pad_mask, decode, *args, **kwargs):
        seen.append({k: getattr(decode, k) for k in ("beam", "lenpen", "max_len_a", "max_len_b")})
        return beam_search(model, src, src_pad_mask, decode, *args, **kwargs)

    monkeypatch.setattr(mtkit.decoding.line_translator, "beam_search", recording)
    return seen


def test_translate_uses_the_decode_settings_saved_with_the_run(run_with_decode_settings, searches):
    """`mtkit translate RUN` once searched with beam 5 and length penalty 1.0 whatever the recipe said."""
    assert invoke("translate", run_with_decode_settings, "--device", "cpu", input="A dog runs.\n").exit_code == 0
    assert searches[-1]["beam"] == 2 and searches[-1]["lenpen"] == 0.6
    result = invoke("translate", run_with_decode_settings, "--beam", 3, "--device", "cpu", input="A dog runs.\n")
    assert result.exit_code == 0
    assert searches[-1]["beam"] == 3 and searches[-1]["lenpen"] == 0.6  # what is not given stays the run's
    translator = mtkit.load(run_with_decode_settings, device="cpu")
    assert (translator.decode.beam, translator.decode.lenpen) == (2, 0.6)
    translator.translate(["A dog runs."], lenpen=0.0)
    assert searches[-1]["beam"] == 2 and searches[-1]["lenpen"] == 0.0


def test_the_api_translates_as_the_command_line_does(run_with_decode_settings, corpus_files):
    lines = corpus_files["val.en"].read_text().splitlines()[:8] + ["", "A cat."]
    translator = mtkit.load(run_with_decode_settings, device="cpu")
    stdin = "".join(line + "\n" for line in lines)
    result = invoke("translate", run_with_decode_settings, "--device", "cpu", input=stdin)
    assert translator.translate(lines) == result.stdout.split("\n")[:-1]
    assert translator.translate(iter(lines)) == translator.translate(lines)  # any iterable
    assert translator.translate(line + "\n" for line in lines) == translator.translate(lines)  # an open file


def test_hypotheses_stream_nbest_with_scores_and_alignments(run_with_decode_settings):
    translator = mtkit.load(run_with_decode_settings, device="cpu", alignments=True)
    lines = ["A man is walking.", "", "Two dogs play."]
    results = list(translator.hypotheses(lines))
    assert len(results) == 3 and results[1][0].text == "" and results[0][0].alignment
    nbest = list(translator.hypotheses(lines, nbest=2))
    assert [len(r) for r in nbest] == [2, 1, 2]
    assert all(r[0].score >= r[1].score and r[0].logprob < 0 for r in (nbest[0], nbest[2]))
    with pytest.raises(mtkit.MtkitError, match="nbest 3 needs a beam of at least 3"):
        list(translator.hypotheses(lines, nbest=3))


def test_sampling_through_the_api(run_with_decode_settings, corpus_files):
    """Top-1 sampling is greedy search, whatever the seed; wider sampling with one seed draws the same again.
    In fp32: bf16 logits tie often, and the two searches may break a tie differently."""
    lines = corpus_files["val.en"].read_text().splitlines()[:6]
    greedy = mtkit.load(run_with_decode_settings, device="cpu", precision="fp32", beam=1).translate(lines)
    top1 = mtkit.load(
        run_with_decode_settings, device="cpu", precision="fp32", sampling=SamplingConfig(top_k=1, seed=9), nbest=2
    )
    assert [[t.text for t in drawn] for drawn in top1.hypotheses(lines)] == [[g, g] for g in greedy]
    wide = SamplingConfig(temperature=2.0, seed=3)
    first, again = (mtkit.load(run_with_decode_settings, device="cpu", sampling=wide).translate(lines) for _ in "ab")
    assert first == again


def test_evaluate_and_prepare(tmp_path, corpus_files, multi30k_mirror):
    refs = corpus_files["val.de"].read_text().splitlines()
    scores = mtkit.evaluate(refs, [refs], metrics=["bleu", "chrf"])
    assert [s.name for s in scores] == ["BLEU", "chrF2"] and scores[0].value == pytest.approx(100.0)
    assert "version:" in scores[0].signature
    record = mtkit.prepare("multi30k_en_de", tmp_path / "data", mirror=str(multi30k_mirror))
    assert (
        record["splits"]["valid"]["lines"] == captions.MIRROR_SPLITS["val"]
        and (tmp_path / "data" / "train.de").is_file()
    )


def test_bad_input_raises_the_one_error_type(tmp_path, run_with_decode_settings):
    with pytest.raises(mtkit.MtkitError, match="checkpoint not found"):
        mtkit.load(tmp_path / "nothing.safetensors", device="cpu")
    with pytest.raises(mtkit.MtkitError, match="unknown decode setting bem"):
        mtkit.load(run_with_decode_settings, device="cpu").translate(["A dog."], bem=3)
    with pytest.raises(mtkit.MtkitError, match="decode.beam must be >= 1"):
        mtkit.load(run_with_decode_settings, device="cpu", beam=0)


def test_loading_a_model_imports_no_compiler_machinery(run_with_decode_settings):
    """The meta-device skeleton that checks a checkpoint's shapes computes no values: torch's Python meta kernels
    would import dynamo and sympy (1.5 s and 75 MB of every process that translates)."""
    script = (
        "import sys, mtkit; "
        f"mtkit.load({str(run_with_decode_settings)!r}, device='cpu', precision='int8').translate(['A dog.']); "
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stderr


def test_load_computes_on_the_threads_it_is_given(run_with_decode_settings, monkeypatch):
    """``mtkit.load(..., threads=N)`` sets torch's thread count before the model loads, as CTranslate2's
    ``intra_threads`` does; a negative count is refused."""
    import torch

    before, seen = torch.get_num_threads(), []

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return beam_search(*args, **kwargs)

    monkeypatch.setattr(mtkit.decoding.line_translator, "beam_search", recording)
    try:
        mtkit.load(run_with_decode_settings, device="cpu", threads=before + 1).translate(["A dog runs."])
        assert seen == [before + 1]
    finally:
        torch.set_num_threads(before)
    with pytest.raises(mtkit.MtkitError, match="threads must be >= 0"):
        mtkit.load(run_with_decode_settings, device="cpu", threads=-1)


def test_dir_lists_the_api_imported_on_first_use():
    """The API functions are imported lazily (``__getattr__``), and ``dir(mtkit)``, which completion and
    ``help()`` read, lists them all the same."""
    listed = dir(mtkit)
    assert set(mtkit.__all__) <= set(listed) and "__version__" in listed
    assert listed == sorted(listed)
