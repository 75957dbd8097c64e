"""Fine-tuning a model of NLLB-200-distilled-600M's shape on this machine, in full and with LoRA: peak memory, an
update's time and the parameters that train.

No model is downloaded: transformers builds an M2M100ForConditionalGeneration of nllb-200-distilled-600M's shape
(12 + 12 layers, d_model 1024, 16 heads, FFN 4096, 256,206 shared embedding rows, 1,024 positions) with random
weights, beside a SentencePiece BPE model trained on the training slice (fairseq's layout) and NllbTokenizer's files
with its 202 language codes. `mtkit import hf` imports it, and `mtkit train` fine-tunes the import (train.init_from)
on a Multi30k slice, eng_Latn -> deu_Latn: once with every weight training, once with LoRA adapters. Each training
runs under `/usr/bin/time -v`: its peak is the training process's maximum resident set size; an update's time is the
median of metrics.jsonl's seconds_per_update after the first update. Prints a markdown table, and the time the
import took to translate a few lines.

    python benchmarks/finetune_nllb_size.py --data ../shared/data/multi30k --updates 4
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sentencepiece  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

NLLB_600M = {  # facebook/nllb-200-distilled-600M's config.json, the fields that decide its size
    "vocab_size": 256_206,
    "d_model": 1024,
    "encoder_layers": 12,
    "decoder_layers": 12,
    "encoder_attention_heads": 16,
    "decoder_attention_heads": 16,
    "encoder_ffn_dim": 4096,
    "decoder_ffn_dim": 4096,
    "max_position_embeddings": 1024,
    "activation_function": "relu",
    "scale_embedding": True,
    "dropout": 0.1,
    "attention_dropout": 0.1,
    "activation_dropout": 0.0,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
}


def read(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def nllb_folder(folder: Path, lines: list[str], pieces: int) -> None:
    """An NLLB-200 folder of nllb-200-distilled-600M's shape: random weights, its tokenizer trained on ``lines``."""
    import transformers
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    spm_dir = folder.parent / "spm"
    spm_dir.mkdir(parents=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=pieces, model_type="bpe",
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    (spm_dir / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    tokenizer = transformers.NllbTokenizer.from_pretrained(
        spm_dir, extra_special_tokens=list(FAIRSEQ_LANGUAGE_CODES), src_lang="eng_Latn"
    )
    tokenizer.save_pretrained(folder)
    shutil.copy(spm_dir / "sentencepiece.bpe.model", folder / "sentencepiece.bpe.model")
    torch.manual_seed(0)
    hf = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**NLLB_600M))
    hf.save_pretrained(folder)


def mtkit_cli(*args: str, log: Path) -> None:
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "mtkit", *args], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"mtkit {args[0]} failed: see {log}")


def train(work: Path, name: str, imported: Path, data: dict[str, Path], args, lora: dict | None) -> dict:
    """One fine-tuning of ``args.updates`` updates under /usr/bin/time -v: its peak resident memory, its updates'
    median time after the first, and the parameters it trained, from its log."""
    config = {
        "data": {
            "train_src": str(data["en"]), "train_tgt": str(data["de"]), "src_lang": "eng_Latn",
            "tgt_lang": "deu_Latn", "max_tokens": 100, "cache_dir": str(work / "cache"),
        },
        "train": {
            "init_from": str(imported), "max_steps": args.updates, "batch_tokens": args.batch_tokens,
            "schedule": "constant", "lr": 0.0001, "warmup": 1, "log_every": 1, "save_every": args.updates,
            "keep_last": 1, "precision": args.precision, **({"lora": lora} if lora else {}),
        },
    }  # fmt: skip
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    run, log = work / name, work / f"{name}.log"
    with open(log, "w") as out:
        command = ["/usr/bin/time", "-v", sys.executable, "-m", "mtkit", "train", str(path), "--out", str(run)]
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    if done.returncode:
        sys.exit(f"training {name} failed: see {log}")
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)[1])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds_per_update"] for r in records if r.get("event") == "train" and r["step"] > 1]
    trainable = re.search(r"([\d,]+) of the model's ([\d,]+) parameters train", text)
    return {
        "peak_gib": peak_kib / 2**20,
        "seconds": statistics.median(seconds),
        "trainable": trainable[1] if trainable else "?",
        "total": trainable[2] if trainable else "?",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/multi30k"))
    parser.add_argument("--pairs", type=int, default=2000, help="training pairs read from Multi30k's train split")
    parser.add_argument(
        "--pieces", type=int, default=8000, help="SentencePiece pieces (the rest of the 256,206 rows are unused)"
    )
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (targets: attention and ffn)")
    parser.add_argument("--work", type=Path, default=None, help="where the folders go (a temporary folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="nllb-size-"))
    work.mkdir(parents=True, exist_ok=True)
    data = {lang: work / f"train.{lang}" for lang in ("en", "de")}
    lines = {lang: read(args.data / f"train.{lang}.gz", args.pairs) for lang in data}
    for lang, path in data.items():
        path.write_text("\n".join(lines[lang]) + "\n", encoding="utf-8")
    folder = work / "nllb-600m-shape"
    nllb_folder(folder, lines["en"] + lines["de"], args.pieces)
    imported = work / "imported"
    mtkit_cli("import", "hf", str(folder), "-o", str(imported), "--src-lang", "eng_Latn", "--tgt-lang", "deu_Latn",
              log=work / "import.log")  # fmt: skip
    shutil.rmtree(folder)  # 2.4 GB the trainings do not read
    sample = work / "sample.en"
    sample.write_text("\n".join(read(args.data / "val.en.gz", 5)) + "\n", encoding="utf-8")
    started = time.perf_counter()
    languages = ["--src-lang", "eng_Latn", "--tgt-lang", "deu_Latn"]
    search = ["--beam", "4", "--max-len-a", "0", "--max-len-b", "20"]
    output = ["-i", str(sample), "-o", str(work / "sample.de")]
    mtkit_cli("translate", str(imported), *languages, *search, *output, log=work / "translate.log")
    translated = time.perf_counter() - started
    outputs = (work / "sample.de").read_text(encoding="utf-8").splitlines()
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank, "targets": ["attention", "ffn"]}
    results = {
        "full fine-tuning": train(work, "full", imported, data, args, None),
        f"LoRA rank {args.rank} (attention, ffn)": train(work, "lora", imported, data, args, lora),
    }
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = re.search(r"Model name:\s*(.+)", cpu)
    print(f"{model_name[1] if model_name else 'CPU'}, torch {torch.__version__}, precision {args.precision}, "
          f"{args.updates} updates of {args.batch_tokens} tokens")  # fmt: skip
    print("| | parameters trained | peak memory (max RSS) | an update |")
    print("| --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['trainable']} of {r['total']} | {r['peak_gib']:.1f} GiB | {r['seconds']:.1f} s |")
    shown = f"{len(outputs)} lines (beam 4, at most 20 tokens each)"
    print(f"the import translated {shown} in {translated:.1f} s, its start-up included")


if __name__ == "__main__":
    main()
