"""What ``mtkit eval`` does with its command line: read the texts, score them by mtkit.scoring.metrics, render them.

The command speaks two dialects, told apart by how the hypothesis is given. As ``-i FILE...`` or on
stdin it is sacreBLEU's command line, and every default and every output is the ``sacrebleu`` tool's:
BLEU alone, ``-lc`` for BLEU only, chrF case-sensitive and TER case-insensitive unless asked
otherwise, single-system scores sorted by metric, JSON rounded to one decimal. As ``--hyp FILE``
mtkit's own conventions hold: BLEU and chrF by default, ``--lowercase`` for both, text blocks with the
signature below each score, JSON lists at full precision. Each metric's case is sacreBLEU's by default
in both (BLEU and chrF case-sensitive, TER not), so a score means what the same metric means elsewhere.

COMET and CometKiwi (``-m comet``, ``-m cometkiwi``) read the source too (``--src``) and come after sacreBLEU's
metrics in either dialect, printed with 4 decimals unless ``-w`` says otherwise. Several systems are scored
together with them alone (no ``--paired-bs``), each model loaded once and the sources and references embedded
once; CometKiwi alone needs no references.
"""

from __future__ import annotations

import contextlib
import io
import json
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mtkit.config import ConfigError
from mtkit.data.parallel import DataError, iter_stream_lines, read_lines, reading
from mtkit.scoring.comet_names import SCORE_NAMES
from mtkit.scoring.learned_metrics import (
    DECIMALS,
    CometSettings,
    as_score,
    as_sentence_scores,
    check_names,
    learned_scores,
)
from mtkit.scoring.learned_metrics import paired_bootstrap as paired_segment_bootstrap
from mtkit.scoring.metrics import (
    COMET_METRICS,
    DEFAULT_METRICS,
    EVAL_METRICS,
    METRICS,
    SACREBLEU_DEFAULT_METRICS,
    Options,
    PairedResult,
    Score,
    SentenceScores,
    SystemResult,
    corpus_scores,
    paired_bootstrap,
    reference_files,
    sentence_scores,
)

FORMATS = ("json", "text", "latex")
STDIN = "<stdin>"


@dataclass(frozen=True)
class Request:
    """One ``mtkit eval`` command line, as parsed (its defaults are the command's); None and empty values leave the
    choice to the dialect."""

    hyps: tuple[Path, ...]  # --hyp: mtkit's dialect
    inputs: tuple[Path, ...]  # -i; without it or --hyp the systems are stdin's tab-separated columns
    refs: tuple[Path, ...]
    test_set: str | None
    langpair: str | None
    metrics: tuple[str, ...]  # as typed: names, or comma-separated lists of them
    tokenize: str | None
    lowercase: bool
    chrf_lowercase: bool
    chrf_word_order: int
    ter_case_sensitive: bool
    sentence: bool
    paper_style: bool
    paired_bs: bool
    paired_bs_n: int
    paired_bs_seed: int | None
    width: int | None  # decimals printed
    score_only: bool
    format: str | None  # one of FORMATS
    src: Path | None = None  # the source file, which COMET and CometKiwi read
    comet: CometSettings = CometSettings()

    @property
    def sacrebleu_style(self) -> bool:
        return not self.hyps


@dataclass(frozen=True)
class Report:
    stdout: str
    stderr: str = ""  # the signatures beside mtkit's per-segment table


