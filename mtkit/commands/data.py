"""``mtkit prepare`` and ``mtkit tokenizer train``: corpora and tokenizers before training."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from mtkit.commands.common import examples, setup_logging, user_errors
from mtkit.config import CleanConfig, InferencePrecision, PairFilterConfig, SpmType, TokenizerConfig

if TYPE_CHECKING:
    from mtkit.data.hf_corpus import HubCorpus
    from mtkit.translation.pair_filter import PreparedFilter

commands = typer.Typer()
tokenizer_commands = typer.Typer(help="Train SentencePiece tokenizer models.", no_args_is_help=True)


@tokenizer_commands.command(
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
    vocab_size: Annotated[int, typer.Option(help="Pieces per model.")] = TokenizerConfig.vocab_size,
    model_type: Annotated[SpmType, typer.Option("--type", help="SentencePiece model type.")] = TokenizerConfig.type,
    character_coverage: Annotated[
        float, typer.Option(help="Share of characters covered (0.9995 for CJK).")
    ] = TokenizerConfig.character_coverage,
    input_sentence_size: Annotated[
        int, typer.Option(help="Sentences sampled for training; 0 uses all.")
    ] = TokenizerConfig.input_sentence_size,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1, help="Seed for sentence sampling.")] = TokenizerConfig.seed,
) -> None:
    """Train SentencePiece model(s) with mtkit's special ids (pad 0, unk 1, bos 2, eos 3)."""
    from mtkit.data.parallel import iter_lines
    from mtkit.data.tokenizer import train_spm

    options = TokenizerConfig(
        type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        seed=seed,
    )  # checks the values
    setup_logging()
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


