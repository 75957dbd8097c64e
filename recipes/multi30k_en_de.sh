#!/usr/bin/env bash
# Multi30k English->German end to end with `mtkit run`: prepare the corpus, train, average the last
# 3 checkpoints, translate test_2016_flickr with beam 5, score it, and write RUN/report.md (with the
# training curves in RUN/curves.png when matplotlib is installed).
# Run from the repository root. DATA is a local mirror of the official Multi30k files (empty: download
# them); extra arguments go to `mtkit run` (e.g. --set train.max_steps=100). Re-running resumes.
set -euo pipefail

DATA=${DATA-../shared/data/multi30k}
RUN=${RUN:-runs/multi30k_en_de}

exec mtkit run recipes/multi30k_en_de.yaml --out "$RUN" ${DATA:+--mirror "$DATA"} "$@"
