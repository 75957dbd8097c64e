#!/usr/bin/env bash
# Multi30k En-De split the way back-translation papers simulate it: the first half of the training
# pairs as the parallel data, the German of the second half as the monolingual text.
#
# Usage: data_scripts/multi30k_bt_halves.sh [OUT] [mtkit prepare options]
#   OUT   output folder (default data/multi30k_bt)
# e.g.    data_scripts/multi30k_bt_halves.sh data/multi30k_bt --mirror ../shared/data/multi30k
# Writes OUT/full (the whole corpus, as `mtkit prepare` writes it), OUT/half (train.en and train.de:
# the first half of its pairs; valid.* and test.* as published) and OUT/mono.de (the German of the
# second half), for recipes/multi30k_en_de_bt.yaml.
set -euo pipefail
out=data/multi30k_bt
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
mtkit prepare multi30k_en_de --out "$out/full" "$@"
mkdir -p "$out/half"
pairs=$(wc -l < "$out/full/train.en")
half=$((pairs / 2))
for lang in en de; do
  head -n "$half" "$out/full/train.$lang" > "$out/half/train.$lang.tmp"
  mv "$out/half/train.$lang.tmp" "$out/half/train.$lang"
  for split in valid test; do cp "$out/full/$split.$lang" "$out/half/$split.$lang"; done
done
tail -n +"$((half + 1))" "$out/full/train.de" > "$out/mono.de.tmp"
mv "$out/mono.de.tmp" "$out/mono.de"
echo "$out/half: $half parallel pairs; $out/mono.de: $((pairs - half)) German lines"
