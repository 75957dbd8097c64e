"""COMET-22 scoring speed: mtkit's Comet in fp32, bf16 and int8 against unbabel-comet 2.2.7 on the same model.

The data: the first --segments lines of WMT22 en-de (../shared/data/wmt22): src.en as the sources, ref.B.de as
the system's translations, ref.A.de as the reference. The model: Unbabel/wmt22-comet-da's shapes (XLM-R large, 24
layers, 1024 hidden, 16 heads, 4096 ffn, 250,002 embedding rows, 514 positions, estimator [3072, 1024]) with
random weights, built once into --cache by tests/comet_fixture.py. XLM-R's tokenizer cannot be downloaded here:
a SentencePiece unigram model trained on the three WMT22 en-de files stands in for it (the output says how many
tokens a segment has with it), so speeds compare the two implementations, and scores mean nothing.

Each implementation is timed on its own, loading excluded from segments/s:

- unbabel-comet's command line, ``comet-score -s -t -r --model CHECKPOINT --gpus 0``, timed as a subprocess of
  the peer environment (benchmarks/comet_peer_env.sh). Its 2.2.7 calls ``model.half()`` before scoring, so on
  a CPU it scores in fp16. Its scoring seconds are its wall time less its import and load time, measured by
- unbabel-comet's API in fp32 in the same environment: ``load_from_checkpoint`` then ``predict`` at batch 16 with
  gpus=0, each timed inside the process (this script run by the peer's python with --peer-predict);
- mtkit's ``Comet.load(folder, precision=P)`` then ``score``, for P in fp32, bf16, int8, in this process.

Then the system scores of mtkit's bf16 and int8 against its fp32, and against unbabel-comet's fp32 scores kept in
tests/data/comet_expected.json, on the tiny random fixture models (both kinds).

Random weights need not move under bf16 or int8 as trained ones do, so last the same comparison on tiny models
trained for it: the fixture's model of each kind, trained a few hundred Adam steps through mtkit's own network
to predict sentence chrF/100 of degraded Multi30K captions (../shared/data/multi30k; COMET from hypothesis and
reference, CometKiwi from source and hypothesis alone), saved in unbabel-comet's layout and scored as any model
is, on 300 held-out segments; fp32's Pearson r with chrF/100 there shows that it learned something.

    python benchmarks/comet_speed.py                 # 500 segments: the whole machine for a long while
    python benchmarks/comet_speed.py --segments 8    # a check that everything runs
    python benchmarks/comet_speed.py --trained-only  # the trained tiny models alone: a minute or two
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from mtkit.scoring.comet import Comet

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from comet_fixture import HYPOTHESES, REFERENCES, SOURCES, build_comet  # noqa: E402

WMT22 = ROOT.parent / "shared" / "data" / "wmt22"
FILES = {
    "sources": "generaltest2022.en-de.src.en.gz",
    "system": "generaltest2022.en-de.ref.B.de.gz",
    "references": "generaltest2022.en-de.ref.A.de.gz",
}
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mtkit-peers"
PRECISIONS = ("fp32", "bf16", "int8")
BATCH_SIZE = 16  # comet-score's default


def read_lines(name: str, count: int | None = None) -> list[str]:
    with gzip.open(WMT22 / name, "rt", encoding="utf-8") as lines:
        text = [line.rstrip("\n") for line in lines]
    return text if count is None else text[:count]


def cached_model(cache: Path) -> Path:
    """The COMET-22-size random model, built on the first call; a folder without its marker is built again."""
    folder = cache / "comet-models" / "wmt22-comet-da-shapes-seed0"
    marker = folder / "built"
    if marker.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    texts = [line for name in FILES.values() for line in read_lines(name)]
    print(f"building a COMET-22-size random model in {folder} (once)", file=sys.stderr)
    build_comet(folder, "comet", seed=0, size="xlmr-large", tokenizer_texts=texts)
    marker.write_text("build_comet(folder, 'comet', seed=0, size='xlmr-large', WMT22 en-de texts)\n")
    return folder


# -- unbabel-comet --------------------------------------------------------------------------------------------


def peer_predict(folder: Path, data: Path) -> None:
    """Run by the peer environment's python: unbabel-comet's API in fp32, as one JSON line of timings."""
    start = time.perf_counter()
    import comet

    imported = time.perf_counter()
    model = comet.load_from_checkpoint(str(folder / "checkpoints" / "model.ckpt"))
    loaded = time.perf_counter()
    texts = json.loads(data.read_text(encoding="utf-8"))
    samples = [{"src": s, "mt": t, "ref": r} for s, t, r in zip(texts["sources"], texts["system"], texts["references"])]
    output = model.predict(samples, batch_size=BATCH_SIZE, gpus=0, progress_bar=False)
    scored = time.perf_counter()
    timings = {"import_s": imported - start, "load_s": loaded - imported, "score_s": scored - loaded}
    print(json.dumps({**timings, "system": float(output.system_score)}))


def run_peer(python: Path, folder: Path, texts: dict[str, list[str]], scratch: Path) -> list[dict]:
    """unbabel-comet's API in fp32, then its command line (fp16), each in a process of the peer environment."""
    data = scratch / "texts.json"
    data.write_text(json.dumps(texts), encoding="utf-8")
    api = subprocess.run(
        [str(python), __file__, "--peer-predict", str(folder), str(data)], capture_output=True, text=True, check=False
    )
    if api.returncode != 0:
        raise SystemExit(f"error: unbabel-comet's predict failed:\n{api.stderr[-3000:]}")
    timings = json.loads(api.stdout.strip().splitlines()[-1])
    rows = [
        {
            "name": "unbabel-comet predict()",
            "precision": "fp32",
            "load_s": timings["import_s"] + timings["load_s"],
            "score_s": timings["score_s"],
            "system": timings["system"],
        }
    ]
    paths = {}
    for side, lines in texts.items():
        paths[side] = scratch / f"{side}.txt"
        paths[side].write_text("\n".join(lines) + "\n", encoding="utf-8")
    command = [
        str(python.parent / "comet-score"),
        *("-s", str(paths["sources"]), "-t", str(paths["system"]), "-r", str(paths["references"])),
        *("--model", str(folder / "checkpoints" / "model.ckpt"), "--gpus", "0", "--quiet", "--only_system"),
    ]
    start = time.perf_counter()
    cli = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if cli.returncode != 0:
        raise SystemExit(f"error: comet-score failed:\n{cli.stderr[-3000:]}")
    system = float(cli.stdout.strip().split()[-1])
    load = rows[0]["load_s"]
    rows.append({"name": "unbabel-comet comet-score", "precision": "fp16", "load_s": load, "score_s": wall - load})
    rows[-1].update(system=system, wall_s=wall)
    return rows


