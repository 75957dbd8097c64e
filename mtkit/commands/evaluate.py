"""``mtkit eval``: sacreBLEU's metrics with mtkit's defaults, or with sacreBLEU's own command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from mtkit.commands.common import Device, examples, user_errors
from mtkit.scoring.comet_names import MAX_BATCH_SIZE, CometPrecision
from mtkit.scoring.learned_metrics import CometSettings
from mtkit.scoring.metrics import DEFAULT_METRICS, EVAL_METRICS, SACREBLEU_DEFAULT_METRICS

commands = typer.Typer()
MULTI_VALUE_OPTIONS = ("-i", "--input", "-m", "--metrics")  # sacreBLEU's nargs options: -i A B, -m bleu chrf


class _EvalCommand(TyperCommand):
    """Options of MULTI_VALUE_OPTIONS take each word up to the next option, as sacreBLEU's argparse does.

    A Click option takes one value, so each further word gets its option written before it first.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _repeat_multi_value_options(args))


def _repeat_multi_value_options(args: list[str]) -> list[str]:
    """``-m bleu chrf`` as ``-m bleu -m chrf``; a word after any other option, or after ``--``, stays as it is."""
    out: list[str] = []
    option, taken = None, 0
    for index, arg in enumerate(args):
        if arg == "--":
            return out + args[index:]
        if arg.startswith("-") and arg != "-":
            option, taken = (arg if arg in MULTI_VALUE_OPTIONS else None), 0
        elif option is not None:
            out += [option] if taken else []
            taken += 1
        out.append(arg)
    return out


