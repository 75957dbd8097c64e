#!/usr/bin/env bash
# WMT14 English-German (Europarl v7, Common Crawl, News Commentary v9; 4.5M pairs) from the
# Hugging Face Hub copy of the release (wmt/wmt14); valid = newstest2013, test = newstest2014.
#
# Usage: data_scripts/wmt14_en_de.sh [OUT] [mtkit prepare options]
#   OUT   output folder (default data/wmt14_en_de)
#   e.g. --mirror DIR (DIR/wmt/wmt14: a clone of the Hub repository), --nfkc, --max-ratio 1.5
# The reverse direction is the corpus wmt14_de_en: mtkit prepare wmt14_de_en --out DIR.
set -euo pipefail
out=data/wmt14_en_de
if [[ $# -gt 0 && $1 != -* ]]; then out=$1; shift; fi
exec mtkit prepare wmt14_en_de --out "$out" "$@"
