"""How closely a model exported with `mtkit export --format hf` translates as mtkit does; key=value lines.

Exports MODEL, translates the test set with transformers' beam search (generate, in batches, the
export's generation_config: the run's beam and length penalty) and with mtkit's, and scores both with
sacreBLEU; then compares greedy token ids on the first --greedy-lines lines, each line under mtkit's
length cap. Last, it tries CTranslate2's own converter (ct2-transformers-converter) on the export.

    python benchmarks/hf_export_parity.py --model runs/multi30k_en_de/average-last3.safetensors \\
        --src ../shared/data/multi30k/test_2016_flickr.en.gz --ref ../shared/data/multi30k/test_2016_flickr.de.gz
"""

from __future__ import annotations

import argparse
import gzip
import os
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

from mtkit.checkpoint import load_for_inference  # noqa: E402
from mtkit.data import source_tensor  # noqa: E402
from mtkit.export_hf import export_transformers  # noqa: E402
from mtkit.metrics import score  # noqa: E402
from mtkit.search import greedy_search, max_lengths  # noqa: E402
from mtkit.translate import Translator  # noqa: E402


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def transformers_translations(hf_dir: Path, lines: list[str], batch_size: int, lenpen: float) -> list[str]:
    """Beam search as the export's generation_config says (with ``lenpen`` as its length penalty), batch by
    batch, as pipeline("translation") did."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    out = []
    for start in range(0, len(lines), batch_size):
        batch = tokenizer(lines[start : start + batch_size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out += tokenizer.batch_decode(model.generate(**batch, length_penalty=lenpen), skip_special_tokens=True)
    return out


def greedy_agreement(hf_dir: Path, bundle, lines: list[str]) -> tuple[int, int]:
    """(lines whose greedy token ids are equal, lines), transformers under mtkit's per-sentence cap."""
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    d = bundle.cfg.decode
    src, src_pad_mask = source_tensor(bundle.src_tok.encode(lines))
    expected = greedy_search(bundle.model, src, src_pad_mask)
    caps = max_lengths(src_pad_mask, d.max_len_a, d.max_len_b, bundle.cfg.model.max_positions)
    same = 0
    for cap in caps.unique().tolist():
        rows = (caps == cap).nonzero().flatten()
        with torch.inference_mode():
            generated = model.generate(
                input_ids=src[rows], attention_mask=~src_pad_mask[rows], num_beams=1, max_new_tokens=cap
            )
        for row, ids in zip(rows.tolist(), generated.tolist()):
            same += [t for t in ids[1:] if t not in (0, 3)] == expected[row]
    return same, len(lines)


def ctranslate2_conversion(hf_dir: Path, out_dir: Path) -> str:
    try:
        import ctranslate2.converters
    except ImportError:
        return "skipped (no ctranslate2)"
    try:
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out_dir), force=True)
    except Exception as err:  # report what the converter says, whatever it is
        return f"failed: {str(err).splitlines()[-1]}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--greedy-lines", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lenpen", type=float, help="length penalty for both (default: the run's)")
    parser.add_argument(
        "--same-search",
        action="store_true",
        help="mtkit searches until beam hypotheses have ended, as transformers does (decode.early_stop false)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "Recommended: pip install sacremoses")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    src, ref = read_lines(args.src), read_lines(args.ref)
    bundle = load_for_inference(args.model, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export_transformers(args.model, Path(tmp) / "hf")
        print(f"model={args.model}")
        print(f"transformers_version={transformers.__version__}")
        decode = bundle.cfg.decode
        decode = replace(decode, lenpen=decode.lenpen if args.lenpen is None else args.lenpen)
        decode = replace(decode, early_stop=decode.early_stop and not args.same_search)
        print(f"decode_beam={decode.beam} decode_lenpen={decode.lenpen} mtkit_early_stop={decode.early_stop}")
        start = time.perf_counter()
        translator = Translator(bundle.model, bundle.src_tok, bundle.tgt_tok, decode, torch.device("cpu"))
        mtkit_hyps = [t[0].text for t in translator.stream([src])]
        print(f"mtkit_seconds={time.perf_counter() - start:.1f}")
        start = time.perf_counter()
        hf_hyps = transformers_translations(hf_dir, src, args.batch_size, decode.lenpen)
        print(f"transformers_seconds={time.perf_counter() - start:.1f}")
        mtkit_bleu = score(mtkit_hyps, [ref], ("bleu",))[0]
        hf_bleu = score(hf_hyps, [ref], ("bleu",))[0]
        print(f"lines={len(src)} bleu_signature={hf_bleu.signature}")
        print(f"mtkit_beam_bleu={mtkit_bleu.value:.2f}")
        print(f"transformers_beam_bleu={hf_bleu.value:.2f}")
        print(f"bleu_difference={hf_bleu.value - mtkit_bleu.value:+.2f}")
        print(f"beam_same_text={sum(h == m for h, m in zip(hf_hyps, mtkit_hyps))}/{len(src)}")
        if args.greedy_lines:
            same, n = greedy_agreement(hf_dir, bundle, src[: args.greedy_lines])
            print(f"greedy_same_ids={same}/{n} greedy_agreement={100 * same / n:.1f}%")
        print(f"ctranslate2_converter={ctranslate2_conversion(hf_dir, Path(tmp) / 'ct2')}")


if __name__ == "__main__":
    main()