@commands.command(
    "eval",
    cls=_EvalCommand,
    epilog=examples(
        "mtkit eval test.de -i test.hyp.de -m bleu chrf ter",
        "mtkit eval --hyp test.hyp.de --ref test.de --metrics bleu chrf",
        "mtkit eval test.de -i base.de new.de --paired-bs",
        "mtkit eval --hyp test.hyp.de --ref test.de --src test.en -m bleu comet",
        "mtkit eval -i base.de new.de --src test.en -m cometkiwi",
    ),
)
@user_errors
def eval_command(
    ref_files: Annotated[
        list[Path] | None,
        typer.Argument(metavar="REF", help="Reference files, as sacreBLEU takes them (the same as --ref)."),
    ] = None,
    hyp: Annotated[
        list[Path],
        typer.Option(help="System output, with mtkit's defaults and output; repeat with --paired-bs (baseline first)."),
    ] = [],
    inputs: Annotated[
        list[Path],
        typer.Option(
            "--input",
            "-i",
            help="System output(s) with sacreBLEU's defaults and output (default: stdin, one system per column).",
        ),
    ] = [],
    ref: Annotated[list[Path], typer.Option(help="Reference file; repeat for several references.")] = [],
    test_set: Annotated[
        str | None,
        typer.Option("--test-set", "-t", help="A sacreBLEU test set (wmt14, wmt22, ...) as references; needs -l."),
    ] = None,
    langpair: Annotated[
        str | None,
        typer.Option(
            "--langpair",
            "--language-pair",
            "-l",
            help="SRC-TGT; the target language picks BLEU's tokenizer as in sacreBLEU.",
        ),
    ] = None,
    metrics: Annotated[
        list[str],
        typer.Option(
            "--metrics",
            "-m",
            help=f"{', '.join(EVAL_METRICS)}: -m bleu chrf ter, or bleu,chrf (default: {' '.join(DEFAULT_METRICS)} "
            f"with --hyp, else {' '.join(SACREBLEU_DEFAULT_METRICS)}). comet: COMET (Unbabel/wmt22-comet-da, needs "
            "references); cometkiwi: CometKiwi (Unbabel/wmt22-cometkiwi-da, without references); both read --src.",
        ),
    ] = [],
    tokenize: Annotated[
        str | None,
        typer.Option("--tokenize", "-tok", help="sacreBLEU BLEU tokenizer: 13a (default), intl, zh, char, none, ..."),
    ] = None,
    lowercase: Annotated[
        bool,
        typer.Option("--lowercase/--no-lowercase", "-lc", help="Case-insensitive BLEU; with --hyp chrF too."),
    ] = False,
    chrf_lowercase: Annotated[bool, typer.Option("--chrf-lowercase", help="Case-insensitive chrF.")] = False,
    chrf_word_order: Annotated[
        int, typer.Option("--chrf-word-order", "-cw", min=0, help="Word n-gram order of chrf; 2 makes it chrF++.")
    ] = 0,
    ter_case_sensitive: Annotated[
        bool,
        typer.Option("--ter-case-sensitive", help="Case-sensitive TER (by default it ignores case, as sacreBLEU's)."),
    ] = False,
    sentence: Annotated[
        bool, typer.Option("--sentence", "--sentence-level", "-sl", help="A score per segment and metric.")
    ] = False,
    paper_style: Annotated[
        bool,
        typer.Option("--paper-style", help="Also BLEU on 13a-tokenized, lowercased text, labelled as not sacreBLEU."),
    ] = False,
    paired_bs: Annotated[
        bool, typer.Option("--paired-bs", "-pbs", help="Paired bootstrap test of each system against the first one.")
    ] = False,
    paired_bs_n: Annotated[int, typer.Option("--paired-bs-n", "-pbsn", min=1, help="Bootstrap resamples.")] = 1000,
    paired_bs_seed: Annotated[
        int | None,
        typer.Option(
            "--paired-bs-seed", min=1, max=2**32 - 1, help="Resampling seed (default: $SACREBLEU_SEED, else 12345)."
        ),
    ] = None,
    score_only: Annotated[bool, typer.Option("--score-only", "-b", help="Print only the scores.")] = False,
    width: Annotated[
        int | None,
        typer.Option(
            "--width", "-w", min=0, help="Decimals (default: 1 with -i; with --hyp 2, 4 per segment, all in JSON)."
        ),
    ] = None,
    output_format: Annotated[
        str | None,
        typer.Option(
            "--format", "-f", help="json (default with -i) or text (with --hyp); latex: sacreBLEU's --paired-bs table."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The same as --format json.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Accepted as sacreBLEU's; mtkit eval prints no progress messages.")
    ] = False,
    no_color: Annotated[
        bool, typer.Option("--no-color", "-nc", help="Accepted as sacreBLEU's; mtkit eval prints no colours.")
    ] = False,
    src: Annotated[
        Path | None, typer.Option("--src", help="The source the systems translated, line by line: COMET reads it.")
    ] = None,
    comet_model: Annotated[
        str | None,
        typer.Option(
            help="The model of -m comet or cometkiwi: a Hub id, or a folder laid out as a Hub COMET repository "
            "(hparams.yaml, checkpoints/model.ckpt). [default: the metric's Unbabel model]"
        ),
    ] = None,
    comet_revision: Annotated[
        str | None, typer.Option(help="The Hub commit, branch or tag of the COMET model. [default: main]")
    ] = None,
    device: Device = "auto",
    precision: Annotated[
        CometPrecision,
        typer.Option(
            help="COMET's number format: fp32 gives unbabel-comet's scores; bf16, int8 (CPU) and auto (bf16 where "
            "native) are faster and named in the signature."
        ),
    ] = "fp32",
    batch_size: Annotated[int, typer.Option(min=1, max=MAX_BATCH_SIZE, help="Segments COMET scores at once.")] = 16,
) -> None:
    """Corpus BLEU, chrF, chrF++ and TER through sacreBLEU, and COMET, each with its signature; takes sacreBLEU's
    command line.

    With -i FILE or the hypothesis on stdin, defaults and output are the sacrebleu tool's (mtkit eval REF -i HYP
    prints what sacrebleu REF -i HYP prints); with --hyp FILE they are mtkit's. Also per-segment scores
    (--sentence), paired bootstrap resampling of several systems (--paired-bs) and references of standard test
    sets (-t wmt22 -l en-de) from sacreBLEU's cache or download. COMET and CometKiwi (-m comet, -m cometkiwi)
    read the source (--src) as well and can score several systems at once without --paired-bs.
    """
    from mtkit.config import ConfigError
    from mtkit.scoring.evaluation import Request, score_request

    if as_json and output_format not in (None, "json"):
        raise ConfigError(f"--json and --format {output_format} ask for different outputs; give one of them")
    request = Request(
        hyps=tuple(hyp),
        inputs=tuple(inputs),
        refs=(*(ref_files or ()), *ref),
        test_set=test_set,
        langpair=langpair,
        metrics=tuple(metrics),
        tokenize=tokenize,
        lowercase=lowercase,
        chrf_lowercase=chrf_lowercase,
        chrf_word_order=chrf_word_order,
        ter_case_sensitive=ter_case_sensitive,
        sentence=sentence,
        paper_style=paper_style,
        paired_bs=paired_bs,
        paired_bs_n=paired_bs_n,
        paired_bs_seed=paired_bs_seed,
        width=width,
        score_only=score_only,
        format="json" if as_json else output_format,
        src=src,
        comet=CometSettings(comet_model, comet_revision, device, precision, batch_size),
    )
    report = score_request(request, sys.stdin)
    if report.stderr:
        typer.echo(report.stderr, err=True)
    typer.echo(report.stdout)
