"""The Python API: the functions ``import mtkit`` offers, each a few lines over the module doing the work.

    import mtkit

    translator = mtkit.load("runs/m30k", device="cpu")   # precision auto; the run's decode settings
    translator = mtkit.load("runs/m30k", device="cpu", threads=4)  # 4 CPU threads (0: OMP_NUM_THREADS or 1 a core)
    translator = mtkit.load("opus-en-de", adapter="runs/legal-lora")  # a LoRA adapter of the model (train.lora)
    translator = mtkit.load("runs/legal-lora")                         # the same: a LoRA run brings its base
    translator.translate(["A dog runs on the beach."], beam=5)             # -> ["Ein Hund läuft ..."]
    for best, *others in translator.hypotheses(open("test.en"), nbest=3): ...  # streamed, with scores
    for pair in translator.score(open("test.en"), open("test.de")): ...  # given translations: pair.logprob, .tokens
    mtkit.train("recipes/multi30k_en_de.yaml", "runs/m30k", overrides=["data.train_src=train.en", ...])
    mtkit.evaluate(hypotheses, [references], metrics=("bleu", "chrf"))   # scores with signatures
    mtkit.evaluate(hypotheses, [], metrics=("cometkiwi",), sources=sources)  # COMET reads the sources too
    mtkit.prepare("multi30k_en_de", "data/m30k")  # downloaded; mirror="DIR" reads a local copy
    mtkit.prepare("hf:wmt/wmt16", "data/ro", config="ro-en", src_lang="en", tgt_lang="ro")  # any datasets corpus

Errors about the input (a file, a setting, a checkpoint) are ``mtkit.MtkitError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from mtkit.config import RunConfig, apply_override, from_dict, read_config
from mtkit.scoring.comet_names import CometPrecision
from mtkit.scoring.learned_metrics import CometSettings, as_score, check_names, learned_scores
from mtkit.scoring.metrics import COMET_METRICS, DEFAULT_METRICS, EVAL_METRICS, Options, Score, corpus_scores
from mtkit.translation.engines import load_translator

load = load_translator  # mtkit.load("runs/m30k", device="cpu", beam=4, adapter=None): translation.engines's


def train(
    config: RunConfig | dict | str | Path, out: str | Path, overrides: Sequence[str] = (), restart: bool = False
) -> dict:
    """Train ``config`` (a RunConfig, a dict of sections or a YAML file, with ``section.key=value``
    overrides) into the run directory ``out``, resuming from its newest checkpoint unless ``restart``.
    Returns the last validation result, with "stop": what ended training (see Trainer.run)."""
    from mtkit.training.trainer import run_training

    if isinstance(config, (str, Path)):
        cfg = read_config(config, list(overrides))
    else:
        raw = config.to_dict() if isinstance(config, RunConfig) else config
        cfg = _with_overrides(raw, overrides)
    return run_training(cfg, Path(out), restart=restart)


def _with_overrides(raw: dict, overrides: Sequence[str]) -> RunConfig:
    raw = {section: dict(values or {}) for section, values in raw.items()}
    for assignment in overrides:
        apply_override(raw, assignment)
    return from_dict(raw)


def evaluate(
    hypotheses: Sequence[str],
    references: Sequence[Sequence[str]],
    metrics: Sequence[str] = DEFAULT_METRICS,
    tokenize: str | None = None,
    lowercase: bool = False,
    target_language: str = "",
    sources: Sequence[str] | None = None,
    comet_model: str | None = None,
    comet_revision: str | None = None,
    device: str = "auto",
    precision: CometPrecision = "fp32",
    batch_size: int = 16,
) -> list[Score]:
    """Corpus scores through sacreBLEU (bleu, chrf, chrf++, ter) and of COMET (comet, cometkiwi), each with its
    signature; COMET's after sacreBLEU's.

    ``references`` is a list of reference streams, each as long as ``hypotheses`` (none for cometkiwi alone);
    ``sources``, as long too, is what comet and cometkiwi read; ``comet_model`` (a Hub id or a folder; default: the
    metric's Unbabel model) at ``comet_revision`` scores them on ``device`` in ``precision`` (fp32, bf16, int8,
    auto), ``batch_size`` segments at a time.
    """
    from mtkit.config import ConfigError

    names, hyps, refs = tuple(metrics), list(hypotheses), [list(r) for r in references]
    unknown = [name for name in names if name not in EVAL_METRICS]
    if unknown:
        raise ConfigError(f"unknown metric {', '.join(unknown)} (known: {', '.join(EVAL_METRICS)})")
    comet = CometSettings(comet_model, comet_revision, device, precision, batch_size)
    check_names(names, comet)
    plain = tuple(name for name in names if name not in COMET_METRICS)
    options = Options(tokenize, lowercase, trg_lang=target_language)
    scores = corpus_scores(hyps, refs, plain, options) if plain else []
    learned_names = [name for name in names if name in COMET_METRICS]
    if not learned_names:
        return scores
    if sources is None or len(sources) != len(hyps):
        given = "no sources" if sources is None else f"{len(sources)} sources"
        raise ConfigError(f"{' and '.join(learned_names)} need a source per hypothesis: {given} for {len(hyps)}")
    learned = learned_scores(names, list(sources), [hyps], refs, comet)
    return scores + [as_score(results[0]) for results in learned.values()]


def prepare(corpus: str, out: str | Path, mirror: str | None = None, **settings: Any) -> dict:
    """Write ``out/{train,valid,test}.LANG`` from ``corpus``: a catalogue name (downloaded or loaded from the
    Hub, or read from ``mirror``: see ``mtkit prepare --help``), or ``hf:PATH`` for any Hugging Face
    ``datasets`` corpus (a Hub id, a local folder, or json/csv/parquet with ``data_files``). ``settings``: the
    cleaning (``nfkc``, ``dedupe``, ``min_words``, ``max_words``, ``max_ratio``) and, for ``hf:``, the fields of
    ``hf_corpus.HubCorpus`` (``src_lang`` and ``tgt_lang``, ``config``, ``revision``, ``splits``, ``src_column``,
    ``tgt_column``, ``data_files``, ``data_dir``).
    Returns prepare.json."""
    from mtkit.config import CleanConfig, ConfigError
    from mtkit.data.corpora import find_corpus
    from mtkit.data.hf_corpus import PREFIX, HubCorpus
    from mtkit.data.preparation import prepare_corpus, prepare_dataset

    cleaning = {name: settings.pop(name) for name in [f.name for f in fields(CleanConfig)] if name in settings}
    clean = CleanConfig(**cleaning)
    if not corpus.startswith(PREFIX):
        if settings:
            raise ConfigError(f"{corpus}: {', '.join(sorted(settings))} apply to hf: corpora only")
        return prepare_corpus(find_corpus(corpus), Path(out), mirror, clean)
    if mirror is not None:
        raise ConfigError("mirror is for catalogue corpora; an hf: corpus uses HF_ENDPOINT or a local folder")
    return prepare_dataset(HubCorpus(corpus.removeprefix(PREFIX), **settings), Path(out), clean)
