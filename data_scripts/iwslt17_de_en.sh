#!/usr/bin/env bash
# IWSLT 2017 German-English TED talks (206k pairs) from the Hugging Face Hub copy of the
# release (IWSLT/iwslt2017); valid = dev2010, test = tst2010-2015.
#
# Usage: data_scripts/iwslt17_de_en.sh [OUT] [mtkit prepare options]
#   OUT   output folder (default data/iwslt17_de_en)
#   e.g. --mirror DIR (DIR/IWSLT/iwslt2017: a clone of the Hub repository), --nfkc, --max-ratio 1.5
# The reverse direction is the corpus iwslt17_en_de: mtkit prepare iwslt17_en_de --out DIR.
set -euo pipefail
out=data/iwslt17_de_en
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
exec mtkit prepare iwslt17_de_en --out "$out" "$@"
