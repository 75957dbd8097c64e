"""Dual conditional cross-entropy filtering (Junczys-Dowmunt, 2018): the score computed by hand from each model's
``LineTranslator.score``, garbage and misaligned pairs ranked last by tiny trained models of both directions, the
pairs kept in order, a file changed between the passes or an output that cannot be written named as such, and the
filter in `mtkit prepare` (its device and precision recorded, its options' misuse refused in their names) and in
the distillation and back-translation chains, each recorded and up to date on a re-run."""

from __future__ import annotations

import copy
import errno
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import invoke, one_line_error, train_direction

from mtkit.config import ConfigError, PairFilterConfig, from_dict
from mtkit.data.parallel import DataError, read_lines
from mtkit.files import OutputError, file_sha256
from mtkit.translation import pair_filter
from mtkit.translation.pair_filter import dual_scores, filter_pair_files, kept_mask, load_scorer
from mtkit.workflows.backtranslation import back_translate
from mtkit.workflows.distillation import distil
from mtkit.workflows.stages import Digests, StageRecord, decoding

TRAINING = {"max_steps": 600, "valid_every": 600, "save_every": 600, "threads": 1}
GARBAGE = "qqx zzv wkp xyq jjj"


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus_files) -> tuple[Path, Path]:
    """(en->de, de->en), trained on the same captions."""
    root = tmp_path_factory.mktemp("dcce")
    forward = train_direction(root, corpus_files, "en", "de", TRAINING)
    return forward, train_direction(root, corpus_files, "de", "en", TRAINING)


@pytest.fixture(scope="module")
def scorers(models):
    forward, reverse = models
    return (
        load_scorer(forward, "en", "de", "forward", "cpu", "fp32"),
        load_scorer(reverse, "de", "en", "reverse", "cpu", "fp32"),
    )


@pytest.fixture(scope="module")
def noisy(corpus_files) -> tuple[list[str], list[str]]:
    """20 validation pairs, then two left untranslated (the source copied) and one of garbage."""
    sources = corpus_files["val.en"].read_text().splitlines()
    targets = corpus_files["val.de"].read_text().splitlines()[:20]
    return sources[:20] + sources[20:22] + [sources[0]], targets + sources[20:22] + [GARBAGE]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_the_score_is_the_papers_formula_over_each_models_cross_entropy_per_token(scorers, noisy):
    forward, reverse = scorers
    sources, targets = noisy
    found = list(dual_scores(forward, reverse, sources, targets))
    there, back = list(forward.score(sources, targets)), list(reverse.score(targets, sources))
    for pair, a, b in zip(found, there, back, strict=True):
        h_a, h_b = -a.logprob / a.tokens, -b.logprob / b.tokens
        assert (pair.forward, pair.reverse) == pytest.approx((h_a, h_b), rel=1e-6)
        assert pair.score == pytest.approx(abs(h_a - h_b) + (h_a + h_b) / 2, rel=1e-6)


def test_garbage_and_untranslated_pairs_rank_last_and_misaligned_ones_below_the_aligned(scorers, noisy, corpus_files):
    scores = [pair.score for pair in dual_scores(*scorers, *noisy)]
    assert scores[22] == max(scores)  # garbage
    assert min(scores[20:]) > max(scores[:20])
    sources, targets = noisy[0][:10], corpus_files["val.de"].read_text().splitlines()[20:30]  # each another's target
    misaligned = [pair.score for pair in dual_scores(*scorers, sources, targets)]
    assert np.mean(misaligned) > np.mean(scores[:20]) + 0.2


def test_the_pairs_kept_are_the_lowest_scored_in_their_order_and_the_table_says_why(scorers, noisy, tmp_path):
    sources, targets = noisy
    src, tgt = write(tmp_path / "in.en", sources), write(tmp_path / "in.de", targets)
    scores = [pair.score for pair in dual_scores(*scorers, sources, targets)]
    settings = PairFilterConfig(keep=20 / 23)
    summary = filter_pair_files(*scorers, src, tgt, tmp_path / "a.en", tmp_path / "a.de", settings, tmp_path / "t.tsv")
    assert read_lines(tmp_path / "a.en") == sources[:20] and read_lines(tmp_path / "a.de") == targets[:20]
    assert (summary.pairs, summary.kept, summary.beyond_keep, summary.over_max_score) == (23, 20, 3, 0)
    half = PairFilterConfig(keep=0.5)
    filter_pair_files(*scorers, src, tgt, tmp_path / "b.en", tmp_path / "b.de", half, tmp_path / "t.tsv")
    lowest = sorted(sorted(range(23), key=lambda i: scores[i])[:12])
    assert read_lines(tmp_path / "b.en") == [sources[i] for i in lowest]
    assert read_lines(tmp_path / "b.de") == [targets[i] for i in lowest]
    rows = [line.split("\t") for line in read_lines(tmp_path / "t.tsv")]
    assert [float(row[0]) for row in rows] == pytest.approx(scores, abs=1e-6)
    assert [i for i, row in enumerate(rows) if row[3] == "1"] == lowest
    assert [row[4:] for row in rows] == [[s, t] for s, t in zip(sources, targets)]


