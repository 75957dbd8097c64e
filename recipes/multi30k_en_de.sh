#!/usr/bin/env bash
# Multi30k English->German end to end: SentencePiece + Transformer training, beam-5 translation of
# test_2016_flickr, sacreBLEU. Run from the repository root; extra arguments go to `mtkit train`
# (e.g. --set train.max_steps=100 for a quick look). Re-running resumes an interrupted training.
set -euo pipefail

DATA=${DATA:-../shared/data/multi30k}
RUN=${RUN:-runs/multi30k_en_de}

SECONDS=0
mtkit train recipes/multi30k_en_de.yaml --out "$RUN" "$@"
echo "training wall clock: $((SECONDS / 60)) min $((SECONDS % 60)) s" >&2

mtkit translate "$RUN" --beam 5 -i "$DATA/test_2016_flickr.en.gz" -o "$RUN/test_2016_flickr.hyp.de"
mtkit eval --hyp "$RUN/test_2016_flickr.hyp.de" --ref "$DATA/test_2016_flickr.de.gz" --metrics bleu,chrf,ter \
    | tee "$RUN/test_2016_flickr.scores.txt"
