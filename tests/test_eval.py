"""`mtkit eval` gives the numbers the sacrebleu tool gives on the same files, prints what it prints for the same
command line, and fails with one-line errors."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import captions
import pytest
from helpers import invoke as invoke_cli
from sacrebleu.metrics import BLEU, CHRF, TER
from typer.testing import CliRunner

from mtkit.cli import app
from mtkit.scoring.metrics import METRICS, PAPER_STYLE, corpus_scores

LINES = 300  # enough for stable scores; TER and the bootstrap stay fast
WIDTH = 10  # decimals asked of sacrebleu; our values are compared at the same width

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, ["eval", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


def mtkit_json(*args) -> list[dict]:
    return json.loads(invoke(*args, "--json").stdout)


def sacrebleu(*args, env=None, input=None) -> str:
    """The sacrebleu command-line tool's stdout."""
    command = [sys.executable, "-m", "sacrebleu", *map(str, args), "-q"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, input=input, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def sacrebleu_json(*args, env=None) -> dict[str, dict]:
    result = json.loads(sacrebleu(*args, "--format", "json", "-w", WIDTH, env=env))
    return {r["name"]: r for r in (result if isinstance(result, list) else [result])}


def rounded(value: float) -> float:
    return float(f"{value:.{WIDTH}f}")


@pytest.fixture(scope="module")
def wmt22(tmp_path_factory) -> dict:
    """LINES English captions as a stand-in for WMT22 en-de's test set: the source, references A and B (B drawn
    from the German synonyms), and two damaged copies of B."""
    out = tmp_path_factory.mktemp("wmt22")
    corpus = captions.captions(LINES, seed=22)
    lines = {
        "src": [c.render("en") for c in corpus],
        "ref_a": [c.render("de") for c in corpus],
        "ref_b": [c.render("de", random.Random(f"ref B {i}")) for i, c in enumerate(corpus)],
    }
    # Every third line without its first word; every second line in capitals (so case matters).
    lines["clipped"] = [" ".join(s.split()[1:]) if i % 3 == 0 else s for i, s in enumerate(lines["ref_b"])]
    lines["shouted"] = [s.upper() if i % 2 else s for i, s in enumerate(lines["ref_b"])]
    paths = {"lines": lines}
    for name, text in lines.items():
        paths[name] = out / f"{name}.txt"
        paths[name].write_text("\n".join(text) + "\n", encoding="utf-8")
    return paths


SEGMENTS = 200  # captions are short: sacreBLEU's command lines below run in well under a second each


@pytest.fixture(scope="module")
def m30k(tmp_path_factory) -> dict:
    """SEGMENTS German captions, a second reference and two edited system outputs."""
    ref = captions.parallel(SEGMENTS, seed=30, langs=("de",))["de"]
    lines = {
        "ref": ref,
        "ref2": [" ".join(s.split()[:-1]) if i % 5 == 0 else s for i, s in enumerate(ref)],
        # Every third caption without its first word, every fourth in capitals (so case matters).
        "hyp": [" ".join(s.split()[1:]) if i % 3 == 0 else s.upper() if i % 4 == 1 else s for i, s in enumerate(ref)],
        "hyp2": [" ".join(s.split()[:-1]) if i % 2 == 0 else s for i, s in enumerate(ref)],
    }
    out = tmp_path_factory.mktemp("m30k")
    files = {"stdin": {name: "\n".join(text) + "\n" for name, text in lines.items()}}  # texts to pipe in
    for name, text in files["stdin"].items():
        files[name] = out / f"{name}.de"
        files[name].write_text(text, encoding="utf-8")
    files["stdin"]["hyp hyp2"] = "".join(f"{a}\t{b}\n" for a, b in zip(lines["hyp"], lines["hyp2"]))
    return files


def without_comparable(output: str) -> str:
    """mtkit's JSON less the ``comparable`` key it adds after the last of sacreBLEU's keys of each score."""
    return re.sub(r',\n *"comparable": (?:true|false)(?=\n)', "", output)


# sacreBLEU command lines over the files of m30k; "< NAME" puts that text on stdin instead of giving -i.
SACREBLEU_COMMAND_LINES = {
    "ref -i hyp": "ref -i hyp",
    "three metrics": "ref -i hyp -m bleu chrf ter",
    "tokenizer": "ref -i hyp -tok intl",
    "lowercase": "ref -i hyp -m bleu chrf ter -lc",
    "case flags": "ref -i hyp -m chrf ter bleu --chrf-lowercase --ter-case-sensitive",
    "score only": "ref -i hyp -b",
    "scores only": "ref -i hyp -m bleu chrf ter -b",
    "scores only text": "ref -i hyp -m bleu chrf ter -b -f text",
    "width": "ref -i hyp -w 4",
    "json": "ref -i hyp -m bleu chrf -f json",
    "text": "ref -i hyp -m bleu chrf ter -f text -tok intl -w 3",
    "long options": "ref --input hyp --metrics bleu chrf --tokenize char --lowercase --width 2 --format text",
    "two references": "ref ref2 -i hyp -m bleu chrf ter",
    "stdin": "ref -m bleu chrf < hyp",
    "chrf++": "ref -i hyp -m chrf --chrf-word-order 2",
    "chrf++ text": "ref -i hyp -m bleu chrf -cw 2 -f text",
    "sentence": "ref -i hyp -sl",
    "sentence chrf": "ref ref2 -i hyp -sl -m chrf -w 2",
    "paired": "ref -i hyp hyp2 --paired-bs --paired-bs-n 100",
    "paired table": "ref -i hyp hyp2 -m bleu chrf ter -pbs -pbsn 100 -f text",
    "paired latex": "ref ref2 -i hyp2 hyp -m chrf bleu --paired-bs --paired-bs-n 100 -f latex -w 2",
    "paired stdin": "ref --paired-bs --paired-bs-n 100 -f text < hyp hyp2",
}


@pytest.mark.parametrize("command_line", SACREBLEU_COMMAND_LINES.values(), ids=SACREBLEU_COMMAND_LINES)
def test_a_sacrebleu_command_line_prints_what_sacrebleu_prints(m30k, command_line, monkeypatch):
    monkeypatch.setenv("SACREBLEU_SEED", "7")  # for both: the bootstrap resamples the same segments
    words, _, stdin = command_line.partition(" < ")
    args = [m30k.get(word, word) for word in words.split()]
    stdin_text = m30k["stdin"][stdin] if stdin else None
    theirs = sacrebleu(*args, input=stdin_text)
    result = invoke_cli("eval", *args, "-q", input=stdin_text)
    assert result.exit_code == 0, result.output
    ours = result.stdout
    if ours != theirs:  # only JSON may differ: mtkit adds "comparable" to each score
        assert without_comparable(ours) == theirs
        assert ours.count('"comparable": true') == theirs.count('"score"') > 0


# With --hyp, --lowercase is BLEU's and chrF's; sacreBLEU sets each metric's case alone. TER ignores case in both
# unless --ter-case-sensitive.
SAME_CASE = [
    ([], []),
    (["--lowercase"], ["-lc", "--chrf-lowercase"]),
    (["-lc", "--ter-case-sensitive"], ["-lc", "--chrf-lowercase", "--ter-case-sensitive"]),
    (["--chrf-lowercase"], ["--chrf-lowercase"]),
    (["--ter-case-sensitive"], ["--ter-case-sensitive"]),
]


@pytest.mark.parametrize("hyp_flags, input_flags", SAME_CASE)
def test_hyp_keeps_mtkit_case_rules_and_input_takes_sacrebleus(m30k, hyp_flags, input_flags):
    metrics = ["-m", "bleu", "chrf", "ter", "-w", 4]
    ours = mtkit_json("--hyp", m30k["hyp"], "--ref", m30k["ref"], *metrics, *hyp_flags)
    assert ours == json.loads(invoke(m30k["ref"], "-i", m30k["hyp"], *metrics, *input_flags).stdout)


# Each metric mtkit eval offers, as the sacrebleu tool's command line asks for it.
SACREBLEU_METRIC = {
    "bleu": ["-m", "bleu"],
    "chrf": ["-m", "chrf"],
    "chrf++": ["-m", "chrf", "-cw", 2],
    "ter": ["-m", "ter"],
}


def test_every_metric_defaults_to_what_the_sacrebleu_tool_computes(m30k):
    """TER with --hyp (and in `mtkit run`'s report) was case-sensitive where sacreBLEU's ignores case: 52.81
    against sacreBLEU's 52.23 on a WMT22 en-de output. With no option, every metric is sacreBLEU's."""
    assert set(SACREBLEU_METRIC) == set(METRICS)  # a new metric needs its sacreBLEU spelling here
    ter = ["-m", "ter", "-b", "-w", 4]
    assert sacrebleu(m30k["ref"], "-i", m30k["hyp"], *ter) != sacrebleu(
        m30k["ref"], "-i", m30k["hyp"], *ter, "--ter-case-sensitive"
    )  # the hypothesis' case differs from the reference's, so the default shows
    hyps, refs = m30k["hyp"].read_text().splitlines(), m30k["ref"].read_text().splitlines()
    for name, spelling in SACREBLEU_METRIC.items():
        theirs = sacrebleu(m30k["ref"], "-i", m30k["hyp"], *spelling, "-b", "-w", 4)
        assert invoke("--hyp", m30k["hyp"], "--ref", m30k["ref"], "-m", name, "-b", "-w", 4).stdout == theirs, name
        assert invoke(m30k["ref"], "-i", m30k["hyp"], "-m", name, "-b", "-w", 4).stdout == theirs, name
        assert f"{corpus_scores(hyps, [refs], (name,))[0].value:.4f}\n" == theirs, name  # as `mtkit run` scores


def test_hyp_keeps_mtkit_defaults_and_output(m30k):
    scores = mtkit_json("--hyp", m30k["hyp"], "--ref", m30k["ref"])  # BLEU and chrF, at full precision, in a list
    assert [s["name"] for s in scores] == ["BLEU", "chrF2"] and f"{scores[0]['score']:.4f}" != f"{scores[0]['score']}"
    assert [s["name"] for s in mtkit_json("--hyp", m30k["hyp"], "--ref", m30k["ref"], "-m", "ter", "bleu")] == [
        "TER",
        "BLEU",
    ]  # in the order asked; sacreBLEU sorts them
    one = mtkit_json("--hyp", m30k["hyp"], "--ref", m30k["ref"], "-m", "bleu", "-w", 1)
    assert one == [json.loads(invoke(m30k["ref"], "-i", m30k["hyp"]).stdout)]
    text = invoke("--hyp", m30k["hyp"], "--ref", m30k["ref"], "-f", "text", "-w", 3).stdout.splitlines()
    assert re.fullmatch(r"BLEU = \d+\.\d{3} [\d./]+ \(BP = .*\)", text[0]) and text[1].startswith("  signature: ")
    assert text[2].startswith("chrF2 = ") and len(text) == 4
    only = invoke("--hyp", m30k["hyp"], "--ref", m30k["ref"], "-b").stdout.splitlines()
    assert only == [f"{scores[0]['score']:.2f}", f"{scores[1]['score']:.2f}"]
    assert mtkit_json("--hyp", m30k["hyp"], "--ref", m30k["ref"], "-b") == [s["score"] for s in scores]


def test_tok_is_the_tokenizer_and_t_still_the_test_set(m30k):
    """Click reads an option of several letters after one dash whole, never as -t with the value "ok"."""
    bleu = json.loads(invoke(m30k["ref"], "-i", m30k["hyp"], "-tok", "intl").stdout)
    assert bleu["tok"] == "intl"
    result = runner.invoke(app, ["eval", "-i", str(m30k["hyp"]), "-t", "no-such-set", "-l", "en-de"])
    assert result.exit_code == 1 and "unknown test set 'no-such-set'" in result.stderr


def assert_equal_scores(ours: list[dict], theirs: dict[str, dict]) -> None:
    for entry in ours:
        assert rounded(entry["score"]) == theirs[entry["name"]]["score"], entry["name"]
        assert entry["signature"] == theirs[entry["name"]]["signature"]


@pytest.mark.parametrize(
    "hyp, refs, mtkit_flags, sacrebleu_flags",
    [
        ("ref_b", ["ref_a"], [], []),
        ("clipped", ["ref_a", "ref_b"], [], []),
        ("shouted", ["ref_a"], ["--tokenize", "intl", "--lowercase"], ["-tok", "intl", "-lc", "--chrf-lowercase"]),
        ("src", ["ref_a"], ["--tokenize", "char", "--ter-case-sensitive"], ["-tok", "char", "--ter-case-sensitive"]),
    ],
)
def test_corpus_scores_equal_the_sacrebleu_tool(wmt22, hyp, refs, mtkit_flags, sacrebleu_flags):
    ref_args = [a for r in refs for a in ("--ref", wmt22[r])]
    ours = mtkit_json("--hyp", wmt22[hyp], *ref_args, "--metrics", "bleu,chrf,chrf++,ter", *mtkit_flags)
    assert [s["name"] for s in ours] == ["BLEU", "chrF2", "chrF2++", "TER"]
    ref_files = [wmt22[r] for r in refs]
    chrf_flags = [f for f in sacrebleu_flags if f.startswith("--chrf")]
    theirs = sacrebleu_json(*ref_files, "-i", wmt22[hyp], "-m", "bleu", "chrf", "ter", *sacrebleu_flags)
    theirs |= sacrebleu_json(*ref_files, "-i", wmt22[hyp], "-m", "chrf", "--chrf-word-order", 2, *chrf_flags)
    assert_equal_scores(ours, theirs)
    assert f"nrefs:{len(refs)}" in ours[0]["signature"]


def test_every_bleu_tokenizer_equals_the_sacrebleu_tool(wmt22):
    for tokenizer in ("13a", "intl", "zh", "char", "none"):
        ours = mtkit_json(
            "--hyp", wmt22["clipped"], "--ref", wmt22["ref_a"], "--metrics", "bleu", "--tokenize", tokenizer
        )
        assert_equal_scores(ours, sacrebleu_json(wmt22["ref_a"], "-i", wmt22["clipped"], "-tok", tokenizer))
        assert f"tok:{tokenizer}" in ours[0]["signature"]


def test_text_output_prints_each_score_with_its_signature(wmt22):
    out = invoke("--hyp", wmt22["ref_b"], "--ref", wmt22["ref_a"], "--metrics", "bleu", "chrf++").stdout.splitlines()
    assert out[0].startswith("BLEU = ") and out[1].startswith("  signature: nrefs:1|case:mixed|eff:no|tok:13a")
    assert out[2].startswith("chrF2++ = ") and out[3].startswith("  signature: nrefs:1|") and "nw:2" in out[3]


def test_sentence_scores_equal_sacrebleu_sentence_score(wmt22):
    args = ["--hyp", wmt22["clipped"], "--ref", wmt22["ref_a"], "--ref", wmt22["ref_b"], "--sentence"]
    args += ["--metrics", "bleu,chrf,chrf++,ter", "--paper-style"]
    ours = {s["name"]: s for s in mtkit_json(*args)}
    metrics = {
        "BLEU": BLEU(effective_order=True),  # as sacrebleu -sl and sentence_bleu
        PAPER_STYLE: BLEU(tokenize="13a", lowercase=True, effective_order=True),
        "chrF2": CHRF(),
        "chrF2++": CHRF(word_order=2),
        "TER": TER(),
    }
    assert list(ours) == list(metrics)
    text = wmt22["lines"]
    segments = list(zip(text["clipped"], text["ref_a"], text["ref_b"]))
    for name, metric in metrics.items():
        expected = [metric.sentence_score(hyp, [a, b]).score for hyp, a, b in segments]
        assert ours[name]["values"] == expected, name
        assert ours[name]["comparable"] == (name != PAPER_STYLE)
    assert "eff:yes" in ours["BLEU"]["signature"]

    result = invoke(*args)  # SEGMENT<TAB>METRIC<TAB>SCORE, each segment's metrics together
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows) == LINES * len(metrics)
    assert rows[: len(metrics)] == [["1", name, f"{ours[name]['values'][0]:.4f}"] for name in metrics]
    assert rows[-1] == [str(LINES), "TER", f"{ours['TER']['values'][-1]:.4f}"]
    assert f"BLEU signature: {ours['BLEU']['signature']}" in result.stderr.splitlines()