def score_request(request: Request, stdin: TextIO | None) -> Report:
    """Score the request's systems against its references and render them in its dialect and format."""
    names = _check(request)
    sacrebleu_names = tuple(name for name in names if name in METRICS)
    ref_paths = reference_files(request.test_set, request.langpair) if request.test_set else list(request.refs)
    refs = [_read(path) for path in ref_paths]
    labelled = [(str(path), _read(path)) for path in request.hyps or request.inputs] or _stdin_systems(stdin)
    sources = _sources(request, names)
    sacrebleu_asked = bool(sacrebleu_names) or request.paper_style
    _check_systems(request, sacrebleu_asked, labelled, ref_paths, refs, sources)
    names_shown = _system_names(request, [label for label, _ in labelled])
    systems = [(name, lines) for name, (_, lines) in zip(names_shown, labelled)]
    options, paper_style = _options(request), request.paper_style
    hypotheses = [lines for _, lines in systems]
    learned = learned_scores(names, sources, hypotheses, refs, request.comet) if sources is not None else {}
    if request.paired_bs:
        seed, n = request.paired_bs_seed, request.paired_bs_n
        results = (
            paired_bootstrap(systems, refs, sacrebleu_names, options, paper_style, n, seed) if sacrebleu_asked else []
        )
        results += [paired_segment_bootstrap(list(zip(names_shown, r)), n, seed) for r in learned.values()]
        return Report(_render_paired(results, request))
    if len(systems) > 1:  # COMET's alone
        per_system = [[as_score(result) for result in results] for results in zip(*learned.values())]
        return Report(_render_systems(names_shown, per_system, request))
    hyps = systems[0][1]
    if request.sentence:
        per_metric = sentence_scores(hyps, refs, sacrebleu_names, options, paper_style) if sacrebleu_asked else []
        return _render_sentences(per_metric + [as_sentence_scores(rs[0]) for rs in learned.values()], request)
    scores = corpus_scores(hyps, refs, sacrebleu_names, options, paper_style) if sacrebleu_asked else []
    return Report(_render_scores(scores + [as_score(rs[0]) for rs in learned.values()], request))


def _check(request: Request) -> tuple[str, ...]:
    """The metric names to compute, once the request's options are known to fit together."""
    if request.hyps and request.inputs:
        raise ConfigError("give the hypothesis as --hyp FILE or as -i FILE (sacreBLEU's spelling), not both")
    if request.format is not None and request.format not in FORMATS:
        raise ConfigError(f"--format takes {', '.join(FORMATS)}; got {request.format!r}")
    if request.format == "latex" and not request.sacrebleu_style:
        raise ConfigError("-f latex is sacreBLEU's table of -i systems with --paired-bs; with --hyp use text or json")
    names = _metric_names(request)
    reference_free = set(names) == {"cometkiwi"} and not request.paper_style  # CometKiwi alone
    if request.refs and request.test_set or not (request.refs or request.test_set or reference_free):
        raise ConfigError("give references as files (REF... or --ref FILE) or as --test-set NAME -l SRC-TGT, not both")
    if request.langpair is not None and len(request.langpair.split("-")) != 2:
        raise ConfigError(f"--langpair must look like en-de, got {request.langpair!r}")
    if request.test_set and not request.langpair:
        raise ConfigError(f"--test-set needs --langpair, e.g. -t {request.test_set} -l en-de")
    if request.paired_bs and request.sentence:
        raise ConfigError("--paired-bs compares corpus scores: drop --sentence")
    check_names(names, request.comet)
    return names


def _sources(request: Request, names: tuple[str, ...]) -> list[str] | None:
    """The source lines COMET and CometKiwi read; None when no metric asked reads them."""
    learned = [name for name in names if name in COMET_METRICS]
    if not learned:
        return None
    if request.src is None:
        raise ConfigError(f"-m {' '.join(learned)} scores translations of a source: give it as --src FILE")
    return _read(request.src)


def _metric_names(request: Request) -> tuple[str, ...]:
    """Each metric once; sacreBLEU sorts single-system scores by metric and keeps a paired test's in the order given."""
    typed = (m.strip().lower() for item in request.metrics for m in item.split(",") if m.strip())
    names = tuple(dict.fromkeys(typed))
    unknown = [m for m in names if m not in EVAL_METRICS]
    if unknown or (request.metrics and not names):
        raise ConfigError(f"--metrics takes {', '.join(EVAL_METRICS)}; got {', '.join(unknown) or 'nothing'}")
    if not names:
        return SACREBLEU_DEFAULT_METRICS if request.sacrebleu_style else DEFAULT_METRICS
    if request.sacrebleu_style and not request.paired_bs:
        return tuple(sorted(names, key=EVAL_METRICS.index))
    return tuple(sorted(names, key=lambda name: name in COMET_METRICS))  # COMET's after sacreBLEU's, as printed


def _options(request: Request) -> Options:
    """With --hyp, chrF follows --lowercase unless its own flag is given; sacreBLEU sets each alone."""
    own = request.sacrebleu_style
    return Options(
        tokenize=request.tokenize,
        lowercase=request.lowercase,
        trg_lang=request.langpair.split("-")[1] if request.langpair else "",
        chrf_lowercase=request.chrf_lowercase if own else request.chrf_lowercase or None,
        ter_case_sensitive=request.ter_case_sensitive,
        chrf_word_order=request.chrf_word_order,
    )


