#!/usr/bin/env bash
# Domain adaptation with train.init_from: a model trained on one domain, adapted to a little in-domain data by
# fine-tuning every weight, by LoRA adapters at two ranks and by train.freeze, against the same model unadapted and
# against a model trained on the in-domain data alone.
#
#   benchmarks/finetune_domain.sh RUN [OUT]
#
# RUN is an English->German mtkit model trained on Multi30k (captions): `mtkit run recipes/multi30k_en_de.yaml`.
# The in-domain data is the WMT22 general test set (news, e-commerce, social, conversation), read from
# ../shared/data/wmt22 (WMT22 below): its first 1,000 segments are split into 900 for training and 100 for
# validation, the other 1,037 are the test set, scored with reference A. Segments are in document order,
# so no document is in both halves except the one the cut falls in. Prints a markdown table, a row per system:
# test sacreBLEU and chrF, the parameters that trained, the training process's peak resident memory (max RSS,
# /usr/bin/time -v), the median seconds an update took (metrics.jsonl's seconds_per_update) and the updates.
#
# Every training gets the same budget, STEPS updates of the same batches' size, validated and saved at the same
# updates, and is translated from its best/: a comparison at unequal budgets would credit one system with another's
# extra updates.
#
# Settings (environment): STEPS (500, for each training), FINETUNE_LR (0.0002, full fine-tuning and train.freeze),
# LORA_LR (0.001), LORA_RANKS ("8 32"; alpha is twice the rank, targets attention and ffn), FREEZE ("[embeddings,
# encoder]": the decoder trains), SYSTEMS ("full lora freeze scratch": which trainings run), BEAM (5).
set -euo pipefail
run=${1:?usage: benchmarks/finetune_domain.sh RUN [OUT]}
out=${2:-runs/finetune_domain}
wmt22=${WMT22:-../shared/data/wmt22}
steps=${STEPS:-500}
finetune_lr=${FINETUNE_LR:-0.0002}
lora_lr=${LORA_LR:-0.001}
lora_ranks=${LORA_RANKS:-8 32}
freeze=${FREEZE:-[embeddings, encoder]}
systems=${SYSTEMS:-full lora freeze scratch}
beam=${BEAM:-5}
mkdir -p "$out/data"

python3 - "$wmt22" "$out/data" <<'EOF'
import gzip, sys
from pathlib import Path
wmt22, data = Path(sys.argv[1]), Path(sys.argv[2])
sides = {
    "en": gzip.open(wmt22 / "generaltest2022.en-de.src.en.gz", "rt", encoding="utf-8").read().splitlines(),
    "de": gzip.open(wmt22 / "generaltest2022.en-de.ref.A.de.gz", "rt", encoding="utf-8").read().splitlines(),
}
for lang, lines in sides.items():
    for split, part in (("adapt", lines[:900]), ("valid", lines[900:1000]), ("test", lines[1000:])):
        (data / f"{split}.{lang}").write_text("\n".join(part) + "\n", encoding="utf-8")
EOF

d=$out/data
printf '{}\n' >"$out/base.yaml"  # every setting comes from --set below
common=(--set data.train_src="$d/adapt.en" --set data.train_tgt="$d/adapt.de" --set data.valid_src="$d/valid.en"
        --set data.valid_tgt="$d/valid.de" --set data.src_lang=en --set data.tgt_lang=de --set train.batch_tokens=4096
        --set train.log_every=10 --set train.valid_beam="$beam" --set train.keep_last=1 --set train.max_steps="$steps"
        --set train.valid_every=50 --set train.save_every=50)
adapt=(--set train.init_from="$run" --set train.schedule=constant --set train.warmup=50)

trained() {  # system name, then mtkit train's settings: trains OUT/NAME under /usr/bin/time, translates the test set
  local name=$1
  shift
  /usr/bin/time -v mtkit train "$out/base.yaml" -o "$out/$name" "${common[@]}" "$@" 2>"$out/$name.log"
  mtkit --quiet translate "$out/$name" -i "$d/test.en" -o "$out/$name.de" --beam "$beam"
}

row() {  # system name, hypothesis file; the training's figures from OUT/NAME.log and OUT/NAME/metrics.jsonl
  local bleu chrf
  bleu=$(mtkit eval --hyp "$2" --ref "$d/test.de" --metrics bleu --score-only)
  chrf=$(mtkit eval --hyp "$2" --ref "$d/test.de" --metrics chrf --score-only)
  python3 - "$1" "$bleu" "$chrf" "$out/$(basename "$2" .de)" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
name, bleu, chrf, run = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
figures = ["", "", "", "0"]
log = Path(f"{run}.log")
if log.is_file():
    text = log.read_text()
    trained = re.search(r"([\d,]+) of the model's ([\d,]+) parameters train", text)
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)[1]) / 2**20
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds_per_update"] for r in records if r.get("event") == "train" and r["step"] > 10]
    updates = max(r["step"] for r in records if r.get("event") == "train")
    figures = [f"{trained[1]} of {trained[2]}", f"{peak:.2f} GiB", f"{statistics.median(seconds):.2f} s", f"{updates:,}"]
print(f"| {name} | {bleu} | {chrf} | " + " | ".join(figures) + " |")
EOF
}

mtkit --quiet translate "$run" -i "$d/test.en" -o "$out/unadapted.de" --beam "$beam"
rows=("Multi30k model, unadapted|$out/unadapted.de")
for system in $systems; do
  case $system in
    full)
      trained full "${adapt[@]}" --set train.lr="$finetune_lr"
      rows+=("fine-tuned, every weight|$out/full.de") ;;
    lora)
      for rank in $lora_ranks; do
        trained "lora$rank" "${adapt[@]}" --set train.lr="$lora_lr" --set train.lora.rank="$rank" \
          --set train.lora.alpha="$((2 * rank))" --set 'train.lora.targets=[attention, ffn]'
        rows+=("LoRA rank $rank (attention, ffn)|$out/lora$rank.de")
      done ;;
    freeze)
      trained freeze "${adapt[@]}" --set train.lr="$finetune_lr" --set "train.freeze=$freeze"
      rows+=("train.freeze $freeze|$out/freeze.de") ;;
    scratch)
      trained scratch --set tokenizer.model="$run/spm.model" --set model.preset=transformer-small \
        --set model.positions=rotary --set model.dropout=0.3 --set train.lr=0.002 --set train.warmup=300
      rows+=("trained on the 900 segments only|$out/scratch.de") ;;
    *) echo "unknown system $system (SYSTEMS: full lora freeze scratch)" >&2; exit 1 ;;
  esac
done

echo "WMT22 en-de segments 1001-2037 (1,037), reference A; $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "| system | BLEU | chrF | parameters trained | peak memory (max RSS) | an update | updates |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for entry in "${rows[@]}"; do
  row "${entry%%|*}" "${entry#*|}"
done
