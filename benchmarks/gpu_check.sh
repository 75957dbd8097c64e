#!/usr/bin/env bash
# mtkit on a CUDA GPU, as one run within a time budget (7 minutes on an H100 or H200):
#   1. the tests that need CUDA, tests/test_cuda.py: bf16 and fp16 (loss scaling) training steps
#      against fp32, beam search and the fused loss on the GPU against the CPU, dropout and top-k;
#   2. training throughput and MFU of transformer-base and transformer-big in bf16 (autocast; the
#      attention runs through PyTorch's SDPA on CUDA) on Multi30k en-de, 25,000-token batches, from
#      benchmarks/train_throughput.py --device cuda, against the GPU's measured bf16 matmul peak;
#   3. benchmarks/gpu_profile.py, torch.profiler over transformer-base's bf16 training loop at
#      25,000-token batches: which attention kernels run for encoder self-attention (padding mask),
#      decoder self-attention (causal) and cross-attention, and whether Adam's step is fused; then
#      the share of an update the GPU is idle (1 - kernel busy time / wall time, 20 updates);
#   4. NCCL through torchrun: `mtkit train --nproc-per-node 1` against the same training in one
#      process, fp32 without dropout, both loss series and their largest difference; the rank must
#      log "rank 0 of 1 joined (nccl)" (benchmarks/gpu_check.py --phases torchrun);
#   5. the Multi30k recipe end to end in bf16 (`mtkit run`: all of its updates, the average, the
#      test BLEU against the recipe's range), timed, with the time left (gpu_check.py --phases
#      peak,recipe); if time runs out it is stopped and the updates it made are reported.
# Every step writes its figures to OUT as it ends and its results as lines of OUT/summary.txt; a
# step that would overrun the budget is stopped, and summary.txt says so. gpu_check.py's longer
# phases (fp16/fp32/compile runs, compiled against eager, out-of-memory recovery, translation in two
# precisions) are not part of this check: `python benchmarks/gpu_check.py --phases ...` runs them.
#
# Usage, from anywhere: bash benchmarks/gpu_check.sh [DATA [OUT]]
#   DATA  a folder holding multi30k/{train,val,test_2016_flickr}.{en,de}.gz (default: ../shared/data
#         beside the repo, else shared/data inside it); the tests write their own data
#   OUT   where the logs, the JSON figures and summary.txt go (default: gpu_check_out)
# GPU_CHECK_BUDGET_S sets the budget in seconds (default 410). GPU_CHECK_SMOKE=1 runs every step on
# the CPU at toy sizes in a few minutes: a check of this script, not a measurement.
# Nothing is installed: the GPU machine's python3 must hold torch, sentencepiece, sacrebleu, typer,
# rich, numpy, pyarrow and pytest; mtkit runs from this checkout. Exit status 1 if any step failed.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
shared=$repo/../shared/data
[[ -d $shared ]] || shared=$repo/shared/data
data=$(realpath "${1:-$shared}")
out=$(realpath -m "${2:-gpu_check_out}")
mkdir -p "$out"
cd "$repo" || exit 1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
budget=${GPU_CHECK_BUDGET_S:-410}
status=0

device=cuda
presets="transformer-base transformer-big"
batch=25000
throughput=(--steps 30 --warmup 5)
profile=()
torchrun=()
recipe=(--phases peak,recipe)
if [[ -n ${GPU_CHECK_SMOKE:-} ]]; then
    device=cpu
    presets=transformer-small
    batch=1000
    throughput=(--steps 1 --warmup 1)
    profile=(--preset transformer-small --batch-tokens 1000 --warmup 1 --kernel-updates 1 --idle-updates 1)
    torchrun=(--torchrun-steps 3 --set train.batch_tokens=1000)
    recipe=(--phases recipe --set train.max_steps=4 --set train.valid_every=0 --set tokenizer.vocab_size=1000
        --set decode.beam=1 --set decode.max_len_a=0 --set decode.max_len_b=2)
    budget=${GPU_CHECK_BUDGET_S:-1800}
fi

note() { echo "$*" | tee -a "$out/summary.txt"; }

# step NAME CAP COMMAND...: run COMMAND, its output in OUT/NAME.log, stopped after CAP seconds or when
# the budget is spent, whichever comes first.
step() {
    local name=$1 cap=$2 left=$((budget - SECONDS))
    shift 2
    local limit=$((left < cap ? left : cap))
    if ((limit < 20)); then
        note "$name: skipped, the time budget is spent"
        status=1
        return
    fi
    echo "== $name (at most $limit s; $left s of the budget left)"
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then
        note "$name: stopped after $limit s (time limit)"
        status=1
    elif ((rc != 0)); then
        note "$name: failed (exit status $rc)"
        status=1
    fi
}

: > "$out/summary.txt"
rm -f "$out/gpu_check.json"
python3 -m mtkit doctor 2>&1 | tee "$out/doctor.txt"
if [[ $device == cuda ]]; then
    python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")' || exit 1
    step tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    note "tests/test_cuda.py: $(tail -1 "$out/tests.log")"
fi

step tokenizer 60 python3 -m mtkit tokenizer train --src "$data/multi30k/train.en.gz" \
    --tgt "$data/multi30k/train.de.gz" --out-dir "$out/spm" --vocab-size 8000
spm=$out/spm/spm.model

for preset in $presets; do
    step "$preset" 90 python3 benchmarks/train_throughput.py --device "$device" --preset "$preset" \
        --precisions bf16 --src "$data/multi30k/train.en.gz" --tgt "$data/multi30k/train.de.gz" \
        --tokenizer "$spm" --batch-tokens "$batch" "${throughput[@]}" --json "$out/$preset.json"
    grep -h '^train_throughput' "$out/$preset.log" >> "$out/summary.txt"
done

step profile 120 python3 benchmarks/gpu_profile.py --device "$device" --tokenizer "$spm" --out "$out" \
    --src "$data/multi30k/train.en.gz" --tgt "$data/multi30k/train.de.gz" "${profile[@]}"

step torchrun 120 python3 benchmarks/gpu_check.py --device "$device" --phases torchrun \
    --data-dir "$data/multi30k" --out "$out" --tokenizer "$spm" "${torchrun[@]}"

# The recipe gets the rest of the budget; gpu_check.py stops it 40 s early, so that it can still record.
left=$((budget - SECONDS))
step recipe "$left" python3 benchmarks/gpu_check.py --device "$device" \
    --data-dir "$data/multi30k" --out "$out" --time-limit $((left - 40)) "${recipe[@]}"

grep -qE 'failed|FAILED|CUT|not reproduced' "$out/summary.txt" && status=1
echo "== summary ($SECONDS s)"
cat "$out/summary.txt"
exit $status
