"""``mtkit translate``: text in, its translations out, one output line for every input line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtkit.commands.common import (
    Beam,
    CpuThreads,
    Device,
    EngineChoice,
    WeightPrecision,
    examples,
    given,
    setup_logging,
    user_errors,
)
from mtkit.config import InferenceConfig, LengthPenalty, SamplingConfig
from mtkit.translation.reranking import MbrUtility, RerankMethod, RerankSettings

commands = typer.Typer()


@commands.command(
    "translate",
    epilog=examples(
        "mtkit translate runs/m30k -i test.en -o test.hyp.de",
        'echo "A dog runs." | mtkit translate runs/m30k --beam 1',
        "mtkit translate runs/a runs/b -i test.en --nbest 5 --beam 5",
        "mtkit translate runs/m30k_en_xx --tgt-lang fr -i test.en -o test.hyp.fr",
        "mtkit translate runs/en-de -i test.en --rerank channel --reverse-model runs/de-en --channel-weight 0.5",
        "mtkit translate runs/en-de -i test.en --rerank mbr --sample --candidates 16",
        "mtkit translate runs/en-de -i test.en --rerank qe --comet-model cometkiwi",
        "mtkit translate opus-en-de --adapter runs/legal-lora -i test.en -o test.hyp.de",
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
            help="The language to translate into, for a model trained on several target languages (its tag goes "
            "before each source) or one told its languages by tokens (an imported NLLB-200 or M2M100: deu_Latn, "
            "de); a model of one needs none.",
        ),
    ] = None,
    src_lang: Annotated[
        str | None,
        typer.Option(
            "--src-lang",
            help="The language of the input, for a model told its languages by tokens (an imported NLLB-200 or "
            "M2M100: eng_Latn, en) whose import named no default; other models check it against their directions.",
        ),
    ] = None,
    rerank: Annotated[
        RerankMethod | None,
        typer.Option(
            help="Choose each line's translation among --candidates: channel, by log p(y|x) / |y| + "
            "λ log p(x|y) / |x| under --reverse-model (noisy channel, Yee et al., 2019, without its language "
            "model); mbr, by the expected --mbr-utility against the other candidates (minimum Bayes risk); qe, by a "
            "reference-free COMET model's score (quality estimation). One output line per input line, the one "
            "chosen.",
            show_default=False,
        ),
    ] = None,
    candidates: Annotated[
        int,
        typer.Option(
            min=2,
            help="With --rerank: the n best of a beam this wide (unless --beam is wider), or this many --sample "
            "draws (mbr and qe).",
        ),
    ] = RerankSettings.candidates,
    reverse_model: Annotated[
        Path | None,
        typer.Option(help="With --rerank channel: the model of the other direction (target to source)."),
    ] = None,
    channel_weight: Annotated[
        float,
        typer.Option(help="With --rerank channel: λ, the channel's weight; 0 ranks by log p(y|x) / |y| alone."),
    ] = RerankSettings.channel_weight,
    mbr_utility: Annotated[
        MbrUtility,
        typer.Option(help="With --rerank mbr: sacreBLEU's sentence chrF, or COMET (--comet-model) as the utility."),
    ] = RerankSettings.mbr_utility,
    comet_model: Annotated[
        str | None,
        typer.Option(
            help="With --rerank qe (default cometkiwi) or --mbr-utility comet (default comet): a COMET model, by "
            "name, Hub id or local folder (see mtkit eval's COMET); it runs on --device in fp32, whatever "
            "--precision.",
            show_default=False,
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
    reranking = None
    if rerank is not None:
        reranking = RerankSettings(rerank, candidates, reverse_model, channel_weight, mbr_utility, comet_model)
    else:
        asked = {"--candidates": candidates != RerankSettings.candidates, "--reverse-model": reverse_model,
                 "--channel-weight": channel_weight != RerankSettings.channel_weight,
                 "--mbr-utility": mbr_utility != RerankSettings.mbr_utility, "--comet-model": comet_model}  # fmt: skip
        if stray := [flag for flag, given_ in asked.items() if given_]:
            raise ConfigError(f"{', '.join(stray)} go with --rerank, which chooses among candidates")
    try:
        translate_file(
            model, input, output, prefix, nbest=nbest, scores=scores, alignments=alignments, sampling=sampling,
            device=device, precision=precision, engine=engine, shortlist=shortlist, tgt_lang=tgt_lang,
            threads=threads, rerank=reranking, src_lang=src_lang, adapter=adapter, **decode,
        )  # fmt: skip
    except Interrupted as stop:
        kept = f": they are in {stop.partial}, and {output} is not written" if stop.partial else ""
        typer.echo(f"stopped by {stop.name} after {stop.done:,} complete lines{kept}", err=True)
        raise typer.Exit(128 + stop.signum) from None