def test_a_max_score_drops_what_is_above_it_and_the_outputs_may_replace_the_inputs(scorers, noisy, tmp_path):
    sources, targets = noisy
    src, tgt = write(tmp_path / "train.en", sources), write(tmp_path / "train.de", targets)
    scores = [pair.score for pair in dual_scores(*scorers, sources, targets)]
    limit = float(np.median(scores))
    summary = filter_pair_files(*scorers, src, tgt, src, tgt, PairFilterConfig(max_score=limit))
    below = [i for i, score in enumerate(scores) if score <= limit]
    assert read_lines(src) == [sources[i] for i in below] and read_lines(tgt) == [targets[i] for i in below]
    assert (summary.kept, summary.over_max_score) == (len(below), 23 - len(below))
    assert not list(tmp_path.glob(".*"))  # no staged file left behind


def test_a_file_that_changed_between_the_passes_is_refused_before_the_table_is_written(scorers, noisy, tmp_path):
    forward, reverse = scorers
    sources, targets = noisy
    src, tgt = write(tmp_path / "in.en", sources), write(tmp_path / "in.de", targets)
    growing = copy.copy(reverse)

    def score_then_grow(*args, **kwargs):
        scored = reverse.score_chunk(*args, **kwargs)
        write(tgt, [*targets, "one more line"])  # after the first pass has read both files whole
        return scored

    growing.score_chunk = score_then_grow
    table = tmp_path / "t.tsv"
    with pytest.raises(DataError, match="changed while they were filtered"):
        filter_pair_files(forward, growing, src, tgt, tmp_path / "a.en", tmp_path / "a.de", PairFilterConfig(keep=0.5),
                          table)  # fmt: skip
    assert not table.exists() and not (tmp_path / "a.en").exists()


@pytest.mark.parametrize("failing", ["a.de", "t.tsv"])
def test_an_output_that_cannot_be_written_is_the_one_named(scorers, noisy, tmp_path, monkeypatch, failing):
    sources, targets = noisy
    src, tgt = write(tmp_path / "in.en", sources), write(tmp_path / "in.de", targets)
    real_write = pair_filter.atomic_write

    class FullDisk(io.BytesIO):
        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def atomic_write(path: Path, write_file, partial=None) -> None:
        if failing in path.name:
            write_file(FullDisk())
        else:
            real_write(path, write_file, partial)

    monkeypatch.setattr(pair_filter, "atomic_write", atomic_write)
    with pytest.raises(OutputError) as raised:
        filter_pair_files(*scorers, src, tgt, tmp_path / "a.en", tmp_path / "a.de", PairFilterConfig(keep=0.5),
                          tmp_path / "t.tsv")  # fmt: skip
    message = str(raised.value)
    assert failing in message and "No space left" in message
    assert "in.en" not in message and "in.de" not in message and "a.en" not in message


def test_keep_rounds_to_the_nearest_pair_and_ties_keep_the_earlier_line():
    scores = np.array([3.0, 1.0, 1.0, 2.0, 1.0])
    keep, summary = kept_mask(scores, 0.5, 0.0)  # 2.5 pairs: 3
    assert keep.tolist() == [False, True, True, False, True] and summary.kept == 3
    keep, _ = kept_mask(scores, 0.3, 0.0)  # 1.5: 2, the first two of the three tied
    assert keep.tolist() == [False, True, True, False, False]
    keep, summary = kept_mask(scores, 1.0, 1.5)
    assert keep.tolist() == [False, True, True, False, True] and summary.over_max_score == 2


def test_a_model_of_other_languages_is_refused_naming_its_role(models):
    with pytest.raises(ConfigError, match="the reverse model .* translates de->en, not en->de"):
        load_scorer(models[1], "en", "de", "the reverse model")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"keep": 0.0}, "must be in (0, 1]"),
        ({"keep": 1.5}, "must be in (0, 1]"),
        ({"max_score": -1.0}, "give 0 (no limit) or more"),
        ({"reverse": "runs/x"}, "filters nothing"),
        ({"keep": 0.5, "reverse": "runs/x"}, "a distillation or back-translation: this config has neither"),
    ],
)
def test_bad_filter_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict({"pair_filter": settings})


# -- mtkit prepare ---------------------------------------------------------------------------------------------------


