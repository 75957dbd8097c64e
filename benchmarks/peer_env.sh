#!/usr/bin/env bash
# A separate Python environment with fairseq, the peer toolkit that train_throughput.py trains beside
# mtkit (--fairseq DIR/bin/python). fairseq 0.12 builds C++ extensions against torch: its build
# dependencies come first, with the same CPU torch as mtkit's environment (and the setuptools that
# torch requires), and the build runs without isolation so that pip does not fetch an unpinned
# (CUDA) torch to build against.
#
#   bash benchmarks/peer_env.sh .peer-fairseq      # about 5 minutes on 2 cores
set -euo pipefail
dir=${1:-.peer-fairseq}
torch_version=${TORCH_VERSION:-2.13.0}
python3 -m venv "$dir"
"$dir/bin/pip" install -q "torch==$torch_version" wheel cython "numpy<2"
"$dir/bin/pip" install -q --no-build-isolation fairseq-fixed==0.12.3.1
"$dir/bin/python" -c "import fairseq, torch; print('fairseq', fairseq.__version__, 'torch', torch.__version__)"
