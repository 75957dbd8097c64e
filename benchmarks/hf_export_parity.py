"""How closely a model exported with `mtkit export --format hf` translates as mtkit does; key=value lines.

Exports MODEL, translates the test set with transformers' beam search as its users run it, with the
export's generation_config (the run's beam and length penalty): ``pipeline("translation")`` where the
installed transformers has that task (4.x), else ``generate`` on batches of the same size. mtkit
translates it too, and sacreBLEU scores both; then greedy token ids are compared on the first
--greedy-lines lines, each line under mtkit's length cap. Last, CTranslate2's own converter
(``ct2-transformers-converter``) converts the export, and CTranslate2 translates the test set with
its ``translate_batch`` (the same beam and length penalty) and the greedy lines.

    python benchmarks/hf_export_parity.py --model runs/earlier/average-last3.safetensors \\
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

from mtkit.data.parallel import source_tensor  # noqa: E402
from mtkit.decoding.line_translator import Translator  # noqa: E402
from mtkit.decoding.search import greedy_search, max_lengths  # noqa: E402
from mtkit.interop.hf_export import export_transformers, transformers_length_penalty  # noqa: E402
from mtkit.model.loading import load_for_inference  # noqa: E402
from mtkit.scoring.metrics import corpus_scores  # noqa: E402


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def has_pipeline() -> bool:
    return "translation" in transformers.pipelines.SUPPORTED_TASKS


def transformers_translations(hf_dir: Path, lines: list[str], batch_size: int, lenpen: float) -> list[str]:
    """Beam search as the export's generation_config says, ``lenpen`` its length penalty."""
    if has_pipeline():
        translate = transformers.pipeline("translation", model=str(hf_dir), device="cpu")
        return [out["translation_text"] for out in translate(lines, batch_size=batch_size, length_penalty=lenpen)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    out = []
    for start in range(0, len(lines), batch_size):
        batch = tokenizer(lines[start : start + batch_size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out += tokenizer.batch_decode(model.generate(**batch, length_penalty=lenpen), skip_special_tokens=True)
    return out


def mtkit_greedy(bundle, lines: list[str]) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """mtkit's greedy ids for ``lines``, and the lines grouped by their cap on generated tokens: (cap, rows)."""
    d = bundle.cfg.decode
    src, src_pad_mask = source_tensor(bundle.src_tok.encode(lines))
    caps = max_lengths(src_pad_mask, d.max_len_a, d.max_len_b, bundle.cfg.model.max_positions)
    groups = [(cap, (caps == cap).nonzero().flatten().tolist()) for cap in caps.unique().tolist()]
    return greedy_search(bundle.model, src, src_pad_mask), groups


def greedy_agreement(hf_dir: Path, bundle, lines: list[str]) -> tuple[int, int]:
    """(lines whose greedy token ids are equal, lines), transformers under mtkit's per-sentence cap."""
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    expected, groups = mtkit_greedy(bundle, lines)
    same = 0
    for cap, rows in groups:
        batch = tokenizer([lines[row] for row in rows], return_tensors="pt", padding=True)
        with torch.inference_mode():
            generated = model.generate(**batch, num_beams=1, max_new_tokens=cap)
        for row, ids in zip(rows, generated.tolist()):
            same += [t for t in ids[1:] if t not in (model.config.pad_token_id, 3)] == expected[row]
    return same, len(lines)


def ctranslate2_run(hf_dir: Path, out_dir: Path, bundle, src: list[str], ref: list[str], lenpen: float, args) -> None:
    """Convert with CTranslate2's own converter; print its beam BLEU (length ** ``lenpen``) and greedy agreement."""
    try:
        import ctranslate2.converters
    except ImportError:
        print("ctranslate2_converter=skipped (no ctranslate2)")
        return
    try:
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out_dir), force=True)
    except Exception as err:  # report what the converter says, whatever it is
        print(f"ctranslate2_converter=failed: {str(err).splitlines()[-1]}")
        return
    print(f"ctranslate2_converter=ok ctranslate2_version={ctranslate2.__version__}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    settings = transformers.GenerationConfig.from_pretrained(hf_dir)
    translator = ctranslate2.Translator(str(out_dir), device="cpu", intra_threads=args.threads)
    banned = [[piece] for piece in tokenizer.convert_ids_to_tokens(settings.suppress_tokens)]

    def translate(lines: list[str], **options) -> list[list[str]]:
        pieces = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(lines)["input_ids"]]
        options.update(max_batch_size=args.batch_size, suppress_sequences=banned)
        return [result.hypotheses[0] for result in translator.translate_batch(pieces, **options)]

    start = time.perf_counter()
    hyps = [
        tokenizer.convert_tokens_to_string(pieces)
        for pieces in translate(src, beam_size=settings.num_beams, length_penalty=lenpen)
    ]
    print(f"ctranslate2_seconds={time.perf_counter() - start:.1f}")
    print(f"ctranslate2_beam_bleu={corpus_scores(hyps, [ref], ('bleu',))[0].value:.2f}")
    if not args.greedy_lines:
        return
    lines = src[: args.greedy_lines]
    expected, groups = mtkit_greedy(bundle, lines)
    same = 0
    for cap, rows in groups:
        outputs = translate([lines[row] for row in rows], beam_size=1, max_decoding_length=cap - 1)
        same += sum(tokenizer.convert_tokens_to_ids(out) == expected[row] for row, out in zip(rows, outputs))
    print(f"ctranslate2_greedy_same_ids={same}/{len(lines)}")


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
        lenpen = transformers_length_penalty(decode.lenpen)
        print(f"transformers_path={'pipeline' if has_pipeline() else 'generate'} transformers_length_penalty={lenpen}")
        hf_hyps = transformers_translations(hf_dir, src, args.batch_size, lenpen)
        print(f"transformers_seconds={time.perf_counter() - start:.1f}")
        mtkit_bleu = corpus_scores(mtkit_hyps, [ref], ("bleu",))[0]
        hf_bleu = corpus_scores(hf_hyps, [ref], ("bleu",))[0]
        print(f"lines={len(src)} bleu_signature={hf_bleu.signature}")
        print(f"mtkit_beam_bleu={mtkit_bleu.value:.2f}")
        print(f"transformers_beam_bleu={hf_bleu.value:.2f}")
        print(f"bleu_difference={hf_bleu.value - mtkit_bleu.value:+.2f}")
        print(f"beam_same_text={sum(h == m for h, m in zip(hf_hyps, mtkit_hyps))}/{len(src)}")
        if args.greedy_lines:
            same, n = greedy_agreement(hf_dir, bundle, src[: args.greedy_lines])
            print(f"greedy_same_ids={same}/{n} greedy_agreement={100 * same / n:.1f}%")
        ctranslate2_run(hf_dir, Path(tmp) / "ct2", bundle, src, ref, lenpen, args)


if __name__ == "__main__":
    main()
