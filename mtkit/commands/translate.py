"""``mtkit translate`` and the commands around a trained model: ``average``, ``attention``, ``export``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from mtkit.commands.common import (
    Beam,
    CpuThreads,
    Device,
    EngineChoice,
    ModelPath,
    WeightPrecision,
    examples,
    given,
    setup_logging,
    user_errors,
)
from mtkit.config import (
    MAX_PER_SOURCE,
    InferenceConfig,
    LengthPenalty,
    RecipeConfig,
    SamplingConfig,
    ShortlistConfig,
)

commands = typer.Typer()
import_commands = typer.Typer(help="Bring models trained by other toolkits into mtkit.", no_args_is_help=True)


@commands.command(
    "translate",
    epilog=examples(
        "mtkit translate runs/m30k -i test.en -o test.hyp.de",
        'echo "A dog runs." | mtkit translate runs/m30k --beam 1',
        "mtkit translate runs/a runs/b -i test.en --nbest 5 --beam 5",
        "mtkit translate runs/m30k_en_xx --tgt-lang fr -i test.en -o test.hyp.fr",
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
    input: Annotated[Path, typer.Option("--input", "-i", help="Input text or .gz; - or none for stdin.")] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file, written atomically (default: stdout).")
    ] = None,
    beam: Beam = None,
    lenpen: Annotated[
        float | None, typer.Option(help="Length penalty alpha; 0 for none. [default: the model's]")
    ] = None,
    length_penalty: Annotated[
        LengthPenalty | None,
        typer.Option(
            help="How scores are divided by length L: gnmt, by ((5 + L) / 6)^alpha; power, by L^alpha, as "
            "transformers, CTranslate2, fairseq and Marian do. [default: the model's]",
            show_default=False,
        ),
    ] = None,
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
    temperature: Annotated[
        float, typer.Option(help="With --sample: < 1 sharpens, > 1 flattens.")
    ] = SamplingConfig.temperature,
    top_k: Annotated[
        int, typer.Option(min=0, help="With --sample: only the k most probable tokens; 0 for all.")
    ] = SamplingConfig.top_k,
    top_p: Annotated[
        float, typer.Option(help="With --sample: the smallest set holding this probability.")
    ] = SamplingConfig.top_p,
    seed: Annotated[int, typer.Option(min=0, max=2**64 - 1, help="With --sample: random seed.")] = SamplingConfig.seed,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="At most this many sentences per batch. [default: the model's]")
    ] = None,
    batch_tokens: Annotated[
        int | None,
        typer.Option(
            min=1, help="At most this many padded source tokens per batch, times the beam. [default: the model's]"
        ),
    ] = None,
    shortlist: Annotated[
        Path | None,
        typer.Option(
            help="A vocabulary shortlist (`mtkit shortlist`): each batch chooses among its source tokens' "
            "candidates only. Faster in fp32 and in beam search; outputs can change."
        ),
    ] = None,
    tgt_lang: Annotated[
        str | None,
        typer.Option(
            "--tgt-lang",
            help="The language to translate into, for a model trained on several target languages (its tag goes "
            "before each source); a model of one needs none.",
        ),
    ] = None,
    device: Device = InferenceConfig.device,
    precision: WeightPrecision = InferenceConfig.precision,
    engine: EngineChoice = InferenceConfig.engine,
    threads: CpuThreads = InferenceConfig.threads,
) -> None:
    """Translate one sentence per line, streaming: one output line for every input line, in order.

    Decoding follows the settings saved with the model (its recipe's decode section) unless an
    option here says otherwise. Input is read and translated in chunks of 10,000 lines, so memory
    stays bounded and output appears as each chunk is done. Lines longer than the model's positions
    are truncated (with a warning), never split.
    """
    from mtkit.config import ConfigError
    from mtkit.translation.lines import Interrupted, translate_file

    setup_logging()
    if alignments and nbest > 1:
        raise ConfigError("--alignments goes with the best translation only, not with --nbest")
    decode = given(
        beam=beam, lenpen=lenpen, length_penalty=length_penalty, max_len_a=max_len_a, max_len_b=max_len_b,
        min_len=min_len, early_stop=early_stop, batch_size=batch_size, batch_tokens=batch_tokens,
    )  # fmt: skip
    sampling = SamplingConfig(temperature, top_k, top_p, seed) if sample else None
    try:
        translate_file(
            model, input, output, prefix, nbest=nbest, scores=scores, alignments=alignments, sampling=sampling,
            device=device, precision=precision, engine=engine, shortlist=shortlist, tgt_lang=tgt_lang,
            threads=threads, **decode,
        )  # fmt: skip
    except Interrupted as stop:
        kept = f": they are in {stop.partial}, and {output} is not written" if stop.partial else ""
        typer.echo(f"stopped by {stop.name} after {stop.done:,} complete lines{kept}", err=True)
        raise typer.Exit(128 + stop.signum) from None


@commands.command(
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
        typer.Option(
            "--last",
            min=1,
            help="With a run directory: average its newest K checkpoints.",
            show_default=str(RecipeConfig.average_last),
        ),
    ] = None,
) -> None:
    """Average the weights of checkpoints of one model; often scores better than the last one alone."""
    from mtkit.files import check_output_file
    from mtkit.model.checkpoint import WEIGHTS_FILE
    from mtkit.model.loading import checkpoints_holding, with_model_files
    from mtkit.training.averaging import checkpoints_to_average, write_average

    sources = with_model_files([*inputs, *(path / WEIGHTS_FILE for path in inputs)])
    check_output_file(output, sources, checkpoints_holding(output))
    paths = checkpoints_to_average(inputs, last)
    meta = write_average(paths, output)
    for path in paths:
        typer.echo(f"averaged {path}", err=True)
    typer.echo(f"wrote {output} (the average of {len(paths)} checkpoints, newest update {meta['step']})", err=True)


@commands.command(
    "attention",
    epilog=examples(
        'mtkit attention runs/m30k --src "A dog runs on the beach." -o attention.png',
        'mtkit attention runs/m30k --src "A dog runs." -o layer1.png --layer 1 --encoder',
    ),
)
@user_errors
def attention_command(
    model: ModelPath,
    src: Annotated[str, typer.Option("--src", help="The source sentence to translate.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The PNG of heatmaps, written atomically.")],
    layer: Annotated[
        int | None,
        typer.Option(help="Draw only this layer (from 0) and align with it; default: all, align with the penultimate."),
    ] = None,
    encoder: Annotated[bool, typer.Option("--encoder", help="Also draw the encoder self-attention.")] = False,
    beam: Beam = None,
    device: Device = InferenceConfig.device,
) -> None:
    """Translate one sentence and draw its attention as heatmaps, one per layer and head.

    Prints the translation, then its word alignment in Pharaoh format ('i-j': source word i, target
    word j, from 0), taken from the head-averaged cross-attention. Needs matplotlib.
    """
    from mtkit.decoding.alignment import alignment_line, plot_attention, translate_with_attention, word_alignment
    from mtkit.decoding.translate import with_overrides
    from mtkit.files import check_output_file
    from mtkit.model.loading import checkpoints_holding, load_for_inference, with_model_files
    from mtkit.runtime import pick_device, require

    setup_logging()
    require("matplotlib", "drawing attention", "matplotlib")
    check_output_file(output, with_model_files([model]), checkpoints_holding(output))
    bundle = load_for_inference(model, pick_device(device))
    decode = with_overrides(bundle.cfg.decode, given(beam=beam))
    result = translate_with_attention(bundle.model, bundle.src_tok, bundle.tgt_tok, src, decode)
    plot_attention(result.maps, result.src_pieces, result.tgt_pieces, output, layer, encoder)
    typer.echo(result.translation)
    typer.echo(alignment_line(word_alignment(result.src_pieces, result.tgt_pieces, result.maps.cross, layer)))
    typer.echo(f"wrote {output}", err=True)


@commands.command(
    "export",
    epilog=examples(
        "mtkit export runs/m30k -o m30k-ct2",
        "mtkit export runs/m30k -o m30k-ct2-int8 --quantization int8",
        "mtkit export runs/m30k --format hf -o m30k-hf",
    ),
)
@user_errors
def export_command(
    model: ModelPath,
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="Folder to write; an earlier export there is replaced, nothing else is."),
    ],
    fmt: Annotated[
        Literal["ctranslate2", "hf"],
        typer.Option("--format", help="Target runtime: ctranslate2, or hf for transformers' MarianMTModel."),
    ] = "ctranslate2",
    quantization: Annotated[
        str | None,
        typer.Option(help="CTranslate2's stored weight type: int8, int8_float16, int16, float16, bfloat16, float32..."),
    ] = None,
    shortlist: Annotated[
        Path | None,
        typer.Option(
            help="With ctranslate2: a shortlist (`mtkit shortlist`) to store as CTranslate2's vocabulary map "
            "(vmap.txt, for translate_batch(..., use_vmap=True))."
        ),
    ] = None,
) -> None:
    """Convert a trained model for CTranslate2 or transformers; its tokenizers and decode settings go with it."""
    from mtkit.config import ConfigError
    from mtkit.files import check_outside_checkpoints
    from mtkit.interop.ct2_export import export_ctranslate2
    from mtkit.interop.hf_export import export_transformers
    from mtkit.model.loading import checkpoints_holding

    check_outside_checkpoints(output, checkpoints_holding(output))
    if fmt == "hf":
        if quantization is not None:
            raise ConfigError("--quantization is for --format ctranslate2; a transformers export keeps float32 weights")
        if shortlist is not None:
            raise ConfigError(
                "--shortlist is for --format ctranslate2; a transformers export keeps the whole vocabulary"
            )
        written, kind = export_transformers(model, output), "transformers MarianMTModel, float32"
    else:
        written = export_ctranslate2(model, output, quantization, shortlist)
        kind = f"CTranslate2, {quantization or 'float32'}" + (", a vocabulary map" if shortlist else "")
    typer.echo(f"wrote {written} ({kind} weights)", err=True)


@import_commands.command(
    "hf",
    epilog=examples(
        "mtkit import hf Helsinki-NLP/opus-mt-en-de -o opus-en-de",
        "mtkit import hf Helsinki-NLP/opus-mt-en-de --revision main -o opus-en-de",
        "mtkit import hf ./my-marian-folder --src-lang en --tgt-lang de -o my-model",
        "mtkit translate opus-en-de --precision fp32 -i test.en -o test.de",
    ),
)
@user_errors
def import_hf_command(
    source: Annotated[
        str,
        typer.Argument(
            help="A transformers MarianMTModel folder (save_pretrained's layout), or a Hugging Face Hub repository "
            "id such as Helsinki-NLP/opus-mt-en-de, downloaded into the Hugging Face cache."
        ),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The mtkit model folder to write; it must not exist or be empty.")
    ],
    revision: Annotated[
        str | None, typer.Option(help="The Hub revision (branch, tag or commit) to download; default main.")
    ] = None,
    src_lang: Annotated[
        str | None,
        typer.Option(help="The source language code to record; default: the one an OPUS-MT name states, else src."),
    ] = None,
    tgt_lang: Annotated[
        str | None,
        typer.Option(help="The target language code to record; default: the one an OPUS-MT name states, else tgt."),
    ] = None,
) -> None:
    """Import a Marian model (OPUS-MT) as an mtkit model, which translate, eval, serve, export and
    train.init_from take; its tokenizers are rewritten to keep Marian's ids exactly."""
    from mtkit.interop.hf_import import import_marian, tags_note
    from mtkit.model.checkpoint import read_meta

    written = import_marian(source, output, revision, src_lang, tgt_lang)
    meta, cfg = read_meta(written)
    typer.echo(f"wrote {written} ({cfg.data.src_lang}->{cfg.data.tgt_lang})", err=True)
    if "language_tags" in meta["imported"]:
        typer.echo(tags_note(meta["imported"]["language_tags"]), err=True)


@commands.command(
    "shortlist",
    epilog=examples(
        "mtkit shortlist runs/m30k --src train.en --tgt train.de -o runs/m30k/shortlist.safetensors",
        "mtkit translate runs/m30k --shortlist runs/m30k/shortlist.safetensors -i test.en",
        "mtkit shortlist runs/wmt --src train.en --tgt train.de --per-source 20 -o wmt.shortlist.safetensors",
    ),
)
@user_errors
def shortlist_command(
    model: ModelPath,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The shortlist file (.safetensors), written atomically.")
    ],
    src: Annotated[
        Path | None,
        typer.Option(help="Training source text, or a .tsv of both sides. Required.", show_default=False),
    ] = None,
    tgt: Annotated[
        Path | None,
        typer.Option(help="Training target text, line-aligned. Required unless --src is a .tsv.", show_default=False),
    ] = None,
    per_source: Annotated[
        int, typer.Option(min=1, max=MAX_PER_SOURCE, help="Candidates per source token.")
    ] = ShortlistConfig.per_source,
    frequent: Annotated[
        int, typer.Option(min=0, help="Most frequent target tokens, candidates for every batch.")
    ] = ShortlistConfig.frequent,
    pairs: Annotated[int, typer.Option(min=1, help="Training pairs read (the first N).")] = ShortlistConfig.pairs,
) -> None:
    """Build a vocabulary shortlist from training pairs, for `translate --shortlist` and `export --shortlist`.

    Each source token keeps the target tokens that co-occur with it most strongly in the training
    pairs (Dice coefficient over sentences); the most frequent target tokens and the special ids are
    always candidates. The file is tied to the model's tokenizers. The training pairs are always named
    here: the paths in a checkpoint's header are never opened, as a downloaded one could name any file.
    """
    import torch

    from mtkit.config import ConfigError
    from mtkit.data.parallel import check_input_file, is_tsv, iter_parallel
    from mtkit.decoding import shortlist as lexical
    from mtkit.files import check_output_file
    from mtkit.model.loading import checkpoints_holding, load_for_inference, with_model_files

    setup_logging()
    if src is None:
        raise ConfigError(f"give the training pairs with --src and --tgt (or a .tsv with --src){_trained_on(model)}")
    if tgt is None and not is_tsv(src):
        raise ConfigError(f"{src}: give the target side with --tgt, or a .tsv of both sides")
    for path in (src, tgt):
        if path is not None:
            check_input_file(path)
    inputs = with_model_files(p for p in (src, tgt, model) if p is not None)
    check_output_file(output, inputs, checkpoints_holding(output))
    bundle = load_for_inference(model, torch.device("cpu"))
    chunks = lexical.co_occurring_pairs(bundle.src_tok, bundle.tgt_tok, iter_parallel(src, tgt), pairs)
    built = lexical.build_shortlist(chunks, bundle.src_tok, bundle.tgt_tok, per_source, frequent)
    built.save(output)
    typer.echo(f"wrote {output} ({per_source} candidates per source token, {built.always.numel()} always)", err=True)


def _trained_on(model: Path) -> str:
    """The training data the model's header names, quoted as a hint only: never opened, as a checkpoint from
    elsewhere could name any file of the user's."""
    from mtkit import untrusted
    from mtkit.errors import MtkitError
    from mtkit.model.checkpoint import read_checkpoint
    from mtkit.model.loading import resolve

    try:
        data = read_checkpoint(resolve(model), with_state=False).cfg.data
    except (MtkitError, OSError):  # the missing option is the error to report
        return ""
    sides = (("data.train_src", data.train_src), ("data.train_tgt", data.train_tgt))
    named = [f"{name} {untrusted.shown_path(value)}" for name, value in sides if value]
    if not named:
        return ""
    return f"; the model was trained on {' and '.join(named)} (not opened: pass them if they are yours)"
