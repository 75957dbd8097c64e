"""Decoding speed, memory and quality on Multi30k test_2016_flickr (1,000 lines), over a grid of settings.

Each configuration runs in a child process of its own, so its peak RSS is its own: mtkit's engines
under the memory allocator the ``mtkit`` command uses (mimalloc where installed, glibc's with
``MTKIT_ALLOCATOR=system``), CTranslate2 used natively under the system's. Each reports:

- sentences/s: input lines over the seconds from reading the first input line to writing the last
  output line (model loading excluded, as for OpenNMT-py's 96 sentences/s on this machine kind);
- tokens/s: target subword tokens of the output over the same seconds. They are counted after the
  clock stops, by encoding the output lines again with the run's target tokenizer (eos not
  counted), so that every engine is counted the same way. That is within 0.2% of the search's own
  count (13,520 against 13,536 for mtkit fp32 beam 5 on the recipe's run);
- the BLEU of that output (sacreBLEU against the reference) and the process's peak RSS.

The grid is every combination of ``--engines`` x ``--precisions`` x ``--beams`` x ``--batch-sizes``
x ``--early-stop``, less the combinations that do not exist:

- engine ``mtkit``: mtkit's own batched search (``mtkit.decoding.line_translator.Translator``), weights in fp32
  or bf16, or its linear layers in int8 (``mtkit translate --precision``).
- engine ``ct2``: the model exported with ``mtkit export --format ctranslate2`` and decoded by
  CTranslate2 (``mtkit translate --engine ctranslate2``), skipped when the ctranslate2 package is
  missing. fp32 is a float32 export; int8 an int8 export (``--quantization int8``); bf16 a float32
  export computed in bfloat16, skipped where CTranslate2 has no bfloat16 for this CPU.
- engine ``ct2native``: the same export decoded as CTranslate2's own users decode it, the reference
  the other two are measured against: the lines tokenized with the export's SentencePiece model,
  then one ``translate_batch`` over all of them, with CTranslate2's batching (``max_batch_size`` a
  batch size, ``batch_type`` examples), ``beam_size``, one hypothesis, and CTranslate2's defaults for
  the rest (its length penalty 1, its 256-token cap).
- ``--early-stop off`` searches on until ``beam`` hypotheses have ended (fairseq's rule, ``mtkit
  translate --no-early-stop``) instead of stopping once the best candidate has ended: mtkit only,
  and beam > 1 only (greedy search is the same either way).
- ``--model NAME=RUN[,RUN...]``, given several times, measures several models in one run (a teacher
  and its student): each configuration once per model, named ``NAME:configuration``, and, after the
  table, each later model's sentences/s as a multiple of the first one's in the same configuration.
  Several runs after ``=`` are an ensemble, which only mtkit's engine decodes.
- ``--shortlist FILE`` (a file ``mtkit shortlist`` wrote) runs each mtkit and ct2native configuration
  a second time with it: mtkit as ``mtkit translate --shortlist``, CTranslate2 with the shortlist
  exported as its vocabulary map (``mtkit export --shortlist``) and ``use_vmap=True``, as its users
  would apply the same shortlist. Names end in ``-shortlist``.
- ``--sampling full,topk10,topp0.9`` adds sampled decoding (``mtkit translate --sample``, as back-translation
  runs it; beam 1, no shortlist): from the whole distribution, the 10 most probable tokens, or the nucleus of
  mass 0.9, at temperature 1 and seed 1. ct2native samples with ``sampling_topk`` (0: the whole
  distribution) and ``sampling_topp``; the ct2 engine does not sample. Names end in ``-sample_SPEC``;
  the BLEU of a sample is only its BLEU.
- a batch size is ``mtkit translate --batch-size``, at most that many sentences per batch (with
  the default ``--batch-tokens``). ``--batch-sizes 1,128`` adds one sentence per batch, which
  shows that batching changes speed and not the translations (same BLEU).
- ``--lines N`` translates only the first N lines, and scores them against their references: a
  quick check that every configuration runs, not figures to compare with the whole test set's.

Output: a table, then one ``decode_speed`` line per configuration with its settings and every
figure as key=value, in a fixed order, to compare runs with grep; progress goes to stderr. For
example (one line)::

    decode_speed engine=mtkit precision=bf16 beam=5 batch=128 early_stop=on status=ok
    sentences_per_s=181.2 tokens_per_s=2431 seconds=5.52 bleu=36.72 peak_rss_mib=978 tokens=13417

A configuration whose process failed has ``status=failed`` and no figures.

Run from the repository root with a trained run directory::

    python benchmarks/decode_speed.py --run runs/multi30k_en_de --repeat 3 --json decode.json
    python benchmarks/decode_speed.py --run runs/multi30k_en_de --engines mtkit --beams 5 --batch-sizes 1,32,128
    python benchmarks/decode_speed.py --model teacher=runs/st/teacher-1,runs/st/teacher-2 --model student=runs/st \
        --engines mtkit --precisions bf16,int8 --beams 1,5 --shortlist runs/st/shortlist.safetensors
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path

from mtkit.config import DecodeConfig, SamplingConfig
from mtkit.launch import preload_environment

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("mtkit", "ct2", "ct2native")
CT2_ENGINES = ("ct2", "ct2native")
PRECISIONS = ("fp32", "bf16", "int8")
ENGINE_PRECISIONS = {
    "mtkit": ("fp32", "bf16", "int8"),
    "ct2": ("fp32", "bf16", "int8"),
    "ct2native": ("fp32", "bf16", "int8"),
}
CT2_EXPORT = {"fp32": "float32", "bf16": "float32", "int8": "int8"}  # the weight type the export stores
CT2_COMPUTE = {"fp32": "default", "bf16": "bfloat16", "int8": "default"}  # what CTranslate2 computes in
NO_EARLY_STOP = "-no-early-stop"
SHORTLIST = "-shortlist"
SAMPLE = "sample_"  # the name part of a sampled configuration: sample_full, sample_topk10, sample_topp0.9
# The figures of a summary line, in order, with their format.
SUMMARY_FIGURES = (
    ("sentences_per_s", ".1f"),
    ("tokens_per_s", ".0f"),
    ("seconds", ".2f"),
    ("bleu", ".2f"),
    ("peak_rss_mib", ".0f"),
    ("tokens", "d"),
)


@dataclass(frozen=True)
class Config:
    """One point of the grid. Its name, e.g. ``mtkit-bf16-beam5-batch128``, is how a child is told it."""

    engine: str  # mtkit or ct2
    precision: str  # fp32, bf16 or int8
    beam: int = 5
    batch_size: int = DecodeConfig.batch_size
    early_stop: bool = True
    shortlist: bool = False
    model: str = ""  # the --model NAME it decodes; "" for --run
    sampling: str = ""  # a --sampling spec (full, topkK, toppP) when it samples instead of searching

    @property
    def sampling_config(self) -> SamplingConfig | None:
        return sampling_config(self.sampling) if self.sampling else None

    @property
    def name(self) -> str:
        suffix = ("" if self.early_stop else NO_EARLY_STOP) + (SHORTLIST if self.shortlist else "")
        model = f"{self.model}:" if self.model else ""
        sampled = f"-{SAMPLE}{self.sampling}" if self.sampling else ""
        return f"{model}{self.engine}-{self.precision}-beam{self.beam}-batch{self.batch_size}{sampled}{suffix}"

    @classmethod
    def parse(cls, name: str) -> Config:
        """The inverse of ``name``; a missing beam or batch is the default (``mtkit-fp32``: beam 5, batch 128)."""
        model, _, name = name.rpartition(":")
        shortlist = name.endswith(SHORTLIST)
        name = name.removesuffix(SHORTLIST)
        early_stop = not name.endswith(NO_EARLY_STOP)
        engine, precision, *rest = name.removesuffix(NO_EARLY_STOP).split("-")
        config = cls(engine, precision, early_stop=early_stop, shortlist=shortlist, model=model)
        for part in rest:
            if part.startswith("beam"):
                config = cls(**{**asdict(config), "beam": int(part.removeprefix("beam"))})
            elif part.startswith("batch"):
                config = cls(**{**asdict(config), "batch_size": int(part.removeprefix("batch"))})
            elif part.startswith(SAMPLE):
                config = cls(**{**asdict(config), "sampling": part.removeprefix(SAMPLE)})
            else:
                raise ValueError(f"configuration {name!r}: unknown part {part!r}")
        return config

    def summary(self, result: dict | None) -> str:
        """The one ``decode_speed key=value ...`` line of this configuration."""
        pairs = [("model", self.model)] if self.model else []
        pairs += [("engine", self.engine), ("precision", self.precision), ("beam", self.beam)]
        pairs += [("batch", self.batch_size), ("early_stop", "on" if self.early_stop else "off")]
        pairs.append(("shortlist", "on" if self.shortlist else "off"))
        pairs.append(("sampling", self.sampling or "off"))
        pairs.append(("status", "failed" if result is None else "ok"))
        if result is not None:
            pairs += [(key, format(result[key], spec)) for key, spec in SUMMARY_FIGURES]
        return "decode_speed " + " ".join(f"{key}={value}" for key, value in pairs)


def grid(args: argparse.Namespace, ct2_bf16: bool, model: str = "", ensemble: bool = False) -> list[Config]:
    """The configurations the options ask for, for ``model`` (an ``ensemble`` of runs or not), less those that do
    not exist (see the module docstring)."""
    configs = []
    for engine in args.engines:
        if ensemble and engine in CT2_ENGINES:
            continue
        for precision in args.precisions:
            if (
                precision not in ENGINE_PRECISIONS[engine]
                or engine in CT2_ENGINES
                and precision == "bf16"
                and not ct2_bf16
            ):
                continue
            for beam in args.beams:
                for batch_size in args.batch_sizes:
                    for early_stop in args.early_stop:
                        if not early_stop and (engine in CT2_ENGINES or beam == 1):
                            continue
                        configs.append(Config(engine, precision, beam, batch_size, early_stop, model=model))
                        if args.shortlist and engine != "ct2":
                            configs.append(
                                Config(engine, precision, beam, batch_size, early_stop, shortlist=True, model=model)
                            )
            for spec in args.sampling if engine != "ct2" else []:
                for batch_size in args.batch_sizes:
                    configs.append(Config(engine, precision, 1, batch_size, model=model, sampling=spec))
    return configs


def sampling_config(spec: str) -> SamplingConfig:
    """The SamplingConfig of a --sampling spec: full, topkK or toppP."""
    if spec == "full":
        return SamplingConfig()
    if spec.startswith("topk"):
        return SamplingConfig(top_k=int(spec.removeprefix("topk")))
    if spec.startswith("topp"):
        return SamplingConfig(top_p=float(spec.removeprefix("topp")))
    raise ValueError(f"sampling {spec!r}: expected full, topkK or toppP")


def sampling_spec(text: str) -> str:
    """An argparse type: a --sampling spec that ``sampling_config`` reads."""
    try:
        sampling_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def timed_translation(translator, source: Path, lines: int | None = None) -> tuple[list[str], float]:
    """Outputs and seconds from opening the input to writing the last output line; the first ``lines`` lines only
    when given."""
    from mtkit.data.parallel import iter_lines
    from mtkit.decoding.line_translator import chunked

    with tempfile.TemporaryFile("w+", encoding="utf-8") as out:
        start = time.perf_counter()
        for translations in translator.stream(chunked(islice(iter_lines(source), lines))):
            out.write(translations[0].text + "\n")
        out.flush()
        seconds = time.perf_counter() - start
        out.seek(0)
        return out.read().splitlines(), seconds


class NativeCTranslate2:
    """CTranslate2 as its users run it, with ``stream``'s interface for ``timed_translation``: every line's
    SentencePiece pieces to one ``translate_batch``, which batches and sorts them itself."""

    def __init__(self, export_dir: Path, config: Config, threads: int) -> None:
        import ctranslate2

        from mtkit.data.tokenizer import Tokenizer
        from mtkit.interop.ct2_export import read_manifest

        names = read_manifest(export_dir)["tokenizer"]
        self.src_tok, self.tgt_tok = (Tokenizer(export_dir / names[side]) for side in ("src", "tgt"))
        compute_type = CT2_COMPUTE[config.precision]
        self.engine = ctranslate2.Translator(str(export_dir), "cpu", compute_type=compute_type, intra_threads=threads)
        self.config = config
        self.sampling = {}
        if config.sampling_config is not None:
            ctranslate2.set_random_seed(config.sampling_config.seed)
            top_k, top_p = config.sampling_config.top_k, config.sampling_config.top_p
            self.sampling = {"sampling_topk": top_k, "sampling_topp": top_p}  # top-k 0: the whole distribution

    def stream(self, chunks):
        from mtkit.decoding.line_translator import Translation

        pieces = [self.src_tok.sp.encode(line, out_type=str) for chunk in chunks for line in chunk]
        results = self.engine.translate_batch(
            pieces,
            max_batch_size=self.config.batch_size,
            batch_type="examples",
            beam_size=self.config.beam,
            use_vmap=self.config.shortlist,
            **self.sampling,
        )
        for result in results:
            yield [Translation(self.tgt_tok.sp.decode(result.hypotheses[0]), 0.0, 0.0)]


def make_translator(config: Config, runs: list[Path], export_dir: Path, threads: int, shortlist: Path | None = None):
    from mtkit.runtime import set_threads
    from mtkit.translation.engines import load_translator

    set_threads(threads)
    decode = DecodeConfig(beam=config.beam, batch_size=config.batch_size, early_stop=config.early_stop)
    if config.engine == "ct2native":
        return NativeCTranslate2(export_dir, config, threads)
    if config.engine == "ct2":
        from mtkit.interop.ct2_translator import CTranslate2Translator

        return CTranslate2Translator.from_dir(export_dir, decode, "cpu", CT2_COMPUTE[config.precision])
    listed = shortlist if config.shortlist else None
    return load_translator(
        runs, "cpu", config.precision, sampling=config.sampling_config, shortlist=listed, **asdict(decode)
    )


def child_main(args: argparse.Namespace) -> None:
    """One configuration; prints its figures as one JSON line."""
    from mtkit.data.parallel import read_lines
    from mtkit.scoring.metrics import bleu

    runs = [Path(run) for run in args.run.split(",")]
    translator = make_translator(Config.parse(args.config), runs, args.export_dir, args.threads, args.shortlist)
    # The fastest of --repeat passes: other tenants of a shared machine only ever slow a pass down.
    source = args.data_dir / "test_2016_flickr.en.gz"
    runs = [timed_translation(translator, source, args.lines) for _ in range(args.repeat)]
    hyps, seconds = min(runs, key=lambda run: run[1])
    tokens = sum(len(ids) for ids in translator.tgt_tok.encode(hyps))  # after the clock: see the docstring
    refs = read_lines(args.data_dir / "test_2016_flickr.de.gz")[: len(hyps)]
    score = bleu(hyps, refs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"lines": len(hyps), "tokens": tokens, "seconds": seconds}
    result |= {"sentences_per_s": len(hyps) / seconds, "tokens_per_s": tokens / seconds}
    print(json.dumps({**result, "bleu": score.value, "signature": score.signature, "peak_rss_mib": peak}))


def run_child(args: argparse.Namespace, config: str, runs: list[Path], export_dir: Path) -> dict | None:
    """The figures of configuration ``config`` (a ``Config.name``) of the model ``runs`` (several: an ensemble)
    from a child process; None if it failed.

    ``args`` needs data_dir, threads and repeat; ``export_dir`` is the CTranslate2 export (ct2 only).
    """
    print(f"{config} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--config", config, "--run", ",".join(map(str, runs))]
    cmd += ["--data-dir", str(args.data_dir), "--threads", str(args.threads), "--export-dir", str(export_dir)]
    cmd += ["--repeat", str(args.repeat)] + (["--shortlist", str(args.shortlist)] if args.shortlist else [])
    cmd += ["--lines", str(args.lines)] if args.lines else []
    # mtkit's engines run under the allocator the mtkit command would use; CTranslate2 used natively, as a
    # Python program of its users would run: under the system's.
    env = None if Config.parse(config).engine == "ct2native" else preload_environment()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    if done.returncode:
        print(f"{config} failed (exit {done.returncode})", file=sys.stderr)
        return None
    return json.loads(done.stdout.splitlines()[-1])


def ct2_compute_types() -> set[str] | None:
    """CTranslate2's compute types on this CPU; None when the ctranslate2 package is missing."""
    try:
        import ctranslate2
    except ImportError:
        return None
    return set(ctranslate2.get_supported_compute_types("cpu"))


