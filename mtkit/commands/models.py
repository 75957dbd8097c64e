"""The commands that make files from a model: ``average`` (one checkpoint from several), ``attention`` (heatmaps of
a translation), ``export`` (a folder for CTranslate2 or transformers), ``shortlist`` (the candidate target tokens of
each source token), and ``import hf``, which makes an mtkit model from another toolkit's (transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from mtkit.commands.common import Beam, Device, ModelPath, examples, given, setup_logging, user_errors
from mtkit.config import MAX_PER_SOURCE, InferenceConfig, RecipeConfig, ShortlistConfig

commands = typer.Typer()
import_commands = typer.Typer(help="Bring models trained by other toolkits into mtkit.", no_args_is_help=True)


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
    from mtkit.config import ConfigError
    from mtkit.data.directions import tags_targets
    from mtkit.decoding.alignment import alignment_line, plot_attention, translate_with_attention, word_alignment
    from mtkit.decoding.line_translator import with_overrides
    from mtkit.files import check_output_file
    from mtkit.model.loading import checkpoints_holding, load_for_inference, with_model_files
    from mtkit.runtime import pick_device, require

    setup_logging()
    require("matplotlib", "drawing attention", "matplotlib")
    check_output_file(output, with_model_files([model]), checkpoints_holding(output))
    bundle = load_for_inference(model, pick_device(device))
    if bundle.cfg.data.languages or tags_targets(bundle.cfg.data):
        raise ConfigError(
            f"{model}: mtkit attention draws a model of one direction, and this one is told its target language by "
            "a tag or token"
        )
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
        "mtkit export nllb-600m --format hf -o nllb-hf",
        "mtkit export opus-en-de --adapter runs/legal-lora -o legal-ct2",
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
        typer.Option(
            "--format",
            help="Target runtime: ctranslate2, or hf for transformers' MarianMTModel (an NLLB-200 or M2M100: "
            "M2M100ForConditionalGeneration).",
        ),
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
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A LoRA adapter of the model (a LoRA run, one of its checkpoints, or its adapter file), merged into "
            "the exported weights. A LoRA run given as the model is merged with its own.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Convert a trained model for CTranslate2 or transformers; its tokenizers and decode settings go with it, and
    a LoRA adapter merged into its weights: the export is an ordinary model of the runtime."""
    from mtkit.config import ConfigError
    from mtkit.files import check_outside_checkpoints
    from mtkit.interop.ct2_export import export_ctranslate2
    from mtkit.interop.hf_export import export_transformers
    from mtkit.interop.m2m100_export import ARCHITECTURE, export_m2m100, told_languages_by_tokens
    from mtkit.model.loading import checkpoints_holding

    check_outside_checkpoints(output, checkpoints_holding(output))
    if fmt == "hf":
        if quantization is not None:
            raise ConfigError("--quantization is for --format ctranslate2; a transformers export keeps float32 weights")
        if shortlist is not None:
            raise ConfigError(
                "--shortlist is for --format ctranslate2; a transformers export keeps the whole vocabulary"
            )
        if told_languages_by_tokens(model):  # an imported NLLB-200 or M2M100, or a model fine-tuned from one
            written, kind = export_m2m100(model, output, adapter), f"transformers {ARCHITECTURE}, float32"
        else:
            written, kind = export_transformers(model, output, adapter), "transformers MarianMTModel, float32"
    else:
        written = export_ctranslate2(model, output, quantization, shortlist, adapter)
        kind = f"CTranslate2, {quantization or 'float32'}" + (", a vocabulary map" if shortlist else "")
    typer.echo(f"wrote {written} ({kind} weights)", err=True)


@import_commands.command(
    "hf",
    epilog=examples(
        "mtkit import hf Helsinki-NLP/opus-mt-en-de -o opus-en-de",
        "mtkit import hf Helsinki-NLP/opus-mt-en-de --revision main -o opus-en-de",
        "mtkit import hf ./my-marian-folder --src-lang en --tgt-lang de -o my-model",
        "mtkit translate opus-en-de --precision fp32 -i test.en -o test.de",
        "mtkit import hf facebook/nllb-200-distilled-600M --src-lang eng_Latn --tgt-lang fra_Latn -o nllb",
        "mtkit import hf facebook/m2m100_418M -o m2m100",
    ),
)
@user_errors
def import_hf_command(
    source: Annotated[
        str,
        typer.Argument(
            help="A transformers MarianMTModel or M2M100ForConditionalGeneration (NLLB-200, M2M100) folder "
            "(save_pretrained's layout), or a Hugging Face Hub repository id such as Helsinki-NLP/opus-mt-en-de or "
            "facebook/nllb-200-distilled-600M, downloaded into the Hugging Face cache."
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
        typer.Option(
            help="The source language code to record; default: the one an OPUS-MT name states, else src. For "
            "NLLB-200 and M2M100, one of the model's languages (eng_Latn, en), the default direction's source."
        ),
    ] = None,
    tgt_lang: Annotated[
        str | None,
        typer.Option(
            help="The target language code to record; default: the one an OPUS-MT name states, else tgt. For "
            "NLLB-200 and M2M100, one of the model's languages, the default direction's target."
        ),
    ] = None,
) -> None:
    """Import a Marian model (OPUS-MT), NLLB-200 or M2M100 as an mtkit model, which translate, eval, serve, export
    and train.init_from take; its tokenizer is rewritten to keep the model's ids exactly."""
    from mtkit.interop.hf_import import import_hf
    from mtkit.interop.marian_languages import tags_note
    from mtkit.model.checkpoint import read_meta

    written = import_hf(source, output, revision, src_lang, tgt_lang)
    meta, cfg = read_meta(written)
    languages = f"{len(cfg.data.languages):,} languages, " if cfg.data.languages else ""
    typer.echo(f"wrote {written} ({languages}{cfg.data.src_lang}->{cfg.data.tgt_lang})", err=True)
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