def test_prepare_filters_the_cleaned_training_split_records_it_and_does_nothing_again(
    multi30k_mirror, models, tmp_path
):
    forward, reverse = models
    plain = invoke("prepare", "multi30k_en_de", "-o", tmp_path / "plain", "--mirror", multi30k_mirror)
    assert plain.exit_code == 0, plain.output
    options = ["--filter-forward", forward, "--filter-reverse", reverse, "--filter-keep", "0.5", "--filter-scores",
               "--filter-device", "cpu"]  # fmt: skip
    out = tmp_path / "filtered"
    result = invoke("prepare", "multi30k_en_de", "-o", out, "--mirror", multi30k_mirror, *options)
    assert result.exit_code == 0, result.output
    sources, targets = read_lines(tmp_path / "plain" / "train.en"), read_lines(tmp_path / "plain" / "train.de")
    lowest, count = lowest_half(forward, reverse, sources, targets), math.floor(len(sources) / 2 + 0.5)
    assert read_lines(out / "train.en") == [sources[i] for i in lowest]
    assert read_lines(out / "train.de") == [targets[i] for i in lowest]
    for split in ("valid", "test"):  # as published
        assert read_lines(out / f"{split}.de") == read_lines(tmp_path / "plain" / f"{split}.de")
    record = json.loads((out / "prepare.json").read_text())
    assert record["splits"]["train"]["lines"] == count
    assert record["splits"]["train"]["filter"] == {"pairs": len(sources), "kept": count, "over_max_score": 0,
                                                   "beyond_keep": len(sources) - count}  # fmt: skip
    assert record["settings"]["filter"]["keep"] == 0.5 and set(record["settings"]["filter"]["sha256"]) == {
        "forward", "reverse"}  # fmt: skip
    assert {key: record["settings"]["filter"][key] for key in ("device", "precision")} == decoding("cpu")
    assert len(read_lines(out / "train.scores.tsv")) == len(sources)
    before = (out / "prepare.json").stat().st_mtime_ns
    again = invoke("prepare", "multi30k_en_de", "-o", out, "--mirror", multi30k_mirror, *options)
    assert again.exit_code == 0 and (out / "prepare.json").stat().st_mtime_ns == before
    assert read_lines(out / "train.en") == [sources[i] for i in lowest]  # not filtered twice
    other = "fp32" if decoding("cpu")["precision"] == "bf16" else "bf16"  # scores a pair a little differently
    third = invoke("prepare", "multi30k_en_de", "-o", out, "--mirror", multi30k_mirror, *options,
                   "--filter-precision", other)  # fmt: skip
    assert third.exit_code == 0, third.output
    assert json.loads((out / "prepare.json").read_text())["settings"]["filter"]["precision"] == other


def test_prepare_refuses_a_filter_of_one_model_or_of_nothing_in_one_line_naming_its_options(
    multi30k_mirror, models, tmp_path
):
    base = ["prepare", "multi30k_en_de", "-o", tmp_path / "out", "--mirror", multi30k_mirror]
    forward, reverse = ["--filter-forward", models[0]], ["--filter-reverse", models[1]]
    cases = [
        ([*forward, "--filter-keep", "0.9"], "two models: --filter-forward SRC->TGT and --filter-reverse"),
        ([*forward, *reverse], "--filter-forward, --filter-reverse: the filter filters nothing without --filter-keep"),
        (["--filter-scores"], "--filter-scores: the filter filters nothing"),
        ([*forward, *reverse, "--filter-keep", "0"], "--filter-keep is the fraction of pairs kept"),
        ([*forward, *reverse, "--filter-max-score", "-1"], "--filter-max-score bounds cross-entropies"),
    ]
    for options, message in cases:
        result = invoke(*base, *options)
        one_line_error(result, message)
        assert "pair_filter" not in result.output
    one_line_error(
        invoke(*base, "--filter-forward", tmp_path / "none", "--filter-reverse", models[1], "--filter-keep", "0.9"),
        "no model weights",
    )
    assert not (tmp_path / "out").exists()


# -- the chains ------------------------------------------------------------------------------------------------------


def chain_config(corpus_files, **sections):
    """A run of en->de on the captions, on the CPU, with ``sections``."""
    data = {"train_src": str(corpus_files["train.en"]), "train_tgt": str(corpus_files["train.de"]),
            "valid_src": str(corpus_files["val.en"]), "valid_tgt": str(corpus_files["val.de"]),
            "src_lang": "en", "tgt_lang": "de"}  # fmt: skip
    return from_dict({"data": data, "train": {"device": "cpu", "precision": "fp32"}, **sections})


