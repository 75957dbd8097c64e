"""The ``mtkit`` command line: each command parses, calls one library function and renders.

Data goes to stdout, chatter to stderr. A problem with the user's input (file, config, checkpoint)
is one line on stderr and exit status 1; anything else is a bug and keeps its traceback.
Torch is imported inside commands so that ``mtkit --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from mtkit import __version__
from mtkit.config import Precision, SpmType
from mtkit.errors import MtkitError

# The base class of Click's usage errors: typer's own copy of Click, or Click itself for older typer.
_CLICK_ERROR = getattr(typer, "TyperException", None) or __import__("click").ClickException


class _OneLineErrors(TyperGroup):
    """Usage errors (``--beam abc``, a missing option) as one ``error:`` line, as every other error is."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _CLICK_ERROR as err:
            message = err.format_message()
            if "\n" in message.strip():  # the help text a bare command prints (no_args_is_help)
                err.show()
            else:
                ctx = getattr(err, "ctx", None)
                where = f"{ctx.command_path}: " if ctx is not None else ""
                hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
                typer.echo(f"error: {where}{message}{hint}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:  # an EOFError no command turned into an error of its own
            typer.echo("error: input ended unexpectedly", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    help="mtkit: train, run and score Transformer machine-translation models.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=True,
)
tokenizer_app = typer.Typer(help="Train SentencePiece tokenizer models.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")

stderr = Console(stderr=True)
log = logging.getLogger("mtkit")


def user_errors(command):
    """Turn mtkit's errors (``MtkitError``: input, settings, machine) and the file system's (a full disk, a
    denied permission) into one line and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
            with contextlib.suppress(AttributeError, OSError, ValueError):  # a stand-in stdout has no descriptor
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
            raise typer.Exit(1) from None
        except OSError as err:
            from mtkit.files import os_error_line

            _error_line(os_error_line(err))
        except MtkitError as err:
            _error_line(str(err))

    return wrapper


MAX_ERROR_CHARS = 2_000  # an error quoting an untrusted value never floods the terminal


def _error_line(message: str) -> None:
    """Print ``error: MESSAGE`` as one line, cut short if it is huge, and exit with status 1.

    Under torchrun only rank 0 prints: the ranks read the same inputs, so they fail alike.
    """
    if os.environ.get("RANK", "0") != "0":
        raise typer.Exit(1)
    line = " ".join(message.splitlines())  # \r, U+2028 and the like too: one line, whatever it quotes
    if len(line) > MAX_ERROR_CHARS:
        line = line[:MAX_ERROR_CHARS] + f"... ({len(line) - MAX_ERROR_CHARS:,} more characters)"
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(1) from None


def _setup_logging(quiet: bool = False) -> None:
    """One handler on the current stderr (an earlier in-process call may have left one on a closed stream)."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
    if stderr.is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=stderr, show_path=False, show_time=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(max(_LOG_LEVEL["level"], logging.WARNING) if quiet else _LOG_LEVEL["level"])
    log.propagate = False


def examples(*lines: str) -> str:
    """A command's --help epilog: one example command per line."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in lines)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtkit {__version__}")
        raise typer.Exit()


LogLevel = Literal["debug", "info", "warning", "error"]
_LOG_LEVEL = {"level": logging.INFO}  # set by the global options, read by every command's logging set-up


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only warnings and errors on stderr.")] = False,
    log_level: Annotated[LogLevel, typer.Option(help="How much to log on stderr.")] = "info",
) -> None:
    """mtkit: train, run and score Transformer machine-translation models."""
    _LOG_LEVEL["level"] = logging.WARNING if quiet else getattr(logging, log_level.upper())


# -- tokenizer ------------------------------------------------------------------------------


@tokenizer_app.command(
    "train",
    epilog=examples(
        "mtkit tokenizer train --src train.en --tgt train.de -o tok/ --vocab-size 8000",
        "mtkit tokenizer train --src train.en --tgt train.de -o tok/ --separate --type bpe",
    ),
)
@user_errors
def tokenizer_train_command(
    src: Annotated[Path, typer.Option(help="Source-side training text (plain or .gz).")],
    out_dir: Annotated[
        Path, typer.Option("--output", "-o", "--out-dir", help="Folder for spm.model (joint) or spm.src/tgt.model.")
    ],
    tgt: Annotated[Path | None, typer.Option(help="Target-side training text; omit for one monolingual model.")] = None,
    joint: Annotated[
        bool, typer.Option("--joint/--separate", help="One model for both sides, or one per side.")
    ] = True,
    vocab_size: Annotated[int, typer.Option(help="Pieces per model.")] = 8000,
    model_type: Annotated[SpmType, typer.Option("--type", help="SentencePiece model type.")] = "unigram",
    character_coverage: Annotated[float, typer.Option(help="Share of characters covered (0.9995 for CJK).")] = 1.0,
    input_sentence_size: Annotated[int, typer.Option(help="Sentences sampled for training; 0 uses all.")] = 2_000_000,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1, help="Seed for sentence sampling.")] = 1,
) -> None:
    """Train SentencePiece model(s) with mtkit's special ids (pad 0, unk 1, bos 2, eos 3)."""
    from mtkit.config import TokenizerConfig
    from mtkit.data import iter_lines
    from mtkit.tokenizer import train_spm

    options = TokenizerConfig(
        type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        seed=seed,
    )  # checks the values
    _setup_logging()
    # Streamed: SentencePiece keeps its own sample of input_sentence_size sentences.
    if tgt is None or joint:
        sentences = itertools.chain(iter_lines(src), iter_lines(tgt) if tgt else ())
        written = [train_spm(sentences, out_dir / "spm", options, " and ".join(str(p) for p in (src, tgt) if p))]
    else:
        written = [
            train_spm(iter_lines(src), out_dir / "spm.src", options, str(src)),
            train_spm(iter_lines(tgt), out_dir / "spm.tgt", options, str(tgt)),
        ]
    for path in written:
        typer.echo(f"wrote {path} and {path.with_suffix('.vocab')}", err=True)


# -- train ----------------------------------------------------------------------------------


@app.command(
    "prepare",
    epilog=examples(
        "mtkit prepare --list",
        "mtkit prepare multi30k_en_de -o data/m30k --mirror ../shared/data/multi30k",
        "mtkit prepare wmt14_en_de -o data/wmt14",
    ),
)
@user_errors
def prepare_command(
    corpus: Annotated[str | None, typer.Argument(help="A corpus name from --list, e.g. wmt14_en_de.")] = None,
    out: Annotated[Path | None, typer.Option("--output", "-o", "--out", help="Output folder (see below).")] = None,
    mirror: Annotated[
        str | None,
        typer.Option(help="Fetch the corpus files from here instead: a directory, a file:// or an http(s):// base."),
    ] = None,
    nfkc: Annotated[bool, typer.Option(help="Unicode NFKC normalisation of the training split.")] = False,
    dedupe: Annotated[bool, typer.Option(help="Drop repeated training pairs.")] = True,
    min_words: Annotated[int, typer.Option(help="Training pairs need this many words on each side.")] = 1,
    max_words: Annotated[int, typer.Option(help="...and at most this many.")] = 250,
    max_ratio: Annotated[
        float, typer.Option(help="...and at most this ratio of the longer side to the shorter.")
    ] = 3.0,
    list_corpora: Annotated[bool, typer.Option("--list", help="List the corpora and exit.")] = False,
) -> None:
    """Download a standard corpus and write line-aligned plain text: OUT/{train,valid,test}.LANG.

    Downloads resume where they stopped and are checked against their SHA-256 where mtkit knows it;
    they stay in OUT/raw. Only the training split is cleaned (normalised, filtered by length and
    ratio, deduplicated); valid and test are written as published. OUT/prepare.json records what was
    done, and a re-run with the same settings does nothing.
    """
    from mtkit.config import CleanConfig, ConfigError
    from mtkit.corpora import CORPORA
    from mtkit.corpora import corpus as find_corpus
    from mtkit.preparation import prepare_corpus

    _setup_logging()
    if list_corpora:
        for c in CORPORA.values():
            typer.echo(f"{c.name:<16} {c.about}")
        return
    if corpus is None or out is None:
        raise ConfigError("give a corpus and --out, e.g. mtkit prepare multi30k_en_de --out data/multi30k_en_de")
    clean = CleanConfig(nfkc=nfkc, dedupe=dedupe, min_words=min_words, max_words=max_words, max_ratio=max_ratio)
    record = prepare_corpus(find_corpus(corpus), out, mirror, clean)
    counts = ", ".join(f"{name} {split['lines']:,}" for name, split in record["splits"].items())
    typer.echo(f"{corpus} in {out}: {counts} lines")


@app.command(
    "train",
    epilog=examples(
        "mtkit train m30k.yaml -o runs/m30k --set train.lr=0.001 --precision bf16",
        "mtkit train m30k.yaml --dry-run",
        "mtkit train m30k.yaml -o runs/m30k --nproc-per-node 4",
    ),
)
@user_errors
def train_command(
    config: Annotated[Path, typer.Argument(help="YAML config with data, tokenizer, model, train and decode sections.")],
    overrides: Annotated[
        list[str], typer.Option("--set", help="Override a key: --set train.lr=0.001 (repeatable).")
    ] = [],
    out: Annotated[
        Path | None, typer.Option("--output", "-o", "--out", help="Run directory (default: runs/<config name>).")
    ] = None,
    precision: Annotated[Precision | None, typer.Option(help="Sets train.precision (fp16 on GPU only).")] = None,
    save_every: Annotated[int | None, typer.Option(help="Checkpoint every N updates (sets train.save_every).")] = None,
    keep_last: Annotated[
        int | None, typer.Option(help="Checkpoints kept for resuming and averaging; 0 keeps all (train.keep_last).")
    ] = None,
    compile_model: Annotated[
        bool, typer.Option("--compile", help="torch.compile the encoder-decoder (sets train.compile).")
    ] = False,
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard", help="Also write TensorBoard events to RUN_DIR/tensorboard.")
    ] = False,
    nproc_per_node: Annotated[
        int,
        typer.Option(
            "--nproc-per-node",
            help="Start this many training processes on this machine through torch.distributed.run "
            "(one per GPU; gloo on CPU). For several machines call torchrun yourself.",
        ),
    ] = 1,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config, batch and LR schedule; do not train.")
    ] = False,
    restart: Annotated[
        bool, typer.Option("--restart", help="Start over even if the run directory holds a checkpoint.")
    ] = False,
) -> None:
    """Train a Transformer; re-running on the same run directory resumes from its newest checkpoint.

    Under torchrun (torchrun --nproc-per-node N -m mtkit train CONFIG) every process trains on its
    share of each update's batches with DistributedDataParallel; rank 0 validates and writes.
    """
    from mtkit.config import ConfigError, dump, read_config
    from mtkit.distributed import launched_by_torchrun

    flags = {
        "precision": precision,
        "save_every": save_every,
        "keep_last": keep_last,
        "compile": compile_model or None,
        "tensorboard": tensorboard or None,
    }
    overrides = [*overrides, *(f"train.{key}={value}" for key, value in flags.items() if value is not None)]
    cfg = read_config(config, overrides)
    out = out or Path("runs") / config.stem
    if dry_run:
        from mtkit.trainer import schedule_preview

        tc = cfg.train
        typer.echo(dump(cfg), nl=False)
        typer.echo(f"# run directory: {out}")
        typer.echo(
            f"# effective batch: {tc.batch_tokens * tc.accum * nproc_per_node} padded tokens per side per update "
            f"({tc.batch_tokens} x accum {tc.accum} x {nproc_per_node} process(es))"
        )
        typer.echo("# learning rate: " + ", ".join(f"update {s}: {lr:.3g}" for s, lr in schedule_preview(cfg)))
        return
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nproc_per_node > 1 and not launched_by_torchrun():
        from mtkit.trainer import check_trainable

        check_trainable(cfg)  # here, once, rather than in every rank
        command = ["train", str(config), "--out", str(out), *(a for o in overrides for a in ("--set", o))]
        _hand_over_to_torchrun(nproc_per_node, [*command, *(["--restart"] if restart else [])])
        return
    _setup_logging(quiet=int(os.environ.get("RANK", "0")) != 0)
    _run_training(cfg, out, restart)


