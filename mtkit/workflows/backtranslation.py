"""Back-translation in `mtkit run`: the reverse model, the synthetic sources, and the config that trains on both.

Three stages before the main training, each resumable and recorded like the run's others:

1. ``reverse``: a model of the reverse direction, given (``backtranslation.reverse_model``) or trained into
   RUN/reverse with the run's settings on its parallel data turned around (resuming from its checkpoints; one
   that train.max_time cuts short makes the run's verdict "incomplete");
2. ``back-translate``: the reverse model translates the target-language monolingual text, by sampling or
   beam search, into RUN/backtranslated.SRC, in parts that a stopped run keeps
   (mtkit.translation.resumable), keyed also with the device and precision they are decoded in, and that
   SIGINT/SIGTERM stops at once (``StageStopped``); RUN/stages.json records the model, text and settings it
   was made from, so a later run redoes it only when one of them changed;
3. ``pair filter``, with ``pair_filter``: the synthetic pairs scored by dual conditional
   cross-entropy, the given forward model and the reverse model (or the filter's own), and the best kept in
   RUN/backtranslated-filtered/ (mtkit.workflows.pair_filtering);
4. the main training then reads the run's parallel corpora and one more, the synthetic pairs
   (backtranslated.SRC and the monolingual text, or the filtered ones), weighted by ``backtranslation.weight`` and,
   with ``backtranslation.tag``, their sources tagged <BT> (mtkit.data.directions).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mtkit.config import BackTranslationConfig, ConfigError, CorpusConfig, PairFilterConfig, RunConfig, SamplingConfig
from mtkit.data.directions import directions
from mtkit.data.parallel import DataError, check_input_file, count_lines
from mtkit.model.checkpoint import weights_file
from mtkit.workflows.pair_filtering import PairsToFilter, check_settings, filter_stage
from mtkit.workflows.stages import Stage, StageRecord, decoding, run_stage, train_stage

if TYPE_CHECKING:
    from mtkit.training.reporting import Reporter

log = logging.getLogger("mtkit")

REVERSE_DIR = "reverse"
FILTERED_DIR = "backtranslated-filtered"


def check_monolingual(bt: BackTranslationConfig) -> None:
    """DataError unless the monolingual text is a file with lines, said before any training."""
    check_input_file(bt.monolingual)
    if not count_lines(bt.monolingual):
        raise DataError(f"{bt.monolingual}: backtranslation.monolingual has no lines to back-translate")


def reverse_config(cfg: RunConfig) -> RunConfig:
    """The run's config turned around: each real corpus's sides and languages swapped, the reverse model's
    updates, no back-translation of its own."""
    bt, data = cfg.backtranslation, cfg.data
    if data.corpora:
        swapped = tuple(
            replace(c, src_lang=c.tgt_lang, tgt_lang=c.src_lang, train_src=c.train_tgt, train_tgt=c.train_src,
                    valid_src=c.valid_tgt, valid_tgt=c.valid_src)
            for c in data.corpora if not c.back_translated
        )  # fmt: skip
        if any(c.train_src and not c.train_tgt for c in data.corpora):
            raise ConfigError("back-translation turns corpora around: give train_tgt, not a .tsv train_src alone")
        reversed_data = replace(data, corpora=swapped)
    else:
        if not data.train_tgt:
            raise ConfigError("back-translation turns the corpus around: give data.train_tgt, not a .tsv alone")
        reversed_data = replace(
            data, src_lang=data.tgt_lang, tgt_lang=data.src_lang, train_src=data.train_tgt, train_tgt=data.train_src,
            valid_src=data.valid_tgt, valid_tgt=data.valid_src,
        )  # fmt: skip
    train = replace(cfg.train, max_steps=bt.reverse_steps or cfg.train.max_steps)
    return replace(
        cfg, data=reversed_data, train=train, backtranslation=BackTranslationConfig(), pair_filter=PairFilterConfig()
    )


def with_synthetic(cfg: RunConfig, synthetic: Path, target: Path | None = None) -> RunConfig:
    """The config of the main training: the run's parallel corpora plus the synthetic pairs, ``synthetic`` sources
    and their ``target`` text (by default the monolingual text)."""
    bt, data = cfg.backtranslation, cfg.data
    (src, tgt), = directions(data)  # fmt: skip
    corpora = data.corpora or (CorpusConfig(src, tgt, data.train_src, data.train_tgt, data.valid_src, data.valid_tgt),)
    text = str(target) if target is not None else bt.monolingual
    extra = CorpusConfig(src, tgt, str(synthetic), text, weight=bt.weight, back_translated=bt.tag)
    plain = replace(data, train_src="", train_tgt="", valid_src="", valid_tgt="", corpora=(*corpora, extra))
    return replace(cfg, data=plain)


def back_translate(
    cfg: RunConfig,
    out: Path,
    stages: list[Stage],
    record: StageRecord,
    reporter: Reporter | None = None,
    restart: Collection[str] = (),
) -> RunConfig:
    """Run the reverse and back-translate stages into ``out``; the config the main model trains with. The reverse
    model trains from update 0 when ``restart`` names ``reverse``."""
    from mtkit.model.loading import resolve

    bt = cfg.backtranslation
    pairs = directions(cfg.data)
    if len(pairs) != 1:
        raise ConfigError(f"back-translation is for a model of one direction; these corpora have {len(pairs)}")
    check_monolingual(bt)
    pair_filter = cfg.pair_filter
    check_settings(pair_filter, "forward", "back-translated")
    with run_stage(stages, "reverse") as stage:
        if bt.reverse_model:
            reverse, stage.ran, stage.note = Path(bt.reverse_model), False, f"given: {bt.reverse_model}"
        else:
            reverse = out / REVERSE_DIR
            result = train_stage(reverse_config(cfg), reverse, reporter, "reverse", "reverse" in restart)
            bleu = result.get("valid_bleu")  # none when it had trained to the end already
            stage.note = f"{pairs[0][1]}->{pairs[0][0]} trained into {reverse}" + (
                f"; validation BLEU {bleu:.2f}" if bleu is not None else ", up to date"
            )
            if result["stop"]["stopped_by"] == "max_time":  # a model cut short: the run's score says nothing
                stage.incomplete = f"the reverse model's training {result['stop']['reason']}"

    synthetic = out / f"backtranslated.{pairs[0][0]}"
    with run_stage(stages, "back-translate") as stage:
        model = weights_file(resolve(reverse))
        inputs = {"model": record.digests.of(model), "monolingual": record.digests.of(Path(bt.monolingual))}
        settings = {"backtranslation": _translation_settings(bt), "decode": asdict(cfg.decode)}
        if stage.out_of_date(record, synthetic, inputs, settings):
            decoded = decoding(cfg.train.device)
            made_from = {"inputs": inputs, "settings": settings, "decoded": decoded}  # parts of fp32 and bf16 never mix
            lines = _write_back_translation(cfg, reverse, synthetic, decoded["precision"], made_from)
            where = f"{decoded['precision']} on {decoded['device']}"
            stage.note = f"{lines:,} lines of {bt.monolingual} by {_method(bt)}; {where}"
        else:
            stage.note = f"{synthetic.name} is up to date ({_method(bt)})"
    if not pair_filter.enabled:
        return with_synthetic(cfg, synthetic)
    judge = Path(pair_filter.reverse) if pair_filter.reverse else reverse
    to_filter = PairsToFilter(synthetic, Path(bt.monolingual), pairs[0], (Path(pair_filter.forward),), judge)
    folder = out / FILTERED_DIR
    filter_stage(pair_filter, to_filter, folder, cfg.train.device, stages, record)
    src, tgt = pairs[0]
    return with_synthetic(cfg, folder / f"train.{src}", folder / f"train.{tgt}")


def _translation_settings(bt: BackTranslationConfig) -> dict:
    """What the synthetic sources depend on besides the model and the text: the search or the sampling."""
    if bt.method == "beam":
        return {"method": "beam", "beam": bt.beam}
    return {"method": "sample", "temperature": bt.temperature, "top_k": bt.top_k, "top_p": bt.top_p, "seed": bt.seed}


def _method(bt: BackTranslationConfig) -> str:
    if bt.method == "beam":
        return f"beam search (beam {bt.beam})"
    return f"sampling (temperature {bt.temperature:g}, top-k {bt.top_k}, top-p {bt.top_p:g}, seed {bt.seed})"


def _write_back_translation(cfg: RunConfig, reverse: Path, synthetic: Path, precision: str, made_from: dict) -> int:
    from mtkit.training.stop_signals import stop_at_once
    from mtkit.translation.engines import load_translator
    from mtkit.translation.resumable import parts_folder, translate_resumably

    bt = cfg.backtranslation
    sampling = SamplingConfig(bt.temperature, bt.top_k, bt.top_p, bt.seed) if bt.method == "sample" else None
    decode = {"beam": bt.beam} if bt.method == "beam" else {}
    (src, tgt), = directions(cfg.data)  # fmt: skip
    translator = load_translator(reverse, cfg.train.device, precision, sampling=sampling, **decode).into(src, tgt)
    with stop_at_once("back-translating", str(parts_folder(synthetic))):
        return translate_resumably(translator, Path(bt.monolingual), synthetic, "back-translating", made_from=made_from)