def lowest_half(forward, reverse, sources: list[str], targets: list[str]) -> list[int]:
    """The lines the filter keeps at keep 0.5, scored as the chain's stage and prepare score them (in the precision
    ``auto`` means on the CPU)."""
    precision = decoding("cpu")["precision"]
    scorers = (load_scorer(forward, "en", "de", "forward", "cpu", precision),
               load_scorer(reverse, "de", "en", "reverse", "cpu", precision))  # fmt: skip
    scores = [pair.score for pair in dual_scores(*scorers, sources, targets)]
    return sorted(sorted(range(len(scores)), key=lambda i: scores[i])[: math.floor(len(scores) / 2 + 0.5)])


def test_distillation_filters_the_distilled_pairs_in_a_stage_of_its_own_that_a_rerun_finds_up_to_date(
    models, corpus_files, tmp_path
):
    forward, reverse = models
    cfg = chain_config(corpus_files, distillation={"teacher": [str(forward)], "beam": 2},
                       pair_filter={"reverse": str(reverse), "keep": 0.5})  # fmt: skip
    out = tmp_path / "run"
    stages: list = []
    made = distil(cfg, out, stages, StageRecord(out, Digests()), run_teacher=None)
    names = [stage.name for stage in stages]
    assert names.index("pair filter") == names.index("filter") + 1 and stages[names.index("pair filter")].ran
    sources, targets = read_lines(out / "distilled" / "train.en"), read_lines(out / "distilled" / "train.de")
    kept = lowest_half(forward, reverse, sources, targets)
    assert read_lines(out / "dual-filtered" / "train.de") == [targets[i] for i in kept]
    assert read_lines(out / "dual-filtered" / "train.en") == [sources[i] for i in kept]
    assert made.cfg.data.train_tgt == str(out / "dual-filtered" / "train.de")
    shortlist_from = json.loads((out / "stages.json").read_text())["stages"]["shortlist"]["inputs"]["source"]
    assert made.shortlist and shortlist_from == file_sha256(out / "dual-filtered" / "train.en")
    assert made.filters["kept"] == len(kept) and made.filters["dual_cross_entropy"] == len(sources) - len(kept)
    again: list = []
    distil(cfg, out, again, StageRecord(out, Digests()), run_teacher=None)
    assert not next(stage for stage in again if stage.name == "pair filter").ran
    stricter = chain_config(corpus_files, distillation={"teacher": [str(forward)], "beam": 2},
                            pair_filter={"reverse": str(reverse), "keep": 0.25})  # fmt: skip
    third: list = []
    distil(stricter, out, third, StageRecord(out, Digests()), run_teacher=None)
    assert next(stage for stage in third if stage.name == "pair filter").ran
    assert len(read_lines(out / "dual-filtered" / "train.de")) == math.floor(len(sources) / 4 + 0.5)


def test_back_translation_filters_the_synthetic_pairs_and_trains_on_those_kept(models, corpus_files, tmp_path):
    forward, reverse = models
    monolingual = corpus_files["val.de"].read_text().splitlines() + [GARBAGE]
    mono = write(tmp_path / "mono.de", monolingual)
    bt = {"monolingual": str(mono), "reverse_model": str(reverse), "method": "beam", "beam": 2}
    pair_filter = {"forward": str(forward), "keep": 0.5, "scores": True}
    out = tmp_path / "run"
    out.mkdir()
    stages: list = []
    trained_on = back_translate(
        chain_config(corpus_files, backtranslation=bt, pair_filter=pair_filter),
        out,
        stages,
        StageRecord(out, Digests()),
    )
    assert [stage.name for stage in stages] == ["reverse", "back-translate", "pair filter"]
    synthetic = trained_on.data.corpora[-1]
    folder = out / "backtranslated-filtered"
    assert (synthetic.train_src, synthetic.train_tgt) == (str(folder / "train.en"), str(folder / "train.de"))
    sources = read_lines(out / "backtranslated.en")
    kept = lowest_half(forward, reverse, sources, monolingual)
    assert read_lines(folder / "train.de") == [monolingual[i] for i in kept]
    assert len(monolingual) - 1 not in kept  # the garbage line
    assert len(read_lines(folder / "scores.tsv")) == len(monolingual)


def test_a_chain_filter_without_its_other_model_is_refused_before_any_stage(models, corpus_files, tmp_path):
    forward, reverse = models
    bt = {"monolingual": str(corpus_files["val.de"]), "reverse_model": str(reverse)}
    half = {"keep": 0.5}
    with pytest.raises(ConfigError, match="needs a forward model"):
        cfg = chain_config(corpus_files, backtranslation=bt, pair_filter=half)
        back_translate(cfg, tmp_path, [], StageRecord(tmp_path, Digests()))
    with pytest.raises(ConfigError, match="needs a reverse model"):
        distil(chain_config(corpus_files, distillation={"teacher": [str(forward)]}, pair_filter=half), tmp_path, [],
               None, run_teacher=None)  # fmt: skip
    assert not list(tmp_path.iterdir())