def _read(path: Path) -> list[str]:
    """A file's lines without trailing whitespace, as the sacrebleu tool reads them."""
    return [line.rstrip() for line in read_lines(path)]


def _stdin_systems(stdin: TextIO | None) -> list[tuple[str, list[str]]]:
    """The systems on standard input, one per tab-separated column, as the sacrebleu tool reads them."""
    if stdin is None:
        raise DataError(f"{STDIN}: standard input is closed; give the hypothesis with -i FILE")
    if stdin.isatty():
        raise ConfigError("no hypothesis: give -i FILE or --hyp FILE, or pipe the system output in")
    with reading(STDIN):
        rows = [line.rstrip().split("\t") for line in iter_stream_lines(stdin.buffer, STDIN)]
    for number, row in enumerate(rows, start=1):
        if len(row) != len(rows[0]):
            raise DataError(f"{STDIN}:{number}: {len(row)} tab-separated systems, but line 1 has {len(rows[0])}")
    columns = [[field.rstrip() for field in column] for column in zip(*rows)] or [[]]
    label = STDIN if len(columns) == 1 else f"{STDIN} column {{}}"
    return [(label.format(number), column) for number, column in enumerate(columns, start=1)]


def _check_systems(
    request: Request,
    sacrebleu_asked: bool,
    systems: list[tuple[str, list[str]]],
    ref_paths: list[Path],
    refs: list[list[str]],
    sources: list[str] | None,
) -> None:
    """As many systems as the request's mode takes, each with as many lines as every reference and the source."""
    if len(systems) > 1 and not request.paired_bs:
        if sacrebleu_asked:
            raise ConfigError(
                "several systems (--hyp, -i or tab-separated columns on stdin) are compared with --paired-bs "
                "(the first is the baseline), or scored side by side by -m comet or cometkiwi alone"
            )
        if request.sentence:
            raise ConfigError("--sentence scores the segments of one system: give one --hyp or -i file")
    if request.paired_bs and len(systems) < 2:
        raise ConfigError("--paired-bs needs two or more --hyp or -i systems (the baseline first)")
    given = list(zip(map(str, ref_paths), refs))
    if sources is not None:
        given.append((str(request.src), sources))
    for label, lines in systems:
        if not lines:
            raise DataError(f"{label}: empty, nothing to score")
        for path, other in given:
            if len(other) != len(lines):
                raise DataError(f"{label} has {len(lines)} lines but {path} has {len(other)}")


def _system_names(request: Request, labels: list[str]) -> list[str]:
    """Files by their path; in sacreBLEU's paired test the baseline is marked and stdin's columns are numbered."""
    if not (request.sacrebleu_style and request.paired_bs):
        return labels
    if not request.inputs:
        return ["Baseline", *(f"System {number}" for number in range(1, len(labels)))]
    return [f"Baseline: {labels[0]}", *labels[1:]]


def _width(request: Request, default: int | None, name: str = "") -> int | None:
    """The decimals printed of metric ``name``: -w's, else COMET's 4 where a default applies, else ``default``."""
    if request.width is not None:
        return request.width
    return DECIMALS if name in SCORE_NAMES and default is not None else default


def _render_scores(scores: list[Score], request: Request) -> str:
    if request.sacrebleu_style:
        return _sacrebleu_scores(scores, request)
    if request.format == "json":
        if request.score_only:
            return json.dumps(_json_values(scores, request), indent=1)
        return json.dumps(_json_entries(scores, request), indent=1, ensure_ascii=False)
    widths = [_width(request, 2, s.name) for s in scores]
    if request.score_only:
        return "\n".join(f"{s.value:.{width}f}" for s, width in zip(scores, widths))
    return "\n".join(
        f"{_score_text(s.name, s.value, s.verbose, width)}\n  signature: {s.signature}"
        for s, width in zip(scores, widths)
    )


def _json_values(scores: list[Score], request: Request) -> list[float]:
    """mtkit's JSON numbers: at full precision unless -w rounds them."""
    return [s.value if request.width is None else _rounded(s.value, request.width) for s in scores]


