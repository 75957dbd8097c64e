#!/usr/bin/env bash
# mtkit on a lent CUDA GPU, as one short run (a few minutes on an H200; budget 8):
#   1. the tests that need CUDA, tests/test_cuda.py: bf16 and fp16 (loss scaling) training steps
#      against fp32, beam search and the fused loss on the GPU against the CPU, dropout and top-k;
#   2. training throughput and MFU of transformer-base and transformer-big in bf16 (autocast; the
#      attention runs through PyTorch's SDPA on CUDA) on Multi30k en-de, from
#      benchmarks/train_throughput.py --device cuda, against the GPU's measured bf16 matmul peak.
# The longer recipe, fp16/fp32/compile and translation checks stay in benchmarks/gpu_check.py.
#
# Usage, from anywhere: bash benchmarks/gpu_check.sh [DATA [OUT]]
#   DATA  a folder holding multi30k/{train,val}.{en,de}.gz for the throughput runs (default: ../shared/data
#         beside the repo); the tests write their own data
#   OUT   where the logs, the JSON figures and summary.txt go (default: gpu_check_out)
# Nothing is installed: the GPU machine's python3 must hold torch, sentencepiece, sacrebleu, typer,
# rich, numpy, pyarrow and pytest; mtkit runs from this checkout. Exit status 1 if any step failed.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
data=$(realpath "${1:-$repo/../shared/data}")
out=$(realpath -m "${2:-gpu_check_out}")
mkdir -p "$out"
cd "$repo" || exit 1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

python3 -m mtkit doctor 2>&1 | tee "$out/doctor.txt"
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")' || exit 1

echo "== CUDA tests"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/tests.log" || status=1

echo "== tokenizer for the throughput runs (8k joint unigram, untimed)"
python3 -m mtkit tokenizer train --src "$data/multi30k/train.en.gz" --tgt "$data/multi30k/train.de.gz" \
    --out-dir "$out/spm" --vocab-size 8000 > "$out/spm.log" 2>&1 || { status=1; tail "$out/spm.log"; }

for preset in transformer-base transformer-big; do
    echo "== training throughput: $preset, bf16"
    python3 benchmarks/train_throughput.py --device cuda --preset "$preset" --precisions bf16 \
        --src "$data/multi30k/train.en.gz" --tgt "$data/multi30k/train.de.gz" --tokenizer "$out/spm/spm.model" \
        --batch-tokens 25000 --steps 30 --warmup 5 --json "$out/$preset.json" 2>&1 | tee "$out/$preset.log" || status=1
done

{
    echo "tests/test_cuda.py: $(tail -1 "$out/tests.log")"
    grep -h '^train_throughput' "$out"/transformer-*.log
} | tee "$out/summary.txt"
exit $status