def _stopped(stop, out: Path) -> typer.Exit:
    """What a training stopped by a signal says, and the exit status it ends with."""
    typer.echo(f"{stop}: last checkpoint saved in {out}; run the same command to resume", err=True)
    return typer.Exit(128 + stop.signum)


def _run_training(cfg, out: Path, restart: bool) -> None:
    from mtkit.distributed import DistributedError, from_environment
    from mtkit.progress import TrainingProgress
    from mtkit.trainer import TrainingStopped, run_training

    dist = from_environment(cfg.train.device, cfg.train.ddp_timeout)
    try:
        result = run_training(cfg, out, TrainingProgress(cfg.train.log_every), restart=restart, dist=dist)
    except TrainingStopped as stop:
        if dist.is_main:
            raise _stopped(stop, out) from None
        raise typer.Exit(128 + stop.signum) from None
    except DistributedError as err:
        if not dist.is_main:  # rank 0 says what failed; a peer that lost it only notes it
            log.warning("%s", err)
            raise typer.Exit(1) from None
        raise
    finally:
        dist.close()
    if dist.is_main:
        if "valid_bleu" in result:
            typer.echo(f"final validation BLEU {result['valid_bleu']:.2f} ({result['bleu_signature']})", err=True)
        typer.echo(f"run directory: {out}", err=True)


