#!/usr/bin/env bash
# WMT16 English-Romanian (Europarl v8, SETIMES2; 610k pairs) from the Hugging Face Hub copy
# of the release (wmt/wmt16); valid = newsdev2016, test = newstest2016.
#
# Usage: data_scripts/wmt16_en_ro.sh [OUT] [mtkit prepare options]
#   OUT   output folder (default data/wmt16_en_ro)
#   e.g. --mirror DIR (DIR/wmt/wmt16: a clone of the Hub repository), --nfkc, --max-ratio 1.5
# The reverse direction is the corpus wmt16_ro_en: mtkit prepare wmt16_ro_en --out DIR.
set -euo pipefail
out=data/wmt16_en_ro
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
exec mtkit prepare wmt16_en_ro --out "$out" "$@"