def test_paper_style_bleu_is_labelled_and_printed_beside_sacrebleu(wmt22):
    args = ["--hyp", wmt22["shouted"], "--ref", wmt22["ref_a"], "--metrics", "chrf", "--paper-style"]
    scores = mtkit_json(*args)
    assert [(s["name"], s["comparable"]) for s in scores] == [("BLEU", True), (PAPER_STYLE, False), ("chrF2", True)]
    assert "not sacreBLEU" in PAPER_STYLE
    assert scores[1]["score"] > scores[0]["score"]  # the capitals no longer cost n-gram matches
    # The definition: 13a tokenization and lowercasing, as `sacrebleu -tok 13a -lc`.
    paper = sacrebleu_json(wmt22["ref_a"], "-i", wmt22["shouted"], "-tok", "13a", "-lc")["BLEU"]
    assert rounded(scores[1]["score"]) == paper["score"] and scores[1]["signature"] == paper["signature"]
    lines = invoke(*args).stdout.splitlines()
    assert lines[0].startswith("BLEU = ")
    assert lines[2].startswith(f"{PAPER_STYLE} = ") and "case:lc" in lines[3]


def test_paired_bootstrap_equals_sacrebleu_paired_bs(wmt22, monkeypatch):
    systems = [wmt22["clipped"], wmt22["ref_b"], wmt22["src"]]  # the first is the baseline
    args = [a for path in systems for a in ("--hyp", path)]
    args += ["--ref", wmt22["ref_a"], "--metrics", "bleu,chrf", "--paired-bs", "--paired-bs-n", 200]
    ours = mtkit_json(*args, "--paired-bs-seed", 7)
    # sacrebleu's --format json fails on its own float32 chrF means, so read its LaTeX table.
    table = sacrebleu(
        wmt22["ref_a"], "-i", *systems, "-m", "bleu", "chrf", "--paired-bs", "--paired-bs-n", 200,
        "--format", "latex", "-w", WIDTH, env={**os.environ, "SACREBLEU_SEED": "7", "NO_COLOR": "1"},
    )  # fmt: skip
    rows = [line.split("&")[1:] for line in table.splitlines() if "&" in line and "System" not in line]
    assert len(rows) == len(systems)
    cell = re.compile(r"([\d.]+) \(([\d.]+) ± ([\d.]+)\)(?: \(p = ([\d.]+)\))?")
    for column, metric in enumerate(ours):
        assert "bs:200|seed:7|" in metric["signature"]
        assert [s["system"] for s in metric["systems"]] == [str(path) for path in systems]
        for row, system in zip(rows, metric["systems"]):
            score, mean, ci, p = cell.search(row[column]).groups()
            assert (f"{system['score']:.{WIDTH}f}", f"{system['mean']:.{WIDTH}f}") == (score, mean)
            assert f"{system['ci']:.{WIDTH}f}" == ci
            assert (p is None) == (system["p_value"] is None)
            assert p is None or f"{system['p_value']:.4f}" == p
    assert ours[0]["systems"][2]["p_value"] < 0.05  # the source is not a translation

    monkeypatch.setenv("SACREBLEU_SEED", "7")  # sacrebleu's own way to set the seed works too
    assert mtkit_json(*args) == ours
    text = invoke(*args).stdout.splitlines()
    assert text[0] == "BLEU: score (bootstrap mean ± 95% CI), p-value against the baseline"
    assert text[1].endswith("baseline") and re.search(r"\d \(\d+\.\d\d ± \d+\.\d\d\)  p = 0\.\d{4}\*?$", text[3])