def _hand_over_to_torchrun(nproc_per_node: int, command: list[str]) -> None:
    """Run ``mtkit COMMAND`` in ``nproc_per_node`` processes under torch.distributed.run; exit as they did."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from mtkit.distributed import torchrun_arguments

    args = get_args_parser().parse_args(torchrun_arguments(nproc_per_node, command))
    # The launcher's own log of a failed rank repeats what the rank printed and what is said below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as stop:  # torchrun has passed the signal on; the ranks save and exit
        name = signal.Signals(stop.sigval).name
        typer.echo(f"stopped by {name}: the ranks saved a checkpoint; run the same command to resume", err=True)
        raise typer.Exit(128 + stop.sigval) from None
    except ChildFailedError as err:
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        if err.failures.get(0) is None or err.failures[0].exitcode != 1:  # exit 1: rank 0 printed why
            typer.echo(f"error: training processes failed (exit status {', '.join(map(str, codes))})", err=True)
        raise typer.Exit(1 if codes != [codes[0]] or codes[0] < 0 else codes[0]) from None


# -- translate ------------------------------------------------------------------------------


def _given(**options) -> dict:
    """The options the user gave (not None): the others fall back on the model's saved settings."""
    return {name: value for name, value in options.items() if value is not None}


@app.command(
    "translate",
    epilog=examples(
        "mtkit translate runs/m30k -i test.en -o test.hyp.de",
        'echo "A dog runs." | mtkit translate runs/m30k --beam 1',
        "mtkit translate runs/a runs/b -i test.en --nbest 5 --beam 5",
    ),
)
@user_errors
def translate_command(
    model: Annotated[
        list[Path],
        typer.Argument(
            help="Run directory (uses best/), checkpoint directory or .safetensors; several make an ensemble "
            "(their log-probabilities averaged; they must share tokenizers)."
        ),
    ],
    input: Annotated[Path | None, typer.Option("--input", "-i", help="Input text or .gz; - or none for stdin.")] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file, written atomically (default: stdout).")
    ] = None,
    beam: Annotated[int | None, typer.Option(min=1, help="Beam size; 1 is greedy. [default: the model's]")] = None,
    lenpen: Annotated[float | None, typer.Option(help="GNMT length penalty alpha. [default: the model's]")] = None,
    max_len_a: Annotated[
        float | None, typer.Option(help="Output length cap: a * source length + b. [default: the model's]")
    ] = None,
    max_len_b: Annotated[
        int | None, typer.Option(min=1, help="Output length cap: a * source length + b. [default: the model's]")
    ] = None,
    min_len: Annotated[
        int | None,
        typer.Option(min=0, help="No end of sentence before this many output tokens. [default: the model's]"),
    ] = None,
    early_stop: Annotated[
        bool | None,
        typer.Option(
            "--early-stop/--no-early-stop",
            help="Stop a sentence once its best-ranked candidate has ended (as OpenNMT-py and CTranslate2 do); "
            "--no-early-stop searches on until --beam hypotheses have ended (as fairseq does). [default: the model's]",
            show_default=False,
        ),
    ] = None,
    nbest: Annotated[
        int,
        typer.Option(
            min=1,
            help="Print up to N best per input line as 'LINE ||| TRANSLATION ||| SCORE ||| LOGPROB' "
            "(LINE from 0; SCORE length-normalised; an empty input line gives one empty entry). "
            "With --sample: N independent samples, best score first (they may repeat).",
        ),
    ] = 1,
    scores: Annotated[
        bool, typer.Option("--scores", help="Print 'LOGPROB<tab>TRANSLATION': the output's log-probability.")
    ] = False,
    alignments: Annotated[
        bool,
        typer.Option(
            "--alignments",
            help="Append ' ||| i-j ...' to each translation: source word i aligned to target word j "
            "(Pharaoh format, from 0), read from the cross-attention.",
        ),
    ] = False,
    prefix: Annotated[
        Path | None,
        typer.Option(help="Target prefixes, one per input line ('' for none): each translation starts with its own."),
    ] = None,
    sample: Annotated[
        bool, typer.Option("--sample", help="Draw each token at random instead of searching (back-translation).")
    ] = False,
    temperature: Annotated[float, typer.Option(help="With --sample: < 1 sharpens, > 1 flattens.")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="With --sample: only the k most probable tokens; 0 for all.")] = 0,
    top_p: Annotated[float, typer.Option(help="With --sample: the smallest set holding this probability.")] = 1.0,
    seed: Annotated[int, typer.Option(min=0, max=2**64 - 1, help="With --sample: random seed.")] = 1,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="At most this many sentences per batch. [default: the model's]")
    ] = None,
    batch_tokens: Annotated[
        int | None,
        typer.Option(
            min=1, help="At most this many padded source tokens per batch, times the beam. [default: the model's]"
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    precision: Annotated[Precision, typer.Option(help="Number format of the weights (fp16 on GPU only).")] = "fp32",
    engine: Annotated[
        Literal["mtkit", "ctranslate2"],
        typer.Option(
            help="mtkit, or ctranslate2 for a model made by `mtkit export` (MODEL is its folder; "
            "fp32 keeps the export's own weight type, e.g. int8)."
        ),
    ] = "mtkit",
) -> None:
    """Translate one sentence per line, streaming: one output line for every input line, in order.

    Decoding follows the settings saved with the model (its recipe's decode section) unless an
    option here says otherwise. Input is read and translated in chunks of 10,000 lines, so memory
    stays bounded and output appears as each chunk is done. Lines longer than the model's positions
    are truncated (with a warning), never split.
    """
    from mtkit.config import ConfigError
    from mtkit.lines import Interrupted, translate_file
    from mtkit.search import Sampling

    _setup_logging()
    if alignments and nbest > 1:
        raise ConfigError("--alignments goes with the best translation only, not with --nbest")
    decode = _given(
        beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
        early_stop=early_stop, batch_size=batch_size, batch_tokens=batch_tokens,
    )  # fmt: skip
    if sample and (not (0 < temperature < math.inf) or not 0 < top_p <= 1):
        raise ConfigError("--temperature must be a finite number > 0 and --top-p in (0, 1]")
    sampling = Sampling(temperature, top_k, top_p) if sample else None
    try:
        translate_file(
            model, input, output, prefix, nbest=nbest, scores=scores, alignments=alignments, sampling=sampling,
            seed=seed, device=device, precision=precision, engine=engine, **decode,
        )  # fmt: skip
    except Interrupted as stop:
        kept = f": they are in {stop.partial}, and {output} is not written" if stop.partial else ""
        typer.echo(f"stopped by {stop.name} after {stop.done:,} complete lines{kept}", err=True)
        raise typer.Exit(128 + stop.signum) from None


@app.command(
    "run",
    epilog=examples(
        "mtkit run recipes/multi30k_en_de.yaml -o runs/m30k --mirror ../shared/data/multi30k",
        "mtkit run recipes/multi30k_en_de.yaml -o runs/m30k --set decode.beam=4",
    ),
)
@user_errors
def run_command(
    recipe: Annotated[
        Path, typer.Argument(help="A recipe: a config with a recipe section, e.g. recipes/multi30k_en_de.yaml.")
    ],
    out: Annotated[
        Path | None, typer.Option("--output", "-o", "--out", help="Run directory (default runs/<recipe name>).")
    ] = None,
    mirror: Annotated[
        str | None, typer.Option(help="Fetch the corpus from here (a folder, file:// or http(s):// base).")
    ] = None,
    overrides: Annotated[list[str], typer.Option("--set", help="Override a config value: section.key=value.")] = [],
) -> None:
    """Run a recipe end to end: prepare the corpus, train, average checkpoints, translate the test set,
    score it, and write RUN/report.md and RUN/report.json (and RUN/curves.png with matplotlib).

    Re-running redoes only what is missing or out of date: training resumes from its newest checkpoint.
    The report says whether the test BLEU falls in the recipe's expected range (recipe.bleu_min/max).
    """
    from mtkit.config import read_config
    from mtkit.progress import TrainingProgress
    from mtkit.run import render_report
    from mtkit.run import run_recipe as run_all
    from mtkit.trainer import TrainingStopped

    _setup_logging()
    cfg = read_config(recipe, overrides)
    out = out or Path("runs") / recipe.stem
    try:
        report = run_all(cfg, recipe, out, mirror, TrainingProgress(cfg.train.log_every))
    except TrainingStopped as stop:
        raise _stopped(stop, out) from None
    typer.echo(render_report(report))
    typer.echo(f"report: {out / 'report.md'}", err=True)


# -- eval -----------------------------------------------------------------------------------


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


@app.command(
    "eval",
    cls=_EvalCommand,
    epilog=examples(
        "mtkit eval test.de -i test.hyp.de -m bleu chrf ter",
        "mtkit eval --hyp test.hyp.de --ref test.de --metrics bleu chrf",
        "mtkit eval test.de -i base.de new.de --paired-bs",
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
            help="bleu, chrf, chrf++, ter: -m bleu chrf ter, or bleu,chrf (default: bleu chrf with --hyp, else bleu).",
        ),
    ] = [],
    tokenize: Annotated[
        str | None,
        typer.Option("--tokenize", "-tok", help="sacreBLEU BLEU tokenizer: 13a (default), intl, zh, char, none, ..."),
    ] = None,
    lowercase: Annotated[
        bool,
        typer.Option("--lowercase/--no-lowercase", "-lc", help="Case-insensitive BLEU; with --hyp chrF and TER too."),
    ] = False,
    chrf_lowercase: Annotated[bool, typer.Option("--chrf-lowercase", help="Case-insensitive chrF.")] = False,
    chrf_word_order: Annotated[
        int, typer.Option("--chrf-word-order", "-cw", min=0, help="Word n-gram order of chrf; 2 makes it chrF++.")
    ] = 0,
    ter_case_sensitive: Annotated[
        bool,
        typer.Option("--ter-case-sensitive", help="Case-sensitive TER (with --hyp it is, unless --lowercase)."),
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
) -> None:
    """Corpus BLEU, chrF, chrF++ and TER through sacreBLEU, each with its signature; takes sacreBLEU's command line.

    With -i FILE or the hypothesis on stdin, defaults and output are the sacrebleu tool's (mtkit eval REF -i HYP
    prints what sacrebleu REF -i HYP prints); with --hyp FILE they are mtkit's. Also per-segment scores
    (--sentence), paired bootstrap resampling of several systems (--paired-bs) and references of standard test
    sets (-t wmt22 -l en-de) from sacreBLEU's cache or download.
    """
    from mtkit.config import ConfigError
    from mtkit.evaluation import Request, score_request

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
    )
    report = score_request(request, sys.stdin)
    if report.stderr:
        typer.echo(report.stderr, err=True)
    typer.echo(report.stdout)