# -- mtkit ----------------------------------------------------------------------------------------------------


def run_mtkit(folder: Path, texts: dict[str, list[str]]) -> list[dict]:
    from mtkit.scoring.comet import Comet

    rows = []
    for precision in PRECISIONS:
        start = time.perf_counter()
        comet = Comet.load(str(folder), precision=precision, batch_size=BATCH_SIZE)
        loaded = time.perf_counter()
        (result,) = comet.score(texts["sources"], [texts["system"]], [texts["references"]])
        scored = time.perf_counter()
        rows.append(
            {
                "name": "mtkit Comet",
                "precision": precision,
                "load_s": loaded - start,
                "score_s": scored - loaded,
                "system": result.system,
            }
        )
        del comet
    return rows


def precision_agreement(scratch: Path) -> list[str]:
    """mtkit's system scores of the tiny fixture models per precision, against its fp32 and unbabel-comet's."""
    from mtkit.scoring.comet import Comet

    expected = json.loads((ROOT / "tests" / "data" / "comet_expected.json").read_text(encoding="utf-8"))
    lines = []
    for kind in ("comet", "cometkiwi"):
        folder = build_comet(scratch / f"tiny-{kind}", kind, seed=0)
        references = [REFERENCES] if kind == "comet" else None
        for precision in PRECISIONS:  # fp32 first
            (result,) = Comet.load(str(folder), precision=precision).score(SOURCES, [HYPOTHESES], references)
            if precision == "fp32":
                fp32 = result
            worst = max(abs(a - b) for a, b in zip(result.segments, fp32.segments))
            peer = expected[kind]["system"]
            lines.append(
                f"{kind:9} {precision:4} system {result.system:+.6f}  vs mtkit fp32 {result.system - fp32.system:+.2e}"
                f" (worst segment {worst:.2e})  vs unbabel-comet fp32 {result.system - peer:+.2e}"
            )
    return lines