def _json_entries(scores: list[Score], request: Request) -> list[dict]:
    return [_json_entry(s, value) for s, value in zip(scores, _json_values(scores, request))]


def _sacrebleu_scores(scores: list[Score], request: Request) -> str:
    """What the sacrebleu tool prints for one system: each score's JSON or line, the lines aligned at their ``=``."""
    widths = [_width(request, 1, s.name) for s in scores]
    as_json = request.format in (None, "json")
    if request.score_only:
        numbers = [f"{s.value:.{width}f}" for s, width in zip(scores, widths)]
        return _sacrebleu_list(numbers) if as_json else "\n".join(numbers)
    if as_json:
        entries = [_json_entry(s, _rounded(s.value, width)) for s, width in zip(scores, widths)]
        return _sacrebleu_list([json.dumps(entry, indent=1, ensure_ascii=False) for entry in entries])
    lines = [_sacrebleu_line(s.name, s.signature, s.value, s.verbose, width) for s, width in zip(scores, widths)]
    align = max(line.index("=") - 1 for line in lines)
    return "\n".join(f"{line[: line.index('=') - 1]:>{align}}{line[line.index('=') - 1 :]}" for line in lines)


def _sacrebleu_list(items: list[str]) -> str:
    """sacreBLEU's JSON list of scores: its items unindented, one alone without brackets."""
    return items[0] if len(items) == 1 else "[\n" + ",\n".join(items) + "\n]"


def _rounded(value: float, width: int) -> float:
    return float(f"{value:.{width}f}")


def _json_entry(s: Score, value: float) -> dict:
    """sacreBLEU's JSON of a score (the signature's fields as keys of their own), and mtkit's ``comparable``."""
    entry: dict = {"name": s.name, "score": value, "signature": s.signature}
    if s.verbose:
        entry["verbose_score"] = s.verbose
    entry.update(field.split(":", 1) for field in s.signature.split("|") if ":" in field)
    return {**entry, "comparable": s.comparable}


def _score_text(name: str, value: float, verbose: str, width: int) -> str:
    return f"{name} = {value:.{width}f}" + (f" {verbose}" if verbose else "")


def _sacrebleu_line(name: str, signature: str, value: float, verbose: str, width: int) -> str:
    return _score_text(f"{name}|{signature}", value, verbose, width)


def _render_sentences(per_metric: list[SentenceScores], request: Request) -> Report:
    """sacreBLEU's line per segment, or mtkit's SEGMENT<TAB>METRIC<TAB>SCORE rows with the signatures on stderr."""
    segments = list(zip(*(zip(s.values, s.verbose) for s in per_metric)))
    if request.sacrebleu_style:
        widths = [_width(request, 1, s.name) for s in per_metric]
        lines = (
            f"{value:.{width}f}" if request.score_only else _sacrebleu_line(s.name, s.signature, value, verbose, width)
            for segment in segments
            for s, width, (value, verbose) in zip(per_metric, widths, segment)
        )
        return Report("\n".join(lines))
    if request.format == "json":
        return Report(json.dumps([s.to_dict() for s in per_metric], indent=1))
    widths = [_width(request, 4, s.name) for s in per_metric]
    rows = (
        f"{number}\t{s.name}\t{value:.{width}f}"
        for number, segment in enumerate(segments, start=1)
        for s, width, (value, _) in zip(per_metric, widths, segment)
    )
    return Report("\n".join(rows), "\n".join(f"{s.name} signature: {s.signature}" for s in per_metric))


def _render_systems(systems: list[str], per_system: list[list[Score]], request: Request) -> str:
    """Several systems' scores side by side (COMET's alone): sacreBLEU's table in its dialect, else a block of
    scores per system, each score with its signature."""
    if request.format in ("text", "latex") and request.sacrebleu_style:
        table: dict = {"System": systems}
        width = _width(request, 1, per_system[0][0].name)  # COMET's alone: one width for the table
        for index, first in enumerate(per_system[0]):
            table[first.name] = [f"{scores[index].value:.{width}f}" for scores in per_system]
        return _sacrebleu_table(table, {s.name: s.signature for s in per_system[0]}, request.format, width, None)
    if request.format in (None, "json") and request.sacrebleu_style:
        rows = [
            {"system": system, **{s.name: {"score": s.value, "signature": s.signature} for s in scores}}
            for system, scores in zip(systems, per_system)
        ]
        return json.dumps(rows, indent=4, ensure_ascii=False)
    if request.format == "json":
        rows = [
            {"system": system, "scores": _json_entries(scores, request)} for system, scores in zip(systems, per_system)
        ]
        return json.dumps(rows, indent=1, ensure_ascii=False)
    return "\n".join(f"{system}\n{_render_scores(scores, request)}" for system, scores in zip(systems, per_system))


