#!/usr/bin/env bash
# Domain adaptation with train.init_from: a model trained on one domain, fine-tuned on a little in-domain
# data, against the same model unadapted and against a model trained on the in-domain data alone.
#
#   benchmarks/finetune_domain.sh RUN [OUT]
#
# RUN is an English->German mtkit model trained on Multi30k (captions): `mtkit run recipes/multi30k_en_de.yaml`.
# The in-domain data is the WMT22 general test set (news, e-commerce, social, conversation), read from
# ../shared/data/wmt22 (WMT22 below): its first 1,000 segments are split into 900 for training and 100 for
# validation, the other 1,037 are the test set, scored with reference A. Segments are in document order,
# so no document is in both halves except the one the cut falls in. Prints one line per system:
# test sacreBLEU and chrF, the updates it trained for and the minutes they took.
#
# Both trainings get the same budget, STEPS updates of the same batches' size, validated and saved at the same
# updates: a comparison at unequal budgets would credit one system with the other's extra updates.
#
# Settings (environment): STEPS (500, for each training), FINETUNE_LR (0.0002), BEAM (5).
set -euo pipefail
run=${1:?usage: benchmarks/finetune_domain.sh RUN [OUT]}
out=${2:-runs/finetune_domain}
wmt22=${WMT22:-../shared/data/wmt22}
steps=${STEPS:-500}
finetune_lr=${FINETUNE_LR:-0.0002}
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
        --set train.log_every=50 --set train.valid_beam="$beam" --set train.keep_last=1 --set train.max_steps="$steps"
        --set train.valid_every=50 --set train.save_every=50)

timed() {  # run a command; its wall-clock minutes go to the file named first
  local file=$1 start
  shift
  start=$(date +%s)
  "$@"
  python3 -c "import sys; print(round((int(sys.argv[2]) - int(sys.argv[1])) / 60, 1))" "$start" "$(date +%s)" >"$file"
}

score() {  # system name, hypothesis file, training updates, training minutes
  local bleu chrf
  bleu=$(mtkit eval --hyp "$2" --ref "$d/test.de" --metrics bleu --score-only)
  chrf=$(mtkit eval --hyp "$2" --ref "$d/test.de" --metrics chrf --score-only)
  printf '%-34s BLEU %6s  chrF %6s  training %s updates, %s min\n' "$1" "$bleu" "$chrf" "$3" "$4"
}

mtkit --quiet translate "$run" -i "$d/test.en" -o "$out/unadapted.de" --beam "$beam"

timed "$out/finetuned.minutes" mtkit --quiet train "$out/base.yaml" -o "$out/finetuned" "${common[@]}" --set train.init_from="$run" \
  --set train.schedule=constant --set train.lr="$finetune_lr" --set train.warmup=50
mtkit --quiet translate "$out/finetuned" -i "$d/test.en" -o "$out/finetuned.de" --beam "$beam"

timed "$out/scratch.minutes" mtkit --quiet train "$out/base.yaml" -o "$out/scratch" "${common[@]}" --set tokenizer.model="$run/spm.model" \
  --set model.preset=transformer-small --set model.positions=rotary --set model.dropout=0.3 \
  --set train.lr=0.002 --set train.warmup=300
mtkit --quiet translate "$out/scratch" -i "$d/test.en" -o "$out/scratch.de" --beam "$beam"

echo "WMT22 en-de segments 1001-2037 (1,037), reference A; $(lscpu | sed -n 's/^Model name: *//p')"
score "Multi30k model, unadapted" "$out/unadapted.de" 0 0
score "fine-tuned on 900 segments" "$out/finetuned.de" "$steps" "$(cat "$out/finetuned.minutes")"
score "trained on the 900 segments only" "$out/scratch.de" "$steps" "$(cat "$out/scratch.minutes")"