def comma_list(kind, choices: tuple[str, ...] | None = None):
    """An argparse type: comma-separated values of ``kind``, each one of ``choices`` when given."""

    def parse(text: str) -> list:
        values = [kind(part) for part in text.split(",") if part]
        wrong = [v for v in values if choices is not None and v not in choices]
        if not values or wrong:
            allowed = f" of {', '.join(choices)}" if choices else ""
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list{allowed}")
        return values

    return parse


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(text)
    return text == "on"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="trained run directory (tokenizer and best/), checkpoint or .safetensors file")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=RUN[,RUN...]",
        help="instead of --run, given several times: models measured in one run (several runs: an ensemble)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=REPO.parent / "shared" / "data" / "multi30k",
        help="folder with test_2016_flickr.{en,de}.gz",
    )
    p.add_argument("--engines", type=comma_list(str, ENGINES), default=list(ENGINES), help="mtkit,ct2,ct2native")
    p.add_argument(
        "--precisions",
        type=comma_list(str, PRECISIONS),
        default=list(PRECISIONS),
        help="fp32,bf16,int8; each engine runs those it has",
    )
    p.add_argument("--beams", type=comma_list(int), default=[1, 5], help="beam sizes, e.g. 1,5 (1 is greedy)")
    p.add_argument(
        "--batch-sizes",
        type=comma_list(int),
        default=[DecodeConfig.batch_size],
        help=f"at most this many sentences per batch, e.g. 1,32,128 (default {DecodeConfig.batch_size})",
    )
    p.add_argument(
        "--early-stop",
        type=comma_list(on_off),
        default=[True, False],
        help="on,off: stop once the best candidate has ended, or search on until beam have (mtkit, beam > 1)",
    )
    p.add_argument(
        "--shortlist",
        type=Path,
        help="a shortlist file (`mtkit shortlist`): mtkit and ct2native also run with it (ct2native: exported "
        "as CTranslate2's vocabulary map, use_vmap=True)",
    )
    p.add_argument(
        "--sampling",
        type=comma_list(sampling_spec),
        default=[],
        help="also sample (beam 1): full, topkK, toppP, e.g. full,topk10,topp0.9 (mtkit and ct2native)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 for the default")
    p.add_argument("--repeat", type=int, default=1, help="translate the test set this many times; report the fastest")
    p.add_argument("--lines", type=int, help="translate only the first N test lines (a quick check of the grid)")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    # Internal: how the parent starts a child for one configuration.
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--export-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.lines is not None and args.lines < 1:
        p.error("--lines must be >= 1")
    if args.config:
        child_main(args)
        return

    wants_ct2 = any(engine in CT2_ENGINES for engine in args.engines)
    compute_types = ct2_compute_types() if wants_ct2 else set()
    if compute_types is None:
        print("ct2, ct2native: skipped (pip install ctranslate2)", file=sys.stderr)
        args.engines = [e for e in args.engines if e not in CT2_ENGINES]
    ct2_bf16 = bool(compute_types) and "bfloat16" in compute_types
    if wants_ct2 and "bf16" in args.precisions and not ct2_bf16:
        print("ct2 bf16: skipped (CTranslate2 has no bfloat16 for this CPU)", file=sys.stderr)
    models = _models(p, args)
    configs = [c for name, runs in models.items() for c in grid(args, ct2_bf16, name, len(runs) > 1)]
    if not configs:
        p.error("no configuration left to run: see the combinations that exist in --help")

    figures: dict[Config, dict | None] = {}
    unexportable = None  # why this model has no CTranslate2 export (its positions), once an export said so
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            export = f"ct2-{CT2_EXPORT[config.precision]}{SHORTLIST if config.shortlist else ''}"
            export_dir = Path(tmp) / (config.model or "run") / export
            if config.engine in CT2_ENGINES and unexportable:
                continue
            if config.engine in CT2_ENGINES and not export_dir.exists():
                from mtkit.config import ConfigError
                from mtkit.interop.ct2_export import export_ctranslate2

                print(f"exporting {export_dir.name} ...", file=sys.stderr, flush=True)
                vmap = args.shortlist if config.shortlist else None
                try:
                    export_ctranslate2(models[config.model][0], export_dir, CT2_EXPORT[config.precision], vmap)
                except ConfigError as e:
                    unexportable = str(e)
                    print(f"ct2, ct2native: skipped ({unexportable})", file=sys.stderr)
                    continue
            figures[config] = run_child(args, config.name, models[config.model], export_dir)
    if not figures:
        sys.exit(f"decode_speed: nothing left to measure ({unexportable})")

    width = max(len("configuration"), *(len(c.name) for c in figures)) + 2
    print(f"{'configuration':<{width}}{'sent/s':>9}{'tok/s':>9}{'seconds':>9}{'BLEU':>7}{'peak MiB':>10}")
    for config, r in figures.items():
        if r is None:
            print(f"{config.name:<{width}}failed")
            continue
        print(
            f"{config.name:<{width}}{r['sentences_per_s']:>9.1f}{r['tokens_per_s']:>9,.0f}{r['seconds']:>9.2f}"
            f"{r['bleu']:>7.2f}{r['peak_rss_mib']:>10,.0f}"
        )
    print()
    for config, r in figures.items():
        print(config.summary(r))
    if len(models) > 1:
        print()
        _print_ratios(figures, next(iter(models)))
    if args.json:
        records = {c.name: {**asdict(c), **r} if r is not None else None for c, r in figures.items()}
        args.json.write_text(json.dumps(records, indent=1))


def _models(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, list[Path]]:
    """The models to measure by name: --run's (named ""), or each --model's runs."""
    if bool(args.run) == bool(args.model):
        p.error("give --run, or --model NAME=RUN[,RUN...] one or more times")
    if args.run:
        return {"": [Path(args.run)]}
    models = {}
    for given in args.model:
        name, _, runs = given.partition("=")
        if not name or not runs or not all(c.isalnum() or c in "_." for c in name) or name in models:
            p.error(f"--model {given!r}: expected a new NAME (letters, digits, _ and .) = RUN[,RUN...]")
        models[name] = [Path(run) for run in runs.split(",")]
    return models


def _print_ratios(figures: dict[Config, dict | None], first: str) -> None:
    """Each later model's sentences/s over the first model's, configuration by configuration."""
    base = {replace(c, model=""): r for c, r in figures.items() if c.model == first and r is not None}
    for config, r in figures.items():
        same = base.get(replace(config, model=""))
        if config.model != first and r is not None and same is not None:
            ratio = r["sentences_per_s"] / same["sentences_per_s"]
            print(f"decode_speed_ratio {config.name} over={first} sentences_per_s={ratio:.2f}")


if __name__ == "__main__":
    main()
