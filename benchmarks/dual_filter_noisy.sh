#!/usr/bin/env bash
# Dual conditional cross-entropy filtering of a noisy corpus: Multi30k's English->German training pairs with
# a known share made noise, a model trained on them as they are, against a model trained on the pairs the
# filter keeps. Both models have the same budget of updates.
#
#   benchmarks/dual_filter_noisy.sh [OUT]
#
# The noise, drawn with a fixed seed: NOISE_MISALIGNED of the pairs get the German side of another pair
# (misaligned), NOISE_COPIED get their English side as the German side (untranslated copies, which web-crawled
# corpora are full of); the rest are kept as they are. The filter's forward model is the model trained on the
# noisy pairs, its reverse model a German->English model trained on them too, as a user without clean data
# would do; it keeps the KEEP fraction of lowest score (mtkit/translation/pair_filter.py). Two more models train
# on the pairs left once those whose sides are the same text are dropped: all of them (the control), and as many
# as the first filter kept, chosen by the filter. Prints how many of each kind of pair each filtering kept, then
# one line per system: test_2016_flickr sacreBLEU and chrF. Five trainings: about an hour on a 2-core CPU.
#
# Settings (environment): STEPS (1200, for each training), NOISE_MISALIGNED (0.2), NOISE_COPIED (0.1),
# KEEP (0.7), BEAM (5), MULTI30K (../shared/data/multi30k).
set -euo pipefail
out=${1:-runs/dual_filter_noisy}
multi30k=${MULTI30K:-../shared/data/multi30k}
steps=${STEPS:-1200}
misaligned=${NOISE_MISALIGNED:-0.2}
copied=${NOISE_COPIED:-0.1}
keep=${KEEP:-0.7}
beam=${BEAM:-5}
d=$out/data
mkdir -p "$d"

python3 - "$multi30k" "$d" "$misaligned" "$copied" <<'EOF'
import gzip, random, sys
from pathlib import Path
multi30k, data, misaligned, copied = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
def read(name):
    return gzip.open(multi30k / f"{name}.gz", "rt", encoding="utf-8").read().splitlines()
en, de = read("train.en"), read("train.de")
draw = random.Random(1)
order = list(range(len(en)))
draw.shuffle(order)
n_misaligned, n_copied = round(misaligned * len(en)), round(copied * len(en))
noisy_de, kind = list(de), ["clean"] * len(en)
for i in order[:n_misaligned]:
    noisy_de[i] = de[(i + draw.randrange(1, len(de))) % len(de)]  # another pair's German
    kind[i] = "misaligned"
for i in order[n_misaligned : n_misaligned + n_copied]:
    noisy_de[i] = en[i]
    kind[i] = "copied"
(data / "noisy.en").write_text("\n".join(en) + "\n", encoding="utf-8")
(data / "noisy.de").write_text("\n".join(noisy_de) + "\n", encoding="utf-8")
(data / "noise.txt").write_text("\n".join(kind) + "\n", encoding="utf-8")
for split in ("val", "test_2016_flickr"):
    for lang in ("en", "de"):
        (data / f"{split}.{lang}").write_text("\n".join(read(f"{split}.{lang}")) + "\n", encoding="utf-8")
EOF

printf '{}\n' >"$out/base.yaml"  # every setting comes from --set below
train() {  # run directory, source side, target side, source language, target language
  local split=$1
  mtkit train "$out/base.yaml" -o "$out/$1" --set data.train_src="$2" --set data.train_tgt="$3" \
    --set data.valid_src="$d/val.$4" --set data.valid_tgt="$d/val.$5" --set data.src_lang="$4" \
    --set data.tgt_lang="$5" --set model.preset=transformer-small --set model.positions=rotary \
    --set model.dropout=0.3 --set train.max_steps="$steps" --set train.batch_tokens=4096 --set train.lr=0.002 \
    --set train.warmup=400 --set train.label_smoothing=0.1 --set train.clip_norm=1.0 --set train.valid_bleu=false \
    --set train.best_metric=loss --set train.valid_every=400 --set train.save_every=400 --set train.log_every=100 \
    >"$out/$split.log" 2>&1
}

train noisy "$d/noisy.en" "$d/noisy.de" en de
train reverse "$d/noisy.de" "$d/noisy.en" de en