# -- trained tiny models -------------------------------------------------------------------------------------

TRAIN_STEPS = 600
TRAIN_BATCH = 32
LEARNING_RATE = 3e-3
HYPOTHESES_PER_LINE = 3  # degraded copies of each training reference
HELD_OUT = 300


def multi30k(split: str, language: str) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{language}.gz", "rt", encoding="utf-8") as lines:
        return [line.strip() for line in lines]


def degraded(reference: str, others: list[str], rng: random.Random) -> str:
    """reference made worse by a random amount: words dropped, words swapped for other lines' words, neighbours
    exchanged; now and then another line altogether, now and then the reference itself."""
    level = rng.random()
    if level < 0.05:
        return reference
    if level > 0.95:
        return rng.choice(others)
    words = [word for word in reference.split() if rng.random() >= level / 2] or reference.split()[:1]
    words = [rng.choice(rng.choice(others).split()) if rng.random() < level / 2 else word for word in words]
    for _ in range(round(level * len(words))):
        i = rng.randrange(len(words))
        j = min(i + 1, len(words) - 1)
        words[i], words[j] = words[j], words[i]
    return " ".join(words)


def chrf_segments(split: str, copies: int, rng: random.Random) -> list[tuple[str, str, str, float]]:
    """(source, hypothesis, reference, sentence chrF/100) for each English-German line of a split, ``copies``
    degraded hypotheses a line."""
    import sacrebleu

    sources, references = multi30k(split, "en"), multi30k(split, "de")
    return [
        (source, hypothesis, reference, sacrebleu.sentence_chrf(hypothesis, [reference]).score / 100)
        for source, reference in zip(sources, references, strict=True)
        for hypothesis in (degraded(reference, references, rng) for _ in range(copies))
    ]


