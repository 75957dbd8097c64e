#!/usr/bin/env bash
# A separate Python environment with unbabel-comet 2.2.7, the peer that mtkit's COMET is checked against
# (benchmarks/comet_expected.py writes tests/data/comet_expected.json with it; benchmarks/comet_speed.py times
# its comet-score). It pins numpy<2, transformers<5 and torchmetrics<0.11, so it cannot share mtkit's
# environment. The CPU torch goes in first, so that unbabel-comet's unpinned torch requirement is already met
# and pip does not fetch a multi-GB CUDA build; torchmetrics 0.10 imports pkg_resources, which setuptools 81
# dropped. Running it again on a finished environment changes nothing.
# Prints the environment's python.
#
#   bash benchmarks/comet_peer_env.sh [DIR]      # DIR defaults to ~/.cache/mtkit-peers/comet
set -euo pipefail
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/mtkit-peers/comet}
torch_version=${TORCH_VERSION:-2.13.0}
comet_version=2.2.7
if ! "$dir/bin/python" -c "import comet, sys; sys.exit(comet.__version__ != '$comet_version')" 2>/dev/null; then
    mkdir -p "$(dirname "$dir")"
    python3 -m venv "$dir"
    "$dir/bin/pip" install -q "torch==$torch_version"
    "$dir/bin/pip" install -q "unbabel-comet==$comet_version" "torch==$torch_version" "setuptools<81"
fi
"$dir/bin/python" -c "import comet, torch, transformers; print('unbabel-comet', comet.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__, file=__import__('sys').stderr)"
echo "$dir/bin/python"
