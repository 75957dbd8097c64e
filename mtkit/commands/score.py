"""``mtkit score``: how probable a model finds given translations, one line of scores for every pair of lines."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mtkit.commands.common import (
    CpuThreads,
    Device,
    EngineChoice,
    WeightPrecision,
    examples,
    given,
    setup_logging,
    user_errors,
)
from mtkit.config import Engine, InferenceConfig, InferencePrecision

if TYPE_CHECKING:
    from mtkit.decoding.line_translator import PairScore

commands = typer.Typer()


@commands.command(
    "score",
    epilog=examples(
        "mtkit score runs/m30k --src test.en --tgt test.de -o test.scores",
        "mtkit score runs/m30k --src test.en --tgt test.hyp.de --tokens",
        "mtkit score runs/m30k_en_xx --tgt-lang fr --src test.en --tgt test.fr",
        "mtkit score opus-en-de --adapter runs/legal-lora --src test.en --tgt test.de",
    ),
)
@user_errors
def score_command(
    model: Annotated[
        list[Path],
        typer.Argument(
            help="Run directory (uses best/), checkpoint directory or .safetensors; several make an ensemble "
            "(their log-probabilities averaged; they must share tokenizers)."
        ),
    ],
    src: Annotated[Path, typer.Option("--src", help="Source sentences, one per line (text or .gz; - for stdin).")],
    tgt: Annotated[
        Path, typer.Option("--tgt", help="Their translations to score, line by line with --src (- for stdin).")
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file, written atomically (default: stdout).")
    ] = None,
    tokens: Annotated[
        bool,
        typer.Option("--tokens", help="Add a third field: each target token's log-probability, eos last."),
    ] = False,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A LoRA adapter of the model: a LoRA run (its best/), one of its checkpoints, or its adapter file "
            "(model.safetensors there); it must have been trained on this very model. A LoRA run given as the "
            "model needs none: it brings its own.",
            show_default=False,
        ),
    ] = None,
    tgt_lang: Annotated[
        str | None,
        typer.Option(
            "--tgt-lang",
            help="The target language, for a model trained on several target languages (its tag goes before "
            "each source) or one told its languages by tokens (an imported NLLB-200 or M2M100); a model of one needs "
            "none.",
        ),
    ] = None,
    src_lang: Annotated[
        str | None,
        typer.Option(
            "--src-lang",
            help="The source language, for a model told its languages by tokens whose import named no default.",
        ),
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="At most this many pairs per batch. [default: the model's]")
    ] = None,
    batch_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="At most this many padded tokens (of source or target, the longer) per batch. [default: the model's]",
        ),
    ] = None,
    device: Device = InferenceConfig.device,
    precision: WeightPrecision = InferenceConfig.precision,
    engine: EngineChoice = InferenceConfig.engine,
    threads: CpuThreads = InferenceConfig.threads,
) -> None:
    """Score given translations: how probable the model finds each line of --tgt as the translation of --src's.

    Prints 'LOGPROB<tab>TOKENS' for each pair of lines: the log-probability of the target given the source (every
    token and eos, teacher-forced), and how many tokens that is. Every pair gets a line, empty ones too (an empty
    target is eos alone), so the output stays line-aligned with the inputs; lines longer than the model's
    positions are truncated (with a warning). The two files must have the same number of lines.
    """
    from mtkit.translation.lines import Interrupted

    setup_logging()
    try:
        score_files(
            model, src, tgt, output, tokens, tgt_lang, device, precision, engine, threads, src_lang, adapter,
            **given(batch_size=batch_size, batch_tokens=batch_tokens),
        )  # fmt: skip
    except Interrupted as stop:
        kept = f": they are in {stop.partial}, and {output} is not written" if stop.partial else ""
        typer.echo(f"stopped by {stop.name} after {stop.done:,} complete lines{kept}", err=True)
        raise typer.Exit(128 + stop.signum) from None


def score_files(
    models: list[Path],
    src: Path,
    tgt: Path,
    output: Path | None = None,
    tokens: bool = False,
    tgt_lang: str | None = None,
    device: str = InferenceConfig.device,
    precision: InferencePrecision = InferenceConfig.precision,
    engine: Engine = InferenceConfig.engine,
    threads: int = InferenceConfig.threads,
    src_lang: str | None = None,
    adapter: Path | None = None,
    **decode: Any,
) -> int:
    """Score each line of ``tgt`` as the translation of the same line of ``src`` into ``output`` (None for stdout),
    one line per pair (``score_line``); the count. Checked before the model loads as ``mtkit translate`` checks
    (the inputs exist, the output may be written, and two regular files hold as many lines); a file shorter than
    the other is a DataError naming it, and then ``output`` is not written. ``adapter``: a LoRA adapter of the
    model."""
    from mtkit.data.parallel import DataError, check_input_file, count_lines
    from mtkit.decoding.line_translator import CHUNK_LINES, PairMismatch
    from mtkit.files import check_output_file
    from mtkit.model.loading import checkpoints_holding, with_model_files
    from mtkit.progress import StageProgress
    from mtkit.runtime import require
    from mtkit.translation.engines import load_translator
    from mtkit.translation.lines import WholeLines, input_chunks, stdin_or_path, write_lines

    if engine == "ctranslate2":
        require("ctranslate2", "--engine ctranslate2", "ctranslate2")
    src_in, tgt_in = stdin_or_path(src), stdin_or_path(tgt)  # None: standard input
    for path in (src_in, tgt_in):
        if path is not None:
            check_input_file(path, stream_ok=True)
    one_stream = src_in is None and tgt_in is None
    if one_stream or (src_in is not None and not src_in.is_file() and src_in.resolve() == tgt.resolve()):
        raise DataError(f"{src}: --src and --tgt read one stream, whose lines they would take in turns; give a file")
    src_lines, tgt_lines = (count_lines(path) if path is not None else None for path in (src_in, tgt_in))
    if src_lines is not None and tgt_lines is not None and src_lines != tgt_lines:
        shorter, longer = (src, tgt) if src_lines < tgt_lines else (tgt, src)
        raise DataError(f"{shorter}: has no line {min(src_lines, tgt_lines) + 1:,}, which {longer} has")
    if output is None and sys.stdout is None:  # started with stdout closed (>&-)
        raise DataError("<stdout>: standard output is closed; give a file to write with -o")
    if output is not None:
        inputs = [src, tgt, *models, *([adapter] if adapter is not None else [])]
        check_output_file(output, with_model_files(inputs), checkpoints_holding(output))
    with WholeLines() as whole_lines:
        scorer = load_translator(
            models, device, precision, engine, tgt_lang=tgt_lang, threads=threads, src_lang=src_lang,
            adapter=adapter, **decode,
        )  # fmt: skip
        scorer.check_target()
        sources = (line for chunk in input_chunks(src_in, CHUNK_LINES) for line in chunk)
        targets = (line for chunk in input_chunks(tgt_in, CHUNK_LINES) for line in chunk)
        lines = (score_line(score) for score in scorer.score(sources, targets, tokens=tokens))
        to_terminal = output is None and sys.stdout.isatty()
        progress = StageProgress(f"scoring {tgt.name}", None, "lines", log_ends=False, bar=not to_terminal)
        try:
            return write_lines(lines, output, whole_lines, progress)
        except PairMismatch as err:
            shorter, longer = (src, tgt) if err.shorter == "sources" else (tgt, src)
            raise DataError(f"{shorter}: has no line {err.line:,}, which {longer} has") from None


def score_line(score: PairScore) -> str:
    """'LOGPROB<tab>TOKENS', then '<tab>' and each token's log-probability where they were asked for: six decimals,
    finer than the float32 numbers they are sums of."""
    line = f"{score.logprob:.6f}\t{score.tokens}"
    if score.token_logprobs is not None:
        line += "\t" + " ".join(f"{value:.6f}" for value in score.token_logprobs)
    return line + "\n"
