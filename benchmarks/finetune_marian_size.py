"""Fine-tuning an imported Marian model of OPUS-MT's size on this machine: speed, loss, and what still works after.

No model is downloaded: transformers builds a MarianMTModel of opus-mt-en-de's shape (6 + 6 layers, d_model 512,
8 heads, FFN 2048, swish, 58,101 shared pieces) with random weights, beside SentencePiece models trained on the
training slice and a vocab.json laid out as OPUS-MT's. `mtkit train` then fine-tunes it (train.init_from: hf:FOLDER)
on a slice of Multi30k; the script prints key=value lines: seconds per update, the validation loss at the first
and last validation, and whether the fine-tuned model's transformers export and CTranslate2 export give mtkit's
greedy output on the first validation lines.

    python benchmarks/finetune_marian_size.py --data ../shared/data/multi30k --pairs 5000 --updates 200
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sentencepiece  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from mtkit.config import TokenizerConfig  # noqa: E402
from mtkit.data.tokenizer import train_spm  # noqa: E402

OPUS_MT_EN_DE = {
    "encoder_layers": 6,
    "decoder_layers": 6,
    "d_model": 512,
    "encoder_attention_heads": 8,
    "decoder_attention_heads": 8,
    "encoder_ffn_dim": 2048,
    "decoder_ffn_dim": 2048,
    "max_position_embeddings": 512,
    "activation_function": "swish",
    "scale_embedding": True,
    "vocab_size": 58_101,
}


def read(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def marian_folder(folder: Path, train: dict[str, list[str]]) -> None:
    """A MarianMTModel folder of opus-mt-en-de's shape: random weights, tokenizers trained on ``train``."""
    folder.mkdir(parents=True)
    pieces: list[str] = []
    for name, lang in (("source", "en"), ("target", "de")):
        model = train_spm(train[lang], folder / name, TokenizerConfig(vocab_size=3000))
        model.rename(folder / f"{name}.spm")
        sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / f"{name}.spm"))
        pieces += [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]
    size = OPUS_MT_EN_DE["vocab_size"]
    names = ["</s>", "<unk>", *dict.fromkeys(pieces)]
    names += [f"▁unused{i}" for i in range(size - 1 - len(names))] + ["<pad>"]
    (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(names)}, ensure_ascii=False))
    pad = size - 1
    config = transformers.MarianConfig(
        **OPUS_MT_EN_DE, pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0
    )
    torch.manual_seed(1)
    transformers.MarianMTModel(config).save_pretrained(folder)
    transformers.MarianTokenizer(
        source_spm=str(folder / "source.spm"), target_spm=str(folder / "target.spm"), vocab=str(folder / "vocab.json")
    ).save_pretrained(folder)


def mtkit(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "mtkit", *args], check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/multi30k"))
    parser.add_argument("--pairs", type=int, default=5000, help="training pairs, the first of Multi30k's train")
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--greedy-lines", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = {}
        for split, n in (("train", args.pairs), ("val", 200)):
            for lang in ("en", "de"):
                lines = read(args.data / f"{split}.{lang}.gz", n)
                (root / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
                data[f"{split}.{lang}"] = lines
        marian_folder(root / "marian", {"en": data["train.en"], "de": data["train.de"]})
        config = {
            "data": {
                **{k: str(root / f) for k, f in (("train_src", "train.en"), ("train_tgt", "train.de"))},
                **{k: str(root / f) for k, f in (("valid_src", "val.en"), ("valid_tgt", "val.de"))},
            },
            "train": {
                "init_from": f"hf:{root / 'marian'}",
                "schedule": "constant",
                "lr": 2e-4,
                "warmup": 20,
                "max_steps": args.updates,
                "batch_tokens": 2048,
                "valid_every": args.updates // 2,
                "save_every": args.updates // 2,
                "valid_bleu": False,
                "best_metric": "loss",
                "log_every": 10,
            },
        }
        (root / "c.yaml").write_text(json.dumps(config))
        start = time.perf_counter()
        mtkit("train", str(root / "c.yaml"), "--out", str(root / "run"))
        seconds = time.perf_counter() - start
        events = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        valid = [e for e in events if e["event"] == "valid"]
        print(f"model=opus-mt-en-de shape, random weights, imported  pairs={args.pairs}  updates={args.updates}")
        print(f"precision={events[0]['precision']}  hardware={events[0]['hardware']!r}")
        print(f"seconds_per_update={seconds / args.updates:.2f}  (the whole command, import and validation included)")
        print(f"valid_nll_first={valid[0]['valid_nll']:.3f}@{valid[0]['step']}  last={valid[-1]['valid_nll']:.3f}")
        lines = root / "greedy.en"
        lines.write_text("\n".join(data["val.en"][: args.greedy_lines]) + "\n", encoding="utf-8")
        ours = mtkit("translate", str(root / "run"), "-i", str(lines), "--beam", "1", "--precision", "fp32")
        mtkit("export", str(root / "run"), "-o", str(root / "ct2"))
        theirs = mtkit("translate", str(root / "ct2"), "-i", str(lines), "--beam", "1", "--engine", "ctranslate2")
        print(f"ctranslate2_export_greedy_equal={ours == theirs}")
        mtkit("export", str(root / "run"), "--format", "hf", "-o", str(root / "hf"))
        hf = transformers.MarianMTModel.from_pretrained(root / "hf")
        print(f"transformers_export_loads={hf.config.activation_function == 'swish'}")


if __name__ == "__main__":
    main()