@app.command(
    "average",
    epilog=examples(
        "mtkit average runs/m30k --last 5 -o runs/m30k/avg5.safetensors",
        "mtkit average runs/m30k/checkpoints/update-00002000 runs/m30k/checkpoints/update-00002400 -o avg.safetensors",
    ),
)
@user_errors
def average_command(
    inputs: Annotated[list[Path], typer.Argument(help="One run directory, or two or more checkpoints.")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The averaged .safetensors file; tokenizers are copied beside it.")
    ],
    last: Annotated[
        int | None,
        typer.Option("--last", min=1, help="With a run directory: average its newest K checkpoints (default 5)."),
    ] = None,
) -> None:
    """Average the weights of checkpoints of one model; often scores better than the last one alone."""
    from mtkit.checkpoint import WEIGHTS_FILE, check_output_file, checkpoints_to_average, write_average

    check_output_file(output, inputs=[*inputs, *(path / WEIGHTS_FILE for path in inputs)])
    paths = checkpoints_to_average(inputs, last)
    meta = write_average(paths, output)
    for path in paths:
        typer.echo(f"averaged {path}", err=True)
    typer.echo(f"wrote {output} (the average of {len(paths)} checkpoints, newest update {meta['step']})", err=True)


# -- attention --------------------------------------------------------------------------------