@commands.command(
    "prepare",
    epilog=examples(
        "mtkit prepare --list",
        "mtkit prepare multi30k_en_de -o data/m30k --mirror ../shared/data/multi30k",
        "mtkit prepare wmt14_en_de -o data/wmt14",
        "mtkit prepare hf:wmt/wmt16 --config ro-en --langpair en-ro -o data/wmt16",
        "mtkit prepare hf:json --data-files train=train.jsonl --splits train=train --langpair en-de -o data/mine",
        "mtkit prepare wmt14_en_de -o data/wmt14 --filter-forward runs/en-de --filter-reverse runs/de-en "
        "--filter-keep 0.9",
    ),
)
@user_errors
def prepare_command(
    corpus: Annotated[
        str | None,
        typer.Argument(
            help="A corpus name from --list, e.g. wmt14_en_de; or hf:DATASET for any Hugging Face datasets corpus: "
            "a Hub id (hf:wmt/wmt14), a local folder laid out as one, or hf:json, hf:csv, hf:parquet with --data-files."
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("--output", "-o", "--out", help="Output folder (see below).")] = None,
    mirror: Annotated[
        str | None,
        typer.Option(
            help="Fetch the corpus from here instead: for Multi30k a directory, a file:// or an http(s):// base "
            "holding its files; for a Hub corpus a directory (or file://) holding a clone of its dataset "
            "repository under its id, e.g. MIRROR/wmt/wmt14."
        ),
    ] = None,
    nfkc: Annotated[bool, typer.Option(help="Unicode NFKC normalisation of the training split.")] = CleanConfig.nfkc,
    dedupe: Annotated[bool, typer.Option(help="Drop repeated training pairs.")] = CleanConfig.dedupe,
    min_words: Annotated[
        int, typer.Option(help="Training pairs need this many words on each side.")
    ] = CleanConfig.min_words,
    max_words: Annotated[int, typer.Option(help="...and at most this many.")] = CleanConfig.max_words,
    max_ratio: Annotated[
        float, typer.Option(help="...and at most this ratio of the longer side to the shorter.")
    ] = CleanConfig.max_ratio,
    filter_forward: Annotated[
        Path | None,
        typer.Option(
            help="Filter the cleaned training split by dual conditional cross-entropy (Junczys-Dowmunt, 2018) with "
            "this model of its direction (run directory, checkpoint or .safetensors) and --filter-reverse."
        ),
    ] = None,
    filter_reverse: Annotated[
        Path | None, typer.Option(help="...and this model of the other direction (TGT->SRC).")
    ] = None,
    filter_keep: Annotated[
        float,
        typer.Option(
            help="...keeping this fraction of the pairs, those of lowest score |H_fwd - H_rev| + (H_fwd + H_rev) / 2 "
            "(H: each model's cross-entropy per token)."
        ),
    ] = PairFilterConfig.keep,
    filter_max_score: Annotated[
        float, typer.Option(help="...and none scored above this; 0: no limit.")
    ] = PairFilterConfig.max_score,
    filter_scores: Annotated[
        bool,
        typer.Option(
            "--filter-scores",
            help="...and write OUT/train.scores.tsv: 'SCORE, H_fwd, H_rev, KEPT (1/0), SOURCE, TARGET' per pair.",
        ),
    ] = PairFilterConfig.scores,
    filter_device: Annotated[str, typer.Option(help="...scoring on this device: auto, cpu, cuda or cuda:N.")] = "auto",
    filter_precision: Annotated[
        InferencePrecision,
        typer.Option(
            help="...in this number format; auto: bf16 where the device computes it natively, else fp32. "
            "prepare.json records the device and precision used, since bf16 and fp32 score a pair a little "
            "differently."
        ),
    ] = "auto",
    list_corpora: Annotated[bool, typer.Option("--list", help="List the corpora and exit.")] = False,
    langpair: Annotated[
        str | None, typer.Option(help="hf: source-target language codes, e.g. en-de; they name the output files.")
    ] = None,
    config: Annotated[str | None, typer.Option(help="hf: the dataset's config (subset), e.g. de-en.")] = None,
    revision: Annotated[str | None, typer.Option(help="hf: a branch, tag or commit of the Hub dataset.")] = None,
    data_dir: Annotated[
        str | None, typer.Option(help="hf: the folder of the repository that holds this corpus, e.g. iwslt2017-de-en.")
    ] = None,
    splits: Annotated[
        str | None,
        typer.Option(
            help="hf: the output splits, each with the dataset's split it comes from "
            "[default: train=train,valid=validation,test=test]."
        ),
    ] = None,
    src_column: Annotated[
        str | None, typer.Option(help="hf: the source text's column (default: translation.SRC, or a column SRC).")
    ] = None,
    tgt_column: Annotated[str | None, typer.Option(help="hf: the target text's column.")] = None,
    data_files: Annotated[
        list[str] | None,
        typer.Option(help="hf: SPLIT=FILE (parquet, jsonl, json, csv, tsv; globs as load_dataset takes), repeatable."),
    ] = None,
    num_proc: Annotated[
        int | None, typer.Option(min=1, help="hf: processes converting the data files to Arrow.")
    ] = None,
) -> None:
    """Download a standard corpus and write line-aligned plain text: OUT/{train,valid,test}.LANG.

    Multi30k's downloads resume where they stopped, are checked against their SHA-256 and stay in
    OUT/raw. The Hub corpora (wmt14, wmt16, iwslt17; --list shows each one's dataset and revision)
    and any hf: corpus are loaded by datasets.load_dataset, so its cache, HF_HOME, HF_TOKEN,
    HF_HUB_OFFLINE and HF_ENDPOINT apply; prepare.json records the commit they resolved to (or
    local files' SHA-256) and each split's fingerprint. Only the training split is cleaned
    (normalised, filtered by length and ratio, deduplicated); valid and test are written as
    published. With --filter-forward and --filter-reverse, the cleaned training split is then filtered by dual
    conditional cross-entropy, its pairs kept in order. OUT/prepare.json records what was done, and a re-run with
    the same settings (and filter models) does nothing (unless local data files changed: their SHA-256 are
    compared with the record).
    """
    from mtkit.config import ConfigError
    from mtkit.data.corpora import CORPORA, find_corpus
    from mtkit.data.hf_corpus import PREFIX, HubCorpus, parse_data_files, parse_splits
    from mtkit.data.preparation import prepare_corpus, prepare_dataset

    setup_logging()
    if list_corpora:
        for c in CORPORA.values():
            origin = f" [{_hub_origin(c.dataset)}{f'; {c.caveat}' if c.caveat else ''}]" if c.dataset else ""
            typer.echo(f"{c.name:<16} {c.about}{origin}")
        return
    if corpus is None or out is None:
        raise ConfigError("give a corpus and --out, e.g. mtkit prepare multi30k_en_de --out data/multi30k_en_de")
    clean = CleanConfig(nfkc=nfkc, dedupe=dedupe, min_words=min_words, max_words=max_words, max_ratio=max_ratio)
    given = {"--filter-forward": filter_forward is not None, "--filter-reverse": filter_reverse is not None,
             "--filter-scores": filter_scores, "--filter-device": filter_device != "auto",
             "--filter-precision": filter_precision != "auto"}  # fmt: skip
    pair_filter = _filter_settings(filter_forward, filter_reverse, filter_keep, filter_max_score, filter_scores, given)
    decoding = (filter_device, filter_precision)
    if corpus.startswith(PREFIX):
        if mirror is not None:
            raise ConfigError("--mirror is for catalogue corpora; an hf: corpus uses HF_ENDPOINT or a local folder")
        source, target = _langpair(langpair)
        request = HubCorpus(
            corpus.removeprefix(PREFIX),
            source,
            target,
            config,
            revision,
            parse_splits(splits),
            src_column,
            tgt_column,
            parse_data_files(data_files or []),
            data_dir,
        )
        train_filter = _train_filter(pair_filter, (source, target), *decoding)
        record = prepare_dataset(request, out, clean, num_proc, train_filter)
    else:
        spec = find_corpus(corpus)
        record = prepare_corpus(spec, out, mirror, clean, _train_filter(pair_filter, spec.langs, *decoding))
    counts = ", ".join(f"{name} {split['lines']:,}" for name, split in record["splits"].items())
    typer.echo(f"{corpus} in {out}: {counts} lines")


def _filter_settings(
    forward: Path | None, reverse: Path | None, keep: float, max_score: float, scores: bool, given: dict[str, bool]
) -> PairFilterConfig | None:
    """The filter the --filter-* options ask for, if any; ConfigError in their names (``given``: which of those that
    need a filter were given) before anything is read."""
    from mtkit.config import ConfigError

    if not 0.0 < keep <= 1.0:
        raise ConfigError(f"--filter-keep is the fraction of pairs kept: it must be in (0, 1], got {keep:g}")
    if not max_score >= 0.0:
        raise ConfigError(
            f"--filter-max-score bounds cross-entropies, which are >= 0: give 0 (no limit) or more, got {max_score:g}"
        )
    if keep == 1.0 and max_score == 0.0:
        if stray := [flag for flag, was_given in given.items() if was_given]:
            flags = ", ".join(stray)
            raise ConfigError(
                f"{flags}: the filter filters nothing without --filter-keep below 1 or --filter-max-score"
            )
        return None
    if forward is None or reverse is None:
        raise ConfigError("the filter needs two models: --filter-forward SRC->TGT and --filter-reverse TGT->SRC")
    return PairFilterConfig(str(forward), str(reverse), keep, max_score, scores)


def _train_filter(
    settings: PairFilterConfig | None, langs: tuple[str, str], device: str, precision: str
) -> PreparedFilter | None:
    """The filter of the training split of ``langs``, if any, scoring on ``device`` in ``precision``."""
    from mtkit.translation.pair_filter import PreparedFilter

    return PreparedFilter(settings, langs, device, precision) if settings is not None else None


def _hub_origin(dataset: HubCorpus) -> str:
    """``hf:wmt/wmt14 config de-en revision b199e40...``: what a Hub corpus loads."""
    parts = [f"hf:{dataset.path}"]
    parts += [f"{key} {value}" for key in ("config", "data_dir", "revision") if (value := getattr(dataset, key))]
    return " ".join(parts)


def _langpair(text: str | None) -> tuple[str, str]:
    """``en-de`` → ("en", "de")."""
    from mtkit.config import ConfigError

    source, sep, target = (text or "").partition("-")
    if not sep or not source or not target or "-" in target:
        raise ConfigError(f"an hf: corpus needs --langpair SRC-TGT, e.g. --langpair en-de (got {text!r})")
    return source, target
