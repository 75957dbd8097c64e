#!/usr/bin/env bash
# Multi30k task 1 (Elliott et al., 2016): 29,000 image captions in English with German, French and
# Czech; valid = val, test = test_2016_flickr. Files from the multi30k/dataset repository, checked
# against their SHA-256.
#
# Usage: data_scripts/multi30k.sh [PAIR] [OUT] [mtkit prepare options]
#   PAIR  en-de (default), de-en, en-fr, fr-en, en-cs or cs-en
#   OUT   output folder (default data/multi30k_PAIR)
# e.g.    data_scripts/multi30k.sh en-de data/m30k --mirror ../shared/data/multi30k
set -euo pipefail
pair=en-de
if [[ $# -gt 0 && $1 != -* ]]; then pair=$1; shift; fi
name=multi30k_${pair/-/_}
out=data/$name
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
exec mtkit prepare "$name" --out "$out" "$@"