def offline_env(cache) -> dict:
    """SACREBLEU pointed at ``cache``, and a proxy that refuses connections: nothing can be downloaded."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again once the block ends, so connections are refused
    proxy = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy")}
    return {**env, "SACREBLEU": str(cache), "http_proxy": proxy, "https_proxy": proxy}


def mtkit_process(*args, env) -> subprocess.CompletedProcess:
    """A fresh process, since sacreBLEU reads $SACREBLEU when imported."""
    command = [sys.executable, "-m", "mtkit", "eval", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_missing_test_set_offline_is_a_one_line_error_naming_the_download(wmt22, tmp_path):
    proc = mtkit_process("--hyp", wmt22["ref_b"], "-t", "wmt14", "-l", "en-de", env=offline_env(tmp_path / "cache"))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: test set wmt14 en-de"), proc.stderr
    assert "https://statmt.org/wmt14/test-filtered.tgz" in lines[0]
    assert str(tmp_path / "cache" / "wmt14" / "raw" / "wmt14.test-filtered.tgz") in lines[0]


def write_wmt22_cache(cache, lines: dict) -> None:
    """sacreBLEU's cache for wmt22 en-de as its download leaves it: the archive and the unpacked XML."""
    raw = cache / "wmt22" / "raw"
    xml = raw / "wmt22-news-systems-1.1" / "xml" / "wmttest2022.en-de.all.xml"
    xml.parent.mkdir(parents=True)
    dataset = ET.Element("dataset", id="test")
    doc = ET.SubElement(ET.SubElement(dataset, "collection", id="general"), "doc", id="doc1", origlang="en")
    for tag, attrs, text in (
        ("src", {"lang": "en"}, lines["src"]),
        ("ref", {"lang": "de", "translator": "A"}, lines["ref_a"]),
        ("ref", {"lang": "de", "translator": "B"}, lines["ref_b"]),
    ):
        paragraph = ET.SubElement(ET.SubElement(doc, tag, attrs), "p")
        for number, segment in enumerate(text, 1):
            ET.SubElement(paragraph, "seg", id=str(number)).text = segment
    ET.ElementTree(dataset).write(xml, encoding="utf-8", xml_declaration=True)
    with tarfile.open(raw / "wmt22.v1.1.tar.gz", "w:gz") as archive:  # present, so sacreBLEU skips the download
        archive.add(xml.parent.parent, arcname=xml.parent.parent.name)