@app.command(
    "attention",
    epilog=examples(
        'mtkit attention runs/m30k --src "A dog runs on the beach." -o attention.png',
        'mtkit attention runs/m30k --src "A dog runs." -o layer1.png --layer 1 --encoder',
    ),
)
@user_errors
def attention_command(
    model: Annotated[Path, typer.Argument(help="Run directory (uses best/), checkpoint directory or .safetensors.")],
    src: Annotated[str, typer.Option("--src", help="The source sentence to translate.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The PNG of heatmaps, written atomically.")],
    layer: Annotated[
        int | None,
        typer.Option(help="Draw only this layer (from 0) and align with it; default: all, align with the penultimate."),
    ] = None,
    encoder: Annotated[bool, typer.Option("--encoder", help="Also draw the encoder self-attention.")] = False,
    beam: Annotated[int | None, typer.Option(min=1, help="Beam size; 1 is greedy. [default: the model's]")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
) -> None:
    """Translate one sentence and draw its attention as heatmaps, one per layer and head.

    Prints the translation, then its word alignment in Pharaoh format ('i-j': source word i, target
    word j, from 0), taken from the head-averaged cross-attention. Needs matplotlib.
    """
    from mtkit.alignment import alignment_line, plot_attention, translate_with_attention, word_alignment
    from mtkit.checkpoint import check_output_file, load_for_inference
    from mtkit.runtime import pick_device, require
    from mtkit.translate import with_overrides

    _setup_logging()
    require("matplotlib", "drawing attention", "matplotlib")
    check_output_file(output)
    bundle = load_for_inference(model, pick_device(device))
    decode = with_overrides(bundle.cfg.decode, _given(beam=beam))
    result = translate_with_attention(bundle.model, bundle.src_tok, bundle.tgt_tok, src, decode)
    plot_attention(result.maps, result.src_pieces, result.tgt_pieces, output, layer, encoder)
    typer.echo(result.translation)
    typer.echo(alignment_line(word_alignment(result.src_pieces, result.tgt_pieces, result.maps.cross, layer)))
    typer.echo(f"wrote {output}", err=True)


@app.command(
    "export",
    epilog=examples(
        "mtkit export runs/m30k -o m30k-ct2",
        "mtkit export runs/m30k -o m30k-ct2-int8 --quantization int8",
    ),
)
@user_errors
def export_command(
    model: Annotated[Path, typer.Argument(help="Run directory (uses best/), checkpoint directory or .safetensors.")],
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="Folder to write; an earlier export there is replaced, nothing else is."),
    ],
    fmt: Annotated[Literal["ctranslate2"], typer.Option("--format", help="Target runtime.")] = "ctranslate2",
    quantization: Annotated[
        str | None,
        typer.Option(help="Stored weight type: int8, int8_float16, int16, float16, bfloat16, float32 (default)..."),
    ] = None,
) -> None:
    """Convert a trained model for the CTranslate2 runtime; its tokenizers and decode settings go with it."""
    from mtkit.export import export_ctranslate2

    written = export_ctranslate2(model, output, quantization)
    typer.echo(f"wrote {written} (CTranslate2, {quantization or 'float32'} weights)", err=True)