def _render_paired(results: list[PairedResult], request: Request) -> str:
    """A paired test's results; sacreBLEU's table has each cell at its metric's width (COMET's 4 beside BLEU's 1),
    so every cell is given as text and every header marked (μ ± 95% CI) here, as sacreBLEU marks those it formats."""
    if not request.sacrebleu_style:
        if request.format == "json":
            return json.dumps([r.to_dict() for r in results], indent=1)
        return "\n".join(_paired_text(r, _width(request, 2, r.name)) for r in results)
    if request.format in (None, "json"):
        return _sacrebleu_paired_json(results)
    table: dict = {"System": [row.system for row in results[0].systems]}
    for r in results:
        width = _width(request, 1, r.name)
        table[f"{r.name} (μ ± 95% CI)"] = [_paired_cell(row, width, request.format) for row in r.systems]
    signatures = {r.name: r.signature for r in results}
    return _sacrebleu_table(table, signatures, request.format, _width(request, 1), request.paired_bs_n)


def _paired_cell(row: SystemResult, width: int, table_format: str) -> str:
    """A paired test's table cell as sacreBLEU writes it."""
    text = f"{row.score:.{width}f} ({row.mean:.{width}f} ± {row.ci:.{width}f})"
    if row.p_value is None:
        return text
    return text + ("\n" if table_format == "text" else " ") + f"(p = {row.p_value:.4f})" + ("*" * (row.p_value <= 0.05))


def _paired_text(result: PairedResult, width: int) -> str:
    """One metric's block: each system's score, (bootstrap mean ± 95% CI) and p-value, then the signature."""
    names = max(len(row.system) for row in result.systems)
    lines = [f"{result.name}: score (bootstrap mean ± 95% CI), p-value against the baseline"]
    for row in result.systems:
        line = f"  {row.system:<{names}}  {row.score:{width + 4}.{width}f} ({row.mean:.{width}f} ± {row.ci:.{width}f})"
        if row.p_value is None:
            lines.append(line + "  baseline")
        else:
            lines.append(line + f"  p = {row.p_value:.4f}" + ("*" if row.p_value < 0.05 else ""))
    return "\n".join([*lines, f"  signature: {result.signature}"])


def _sacrebleu_paired_json(results: list[PairedResult]) -> str:
    """The sacrebleu tool's JSON of a paired test: per system, each metric's numbers (here with ``comparable``)."""
    rows = []
    for index, system in enumerate(results[0].systems):
        row: dict = {"system": system.system}
        for result in results:
            r = result.systems[index]
            row[result.name] = {"score": r.score, "p_value": r.p_value, "mean": r.mean, "ci": r.ci}
            row[result.name]["comparable"] = result.comparable
        rows.append(row)
    return json.dumps(rows, indent=4)


def _sacrebleu_table(table: dict, signatures: dict, table_format: str, width: int, paired_n: int | None) -> str:
    """The sacrebleu tool's table of several systems (``paired_n``: of a paired test), printed by its own code, so
    it stays the same line for line; cells given as text keep their own decimals."""
    from sacrebleu.utils import Color, print_results_table

    paired = paired_n is not None
    args = Namespace(
        format=table_format, width=width, paired_bs=paired, paired_ar=False, paired_bs_n=paired_n, paired_ar_n=0
    )
    out, colors = io.StringIO(), Color.ENABLE_COLORS
    Color.ENABLE_COLORS = False  # as the sacrebleu tool prints into a pipe
    try:
        with contextlib.redirect_stdout(out):
            print_results_table(table, signatures, args)
    finally:
        Color.ENABLE_COLORS = colors
    return out.getvalue().rstrip("\n")