python3 - "$out" "$keep" <<'EOF'
import sys
from collections import Counter
from pathlib import Path
from mtkit.config import PairFilterConfig
from mtkit.translation.pair_filter import filter_pair_files, load_scorer
out, keep = Path(sys.argv[1]), float(sys.argv[2])
d = out / "data"
forward = load_scorer(out / "noisy", "en", "de", "the forward model")
reverse = load_scorer(out / "reverse", "de", "en", "the reverse model")
summary = filter_pair_files(
    forward, reverse, d / "noisy.en", d / "noisy.de", d / "kept.en", d / "kept.de", PairFilterConfig(keep=keep),
    scores_tsv=d / "scores.tsv",
)
kinds = (d / "noise.txt").read_text(encoding="utf-8").splitlines()
kept = [line.rstrip("\n").split("\t")[3] == "1" for line in open(d / "scores.tsv", encoding="utf-8")]
total, left = Counter(kinds), Counter(k for k, on in zip(kinds, kept) if on)
print(f"filter: kept {summary.kept:,} of {summary.pairs:,} pairs (keep {keep:g})")
for kind in ("clean", "misaligned", "copied"):
    print(f"  {kind:<10} {total[kind]:>6,} pairs, {left[kind]:>6,} kept ({100 * left[kind] / max(total[kind], 1):.1f}%)")
EOF

train filtered "$d/kept.en" "$d/kept.de" en de

# The same filter after the rule every cleaning pipeline has, pairs whose two sides are the same text dropped,
# keeping as many pairs as above: models trained on a corpus full of copies learn to copy, and score a copy as
# probable both ways.
python3 - "$out" "$keep" <<'EOF2'
import sys
from collections import Counter
from pathlib import Path
from mtkit.config import PairFilterConfig
from mtkit.translation.pair_filter import filter_pair_files, load_scorer
out, keep = Path(sys.argv[1]), float(sys.argv[2])
d = out / "data"
en = (d / "noisy.en").read_text(encoding="utf-8").splitlines()
de = (d / "noisy.de").read_text(encoding="utf-8").splitlines()
kinds = (d / "noise.txt").read_text(encoding="utf-8").splitlines()
rest = [i for i in range(len(en)) if en[i].strip() != de[i].strip()]
(d / "uncopied.en").write_text("\n".join(en[i] for i in rest) + "\n", encoding="utf-8")
(d / "uncopied.de").write_text("\n".join(de[i] for i in rest) + "\n", encoding="utf-8")
fraction = round(keep * len(en)) / len(rest)
forward = load_scorer(out / "noisy", "en", "de", "the forward model")
reverse = load_scorer(out / "reverse", "de", "en", "the reverse model")
summary = filter_pair_files(
    forward, reverse, d / "uncopied.en", d / "uncopied.de", d / "kept2.en", d / "kept2.de",
    PairFilterConfig(keep=fraction), scores_tsv=d / "scores2.tsv",
)
kept = [line.split("\t")[3] == "1" for line in open(d / "scores2.tsv", encoding="utf-8")]
total, left = Counter(kinds), Counter(kinds[i] for i, on in zip(rest, kept) if on)
print(f"copies dropped: {len(en) - len(rest):,} pairs; then the filter kept {summary.kept:,} of {summary.pairs:,}")
for kind in ("clean", "misaligned", "copied"):
    print(f"  {kind:<10} {total[kind]:>6,} pairs, {left[kind]:>6,} kept ({100 * left[kind] / max(total[kind], 1):.1f}%)")
EOF2

train uncopied "$d/uncopied.en" "$d/uncopied.de" en de  # the copies dropped, no other filter: the control
train uncopied-filtered "$d/kept2.en" "$d/kept2.de" en de

for system in noisy filtered uncopied uncopied-filtered; do
  case $system in
    noisy) pairs=$d/noisy.en ;;
    filtered) pairs=$d/kept.en ;;
    uncopied) pairs=$d/uncopied.en ;;
    *) pairs=$d/kept2.en ;;
  esac
  mtkit translate "$out/$system" -i "$d/test_2016_flickr.en" -o "$out/$system.test.de" --beam "$beam"
  bleu=$(mtkit eval --hyp "$out/$system.test.de" --ref "$d/test_2016_flickr.de" --metrics bleu --score-only)
  chrf=$(mtkit eval --hyp "$out/$system.test.de" --ref "$d/test_2016_flickr.de" --metrics chrf --score-only)
  printf '%-18s trained on %6s pairs: BLEU %6s  chrF %6s  (%s updates)\n' "$system" "$(wc -l <"$pairs")" \
    "$bleu" "$chrf" "$steps"
done