# -- doctor ---------------------------------------------------------------------------------


@app.command("doctor", epilog=examples("mtkit doctor", "mtkit doctor --path runs/ --json"))
def doctor_command(
    path: Annotated[Path, typer.Option("--path", help="Where runs will be written (for free disk).")] = Path("."),
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """What a run will use here: torch, CUDA/NCCL, GPUs, bf16/fp16 support, threads, memory, disk."""
    from mtkit.runtime import environment_report

    report = environment_report(path)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in report["gpus"]) or "none"
    backends = ", ".join(name for name, ok in report["distributed_backends"].items() if ok) or "none"
    rows = [
        ("torch", f"{report['torch']} (CUDA {report['cuda_version'] or 'not built'})"),
        ("CPU", f"{report['cpu_capability']}, bf16 instructions: {'yes' if report['cpu_bf16_instructions'] else 'no'}"),
        ("threads", str(report["threads"])),
        ("GPUs", gpus),
        ("distributed backends", backends),
        ("precisions", "; ".join(f"{dev}: {', '.join(p) or '-'}" for dev, p in report["precisions"].items())),
        ("memory available", f"{report['memory_available_gib']} GiB"),
        ("disk free", f"{report['disk_free_gib']} GiB at {path.resolve()}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        typer.echo(f"{name:<{width}}  {value}")


def main() -> None:
    app(prog_name="mtkit")


if __name__ == "__main__":
    main()