def padded(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token ids (B, T), padded with pad_id, and their mask."""
    width = max(len(ids) for ids in sequences)
    ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids in sequences])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences])
    return ids, mask


def predicted(comet: Comet, batch: list[tuple[str, str, str, float]]) -> Tensor:
    """The network's scores of a batch as Comet.score computes them, with gradients."""
    network, tokens = comet.network, comet.tokens
    sources, hypotheses, references, _ = (list(column) for column in zip(*batch, strict=True))
    if comet.needs_references:
        mt, ref, src = (
            network.sentence_embeddings(*padded(tokens.encode(texts), tokens.pad_id))
            for texts in (hypotheses, references, sources)
        )
        return network.compared(mt, ref, src)
    joined = [tokens.joined(mt, src) for mt, src in zip(tokens.encode(hypotheses), tokens.encode(sources))]
    return network.joint_scores(*padded(joined, tokens.pad_id))


def trained_model(folder: Path, kind: str, data: list[tuple[str, str, str, float]]) -> Path:
    """build_comet's tiny model of ``kind``, trained on ``data`` to regress its targets, saved over its checkpoint
    under the same names (the layers the network skips keep their random weights)."""
    from mtkit.scoring.comet import Comet

    build_comet(folder, kind, seed=0)
    comet = Comet.load(str(folder))
    rng = random.Random(0)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(comet.network.parameters(), lr=LEARNING_RATE)
    for _ in range(TRAIN_STEPS):
        batch = rng.sample(data, TRAIN_BATCH)
        targets = torch.tensor([target for *_, target in batch])
        loss = torch.nn.functional.mse_loss(predicted(comet, batch), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = folder / "checkpoints" / "model.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"].update({name: value.detach() for name, value in comet.network.state_dict().items()})
    torch.save(checkpoint, path)
    return folder


def trained_agreement(scratch: Path) -> list[str]:
    """bf16 and int8 against fp32 on tiny models trained to predict chrF/100, with fp32's correlation with it."""
    from mtkit.scoring.comet import Comet

    rng = random.Random(0)
    train = chrf_segments("val", HYPOTHESES_PER_LINE, rng)
    held_out = chrf_segments("test_2016_flickr", 1, rng)[:HELD_OUT]
    sources, hypotheses, references, targets = (list(column) for column in zip(*held_out, strict=True))
    lines = [
        f"{len(train)} degraded Multi30K val captions to train on, {len(held_out)} of test_2016_flickr held out; "
        f"target chrF/100: mean {statistics.mean(targets):.2f}, sd {statistics.stdev(targets):.2f}"
    ]
    for kind in ("comet", "cometkiwi"):
        start = time.perf_counter()
        folder = trained_model(scratch / f"trained-{kind}", kind, train)
        seconds = time.perf_counter() - start
        for precision in PRECISIONS:  # fp32 first
            comet = Comet.load(str(folder), precision=precision)
            (result,) = comet.score(sources, [hypotheses], [references] if comet.needs_references else None)
            if precision == "fp32":
                fp32 = result
                r = statistics.correlation(result.segments, targets)
                lines.append(
                    f"{kind:9} fp32 system {result.system:+.6f}  Pearson r with chrF/100 {r:.3f}"
                    f"  ({TRAIN_STEPS} Adam steps of {TRAIN_BATCH}, {seconds:.0f} s)"
                )
                continue
            worst = max(abs(a - b) for a, b in zip(result.segments, fp32.segments))
            lines.append(
                f"{kind:9} {precision:4} system {result.system:+.6f}  vs mtkit fp32 {result.system - fp32.system:+.2e}"
                f" (worst segment {worst:.2e})"
            )
    return lines


# -- report ---------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    names = [line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown CPU"


def print_table(rows: list[dict], segments: int) -> None:
    baseline = {row["precision"]: row for row in rows if row["name"].startswith("unbabel")}
    header = ("load s", "score s", "seg/s", "x peer fp32", "system")
    print(f"{'implementation':26} {'precision':9} " + " ".join(f"{name:>{len(name) + 2}}" for name in header))
    for row in rows:
        rate = segments / row["score_s"]
        ratio = f"{baseline['fp32']['score_s'] / row['score_s']:.2f}" if "fp32" in baseline else "-"
        print(
            f"{row['name']:26} {row['precision']:9} {row['load_s']:8.1f} {row['score_s']:9.1f} {rate:7.2f}"
            f" {ratio:>13} {row['system']:8.4f}"
        )


def print_trained(lines: list[str]) -> None:
    print("\nbf16 and int8 against fp32, on tiny models trained to predict sentence chrF/100 (CometKiwi without")
    print("the reference):")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=500)
    parser.add_argument("--skip-peer", action="store_true", help="time mtkit only")
    parser.add_argument("--peer-python", type=Path, default=CACHE / "comet" / "bin" / "python")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the COMET-22-size model is built once")
    parser.add_argument("--trained-only", action="store_true", help="the trained tiny models' precisions alone")
    parser.add_argument("--peer-predict", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_predict:
        peer_predict(*args.peer_predict)
        return
    if args.trained_only:
        with tempfile.TemporaryDirectory() as scratch:
            print_trained(trained_agreement(Path(scratch)))
        return
    if not args.skip_peer and not args.peer_python.exists():
        raise SystemExit(f"error: no peer environment at {args.peer_python}: run benchmarks/comet_peer_env.sh")
    texts = {side: read_lines(name, args.segments) for side, name in FILES.items()}
    folder = cached_model(args.cache)
    segments = len(texts["sources"])
    with tempfile.TemporaryDirectory() as scratch:
        rows = [] if args.skip_peer else run_peer(args.peer_python, folder, texts, Path(scratch))
        rows += run_mtkit(folder, texts)
        agreement = precision_agreement(Path(scratch))
        trained = trained_agreement(Path(scratch))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder / "encoder"))
    tokens = sum(len(tokenizer(line)["input_ids"]) for side in texts.values() for line in side) / (3 * segments)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(
        f"{segments} segments of WMT22 en-de (src.en, ref.B.de as the system, ref.A.de as the reference); "
        f"a COMET-22-size model with random weights; its tokenizer a SentencePiece model trained on those "
        f"files, not XLM-R's: {tokens:.1f} tokens a segment"
    )
    print("load s: import and load; score s: scoring alone; x peer fp32: unbabel-comet predict()'s score s over this")
    print_table(rows, segments)
    print("\nbf16 and int8 against fp32, on the tiny random fixture models (tests/comet_fixture.py):")
    print("\n".join(agreement))
    print_trained(trained)


if __name__ == "__main__":
    main()
