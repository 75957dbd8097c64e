"""Where a decoding step's time goes: mtkit's beam search over Multi30k test sentences, at one precision.

Two views of the same translation of the first ``--lines`` test_2016_flickr sentences (after one untimed pass):

- by part of the model: wall-clock seconds inside the encoder, the decoder (embedding, layers, cache), the
  output projection (forward hooks), and the rest of the search (log-softmax, top-k, cache reordering);
- by operator: torch.profiler's self CPU time of each aten operator, the largest first.

    python benchmarks/decode_profile.py --run runs/multi30k_en_de --precision int8
    python benchmarks/decode_profile.py --run runs/multi30k_en_de --precision fp32 --shortlist runs/sl.safetensors

Output: the two tables, then one ``decode_profile key=value ...`` line of the parts' seconds. With
``--fixed-steps N``, only the median milliseconds of a decoder step of fixed shapes instead (128 sentences x
beam rows, N steps from bos): the yardstick for one change to the step. ``--preset NAME`` times instead a model
of that preset's shape with random weights and the run's vocabulary and positions: what each shape costs per
decoded token, whose time does not depend on the weights' values.

    python benchmarks/decode_profile.py --run runs/multi30k_en_de --fixed-steps 20 --preset student-micro
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from mtkit.config import PRESETS, DecodeConfig
from mtkit.data.parallel import read_lines, source_tensor
from mtkit.data.tokenizer import BOS_ID, PAD_ID
from mtkit.decoding.line_translator import Translator
from mtkit.decoding.shortlist import load_shortlist
from mtkit.model.attention import DecoderCache
from mtkit.model.loading import load_for_inference
from mtkit.model.quantization import quantize_int8
from mtkit.model.transformer import Transformer, build_model, count_parameters
from mtkit.runtime import DTYPES, resolve_precision, set_threads

REPO = Path(__file__).resolve().parents[1]


class PartClock:
    """Seconds spent in the encoder, the decoder and the output projection (with a shortlist, its cut of the
    output layer): forward hooks on the first two, and the decoding step (``decode``) less its decoder."""

    def __init__(self, model: Transformer) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._started: dict[str, float] = {}
        for name, module in (("encoder", model.encoder), ("decoder", model.decoder)):
            module.register_forward_pre_hook(lambda *_, name=name: self._start(name))
            module.register_forward_hook(lambda *_, name=name: self._stop(name))
        decode = model.decode

        def timed_decode(*args, **kwargs):
            start, decoder_before = time.perf_counter(), self.seconds["decoder"]
            logits = decode(*args, **kwargs)
            decoder = self.seconds["decoder"] - decoder_before
            self.seconds["output_projection"] += time.perf_counter() - start - decoder
            self.steps += 1
            return logits

        model.decode = timed_decode

    def _start(self, name: str) -> None:
        self._started[name] = time.perf_counter()

    def _stop(self, name: str) -> None:
        self.seconds[name] += time.perf_counter() - self._started.pop(name)


def fixed_steps(model: Transformer, src: torch.Tensor, mask: torch.Tensor, beam: int, steps: int) -> float:
    """Seconds of ``steps`` cached decoder steps of every sentence's ``beam`` rows from bos, with the output
    projection and log-softmax: a step of fixed shapes, so that one change to it can be timed alone."""
    with torch.inference_mode():
        memory = model.encode(src, mask)
        cache = DecoderCache()
        tokens = torch.full((src.size(0) * beam, 1), BOS_ID)
        start = time.perf_counter()
        for _ in range(steps):
            torch.log_softmax(model.decode(tokens, memory, mask, cache)[:, -1].float(), dim=-1)
        return time.perf_counter() - start


def preset_model(bundle, preset: str, precision: str) -> tuple[Transformer, int]:
    """A model of ``preset``'s shape with random weights, the run's vocabulary and other model settings, and its
    parameter count (taken before int8 quantization turns the weights into buffers)."""
    cfg = replace(bundle.cfg.model, **PRESETS[preset])
    model = build_model(cfg, bundle.src_tok.vocab_size, bundle.tgt_tok.vocab_size, PAD_ID)
    parameters = count_parameters(model)
    model.to(dtype=DTYPES[precision]).eval()
    if precision == "int8":
        quantize_int8(model)
    return model, parameters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="trained run directory (its best/)")
    p.add_argument("--precision", choices=["fp32", "bf16", "int8"], default="fp32")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lines", type=int, default=256, help="test sentences translated")
    p.add_argument("--shortlist", type=Path, help="a file `mtkit shortlist` wrote")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    p.add_argument("--top", type=int, default=15, help="operators listed")
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "multi30k")
    p.add_argument(
        "--fixed-steps",
        type=int,
        default=0,
        help="instead: time this many decoder steps of the first 128 lines x beam from bos, --repeat times",
    )
    p.add_argument("--repeat", type=int, default=7, help="repeats of --fixed-steps; the median is reported")
    p.add_argument("--preset", choices=list(PRESETS), help="with --fixed-steps: time this shape, random weights")
    args = p.parse_args()
    if args.preset and not args.fixed_steps:
        p.error("--preset times fixed steps: give --fixed-steps")

    set_threads(args.threads)
    device = torch.device("cpu")
    precision = resolve_precision(args.precision, device).precision
    bundle = load_for_inference(args.run, device, precision)
    lexical = load_shortlist(args.shortlist, bundle.src_tok, bundle.tgt_tok) if args.shortlist else None
    model = bundle.model
    translator = Translator(
        model, bundle.src_tok, bundle.tgt_tok, DecodeConfig(beam=args.beam), device, shortlist=lexical
    )
    lines = read_lines(args.data_dir / "test_2016_flickr.en.gz")[: args.lines]
    shape = "preset=run "
    if args.preset:
        model, parameters = preset_model(bundle, args.preset, precision)
        shape = f"preset={args.preset} parameters={parameters} "
    if args.fixed_steps:
        src, mask = source_tensor(bundle.src_tok.encode(lines[:128]))
        fixed_steps(model, src, mask, args.beam, args.fixed_steps)  # untimed
        seconds = [fixed_steps(model, src, mask, args.beam, args.fixed_steps) for _ in range(args.repeat)]
        step_ms = statistics.median(seconds) / args.fixed_steps * 1e3
        print(f"decode_step {shape}precision={args.precision} rows={src.size(0) * args.beam} ms_per_step={step_ms:.2f}")
        return
    translator.translate(lines)  # untimed: kernels chosen, memory pools grown

    clock = PartClock(model)
    start = time.perf_counter()
    translator.translate(lines)
    total = time.perf_counter() - start
    parts = dict(clock.seconds)
    parts["search_rest"] = total - sum(parts.values())
    steps = clock.steps
    print(f"{args.precision}, beam {args.beam}, {len(lines)} sentences: {total:.2f} s, {steps} decoder steps")
    print(f"{'part':<20} {'seconds':>8} {'share':>7} {'ms/step':>8}")
    for name, seconds in parts.items():
        print(f"{name:<20} {seconds:8.3f} {seconds / total:7.1%} {seconds / max(steps, 1) * 1e3:8.3f}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        translator.translate(lines)
    events = prof.key_averages()
    self_total = sum(e.self_cpu_time_total for e in events)
    print(f"\n{'operator':<40} {'self ms':>9} {'share':>7} {'calls':>7}")
    for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]:
        share = event.self_cpu_time_total / self_total
        print(f"{event.key:<40} {event.self_cpu_time_total / 1e3:9.1f} {share:7.1%} {event.count:7d}")
    figures = " ".join(f"{name}={seconds:.3f}" for name, seconds in parts.items())
    shortlist = "on" if args.shortlist else "off"
    print(
        f"\ndecode_profile precision={args.precision} beam={args.beam} shortlist={shortlist} lines={len(lines)}", end=""
    )
    print(f" total={total:.3f} {figures}")


if __name__ == "__main__":
    main()
