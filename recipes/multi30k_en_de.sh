#!/usr/bin/env bash
# Multi30k English->German end to end with `mtkit run`: prepare the corpus, train, average the last
# 5 checkpoints, translate test_2016_flickr with beam 5, score it, and write RUN/report.md (with the
# training curves in RUN/curves.png when matplotlib is installed).
# Run from the repository root. DATA is a local mirror of the official Multi30k files: by default
# ../shared/data/multi30k where that folder exists, else none, and the files are downloaded (and
# checked against their SHA-256); DATA= forces the download. Extra arguments go to `mtkit run`
# (e.g. --set train.max_steps=100). Re-running resumes.
set -euo pipefail

MIRROR=../shared/data/multi30k
DATA=${DATA-$([ -d "$MIRROR" ] && echo "$MIRROR" || true)}
RUN=${RUN:-runs/multi30k_en_de}

exec mtkit run recipes/multi30k_en_de.yaml --out "$RUN" ${DATA:+--mirror "$DATA"} "$@"