def test_test_set_references_come_from_the_sacrebleu_cache(wmt22, tmp_path):
    cache = tmp_path / "cache"
    write_wmt22_cache(cache, wmt22["lines"])
    env = offline_env(cache)
    proc = mtkit_process(
        "--hyp", wmt22["ref_b"], "-t", "wmt22", "-l", "en-de", "--metrics", "bleu,chrf", "--json", env=env
    )
    assert proc.returncode == 0, proc.stderr
    theirs = sacrebleu_json("-t", "wmt22", "-l", "en-de", "-i", wmt22["ref_b"], "-m", "bleu", "chrf", env=env)
    assert_equal_scores(json.loads(proc.stdout), theirs)
    assert (cache / "wmt22" / "wmt22.en-de.ref-A").is_file()  # sacreBLEU's default reference for en-de
    command_line = ["-t", "wmt22", "-l", "en-de", "-i", wmt22["clipped"], "-m", "bleu", "chrf", "-f", "text"]
    proc = mtkit_process(*command_line, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sacrebleu(*command_line, env=env)


def test_bad_input_is_one_line_and_exit_1(wmt22, tmp_path):
    short = tmp_path / "short.de"
    short.write_text("eine Zeile\n")
    empty = tmp_path / "empty.de"
    empty.write_text("")
    hyp, ref = wmt22["ref_b"], wmt22["ref_a"]
    cases = [
        (["--hyp", tmp_path / "missing.de", "--ref", ref], ["missing.de", "file not found"]),
        (["--hyp", short, "--ref", ref], [f"{short} has 1 lines but {ref} has {LINES}"]),
        (["--hyp", empty, "--ref", ref], ["empty.de", "empty"]),
        (["--hyp", hyp, "--ref", ref, "--metrics", "meteor"], ["--metrics", "meteor"]),
        (["--hyp", hyp, "--ref", ref, "--tokenize", "moses"], ["--tokenize", "13a", "moses"]),
        (["--hyp", hyp, "-t", "wmt99", "-l", "en-de"], ["unknown test set 'wmt99'"]),
        (["--hyp", hyp, "-t", "wmt22", "-l", "en-xx"], ["wmt22", "no language pair 'en-xx'"]),
        (["--hyp", hyp, "-t", "wmt22"], ["--langpair"]),
        (["--hyp", hyp, "--ref", ref, "-t", "wmt22", "-l", "en-de"], ["not both"]),
        (["--hyp", hyp], ["--ref"]),
        (["--hyp", hyp, "--hyp", ref, "--ref", ref], ["--paired-bs"]),
        (["--hyp", hyp, "--ref", ref, "--paired-bs"], ["two or more --hyp"]),
        ([ref, "-i", hyp, "--hyp", hyp], ["--hyp", "-i", "not both"]),
        ([ref, "-i", hyp, ref], ["several systems", "--paired-bs"]),
        ([ref, "-i", hyp, ref, "--paired-bs", "-sl"], ["--paired-bs", "--sentence"]),
        ([ref, "-i", hyp, "-f", "yaml"], ["--format", "json, text, latex", "'yaml'"]),
        (["--hyp", hyp, "--ref", ref, "-f", "latex"], ["-f latex", "-i"]),
        (["--hyp", hyp, "--ref", ref, "--json", "-f", "text"], ["--json", "--format text"]),
        ([ref, "-i", hyp, "-m", "bleu", "chrf", "meteor"], ["--metrics", "meteor"]),
        ([ref, "-i", hyp, "-tok", "moses"], ["--tokenize", "moses"]),
        ([ref], ["<stdin>", "empty"], ""),
        ([ref], ["<stdin>:2: 1 tab-separated systems, but line 1 has 2"], "a\tb\nc\n"),
        ([ref, "--paired-bs"], [f"<stdin> column 1 has 1 lines but {ref} has {LINES}"], "a\tb\n"),
        ([ref], ["<stdin>:1: invalid UTF-8"], b"\xff\n"),
    ]
    for args, fragments, *stdin in cases:
        result = runner.invoke(app, ["eval", *map(str, args)], input=stdin[0] if stdin else None)
        assert result.exit_code == 1, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
        assert all(fragment in lines[0] for fragment in fragments), (args, lines[0])
