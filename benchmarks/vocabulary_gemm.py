"""The product of decoding's features with the output weights, by library: what ``mtkit.runtime.fp32_vocabulary_gemm``
(and in bf16, ``bf16_decoding_gemm``, for every layer) chooses between, timed on this CPU.

For each number of rows (a decoding step: one sentence's 1 or 5 beams, a greedy batch, 128 sentences' beams)
and each model width and vocabulary, the median microseconds of ``F.linear`` (ATen: MKL on x86) with the
weights as a model stores them (V, D), ATen with a copy stored by columns (D, V), and oneDNN over a copy packed
once (``mtkit.model.linear.onednn_linear``, what decoding runs on x86 CPUs not made by Intel). ``same_rows``
says whether each library gives a row the same bits alone as among 640 rows.

    python benchmarks/vocabulary_gemm.py
    python benchmarks/vocabulary_gemm.py --rows 1,5 --widths 512 --vocab 32000 --threads 1
    python benchmarks/vocabulary_gemm.py --precision bf16 --widths 160,256 --vocab 8000,512,1024

In bf16 the "vocabulary" may be any layer's output width (512 or 1,024: a feed-forward layer's first product).

Output: a table (ratio: ATen's time over oneDNN's), then one ``vocabulary_gemm ...`` line per shape with every
figure as key=value.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtkit.model.linear import onednn_linear
from mtkit.runtime import (
    DTYPES,
    bf16_decoding_gemm,
    cpu_features,
    cpu_name,
    cpu_vendor,
    fp32_vocabulary_gemm,
    set_threads,
)

MOST_ROWS = 640  # 128 sentences x beam 5: the rows same_rows compares against


def microseconds(product: Callable[[], torch.Tensor], seconds: float = 0.2) -> float:
    """Median time of one call over five rounds of about ``seconds`` each, after a warm-up."""
    for _ in range(3):
        product()
    start = time.perf_counter()
    product()
    calls = max(3, int(seconds / max(time.perf_counter() - start, 1e-6)))
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            product()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def comma_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=comma_ints, default=[1, 5, 64, MOST_ROWS], help="rows per product, e.g. 1,5,64")
    p.add_argument("--widths", type=comma_ints, default=[128, 256], help="model widths (d_model)")
    p.add_argument("--vocab", type=comma_ints, default=[8000], help="vocabulary sizes")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="weights' and features' type")
    args = p.parse_args()
    set_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("error: this torch has no oneDNN (torch.backends.mkldnn)")
    dtype = DTYPES[args.precision]
    if args.precision == "bf16":
        chosen = bf16_decoding_gemm(cpu_vendor(), cpu_features())
    else:
        chosen = fp32_vocabulary_gemm(cpu_vendor())
    where = f"{cpu_name()} ({cpu_vendor()}), {torch.get_num_threads()} threads, {args.precision}"
    print(f"{where}; decoding here uses: {chosen}")
    print(f"{'rows':>5} {'width':>6} {'vocab':>7} {'aten us':>10} {'by columns':>11} {'onednn':>10} {'ratio':>7}")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for vocab in args.vocab:
        for width in args.widths:
            weight = (torch.randn(vocab, width, generator=generator) * width**-0.5).to(dtype)
            by_columns = weight.t().contiguous().t()
            packed = onednn_linear(weight, None)
            everything = torch.randn(max(MOST_ROWS, *args.rows), width, generator=generator).to(dtype)
            same = {
                "aten": torch.equal(F.linear(everything[:1], weight), F.linear(everything, weight)[:1]),
                "onednn": torch.equal(packed(everything[:1]), packed(everything)[:1]),
            }
            for rows in args.rows:
                x = everything[:rows]
                aten = microseconds(lambda x=x, w=weight: F.linear(x, w))
                columns = microseconds(lambda x=x, w=by_columns: F.linear(x, w))
                onednn = microseconds(lambda x=x, product=packed: product(x))
                figures = f"{aten:10.1f} {columns:11.1f} {onednn:10.1f} {aten / onednn:7.2f}"
                print(f"{rows:5d} {width:6d} {vocab:7d} {figures}")
                lines.append(
                    f"vocabulary_gemm precision={args.precision} rows={rows} width={width} vocab={vocab} "
                    f"aten_us={aten:.1f} by_columns_us={columns:.1f} onednn_us={onednn:.1f} "
                    f"same_rows_aten={same['aten']} same_rows_onednn={same['onednn']} chosen={chosen}"
                )
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
