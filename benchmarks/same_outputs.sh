#!/usr/bin/env bash
# Every output kind of one checkout on the same inputs, written to OUT for a byte-for-byte comparison with another
# checkout's (a change meant to keep behaviour, such as moving code):
#   training (fp32, 200 updates; bf16, 50 updates; a metrics line each update) and the weights of each checkpoint,
#   `mtkit average`, translations in fp32 (n-best with scores), bf16, int8, with a shortlist (fp32, int8), a
#   two-model ensemble (fp32, bf16), alignments, sampling with a seed, greedy bf16; `mtkit serve` in fp32 and int8
#   with continuous batching and fp32 without (concurrent requests, n-best, alignments, /openapi.json,
#   /v1/models); and the help of every command.
# Usage: bash benchmarks/same_outputs.sh CHECKOUT OUT [PORT] [DATA], then `bash benchmarks/same_outputs.sh --compare
# OUT_A OUT_B`. CHECKOUT is a clone or `git worktree add` of the commit to run (imported through PYTHONPATH with the
# python on PATH); DATA is Multi30k's folder (default ../shared/data/multi30k). A CPU only: the comparison holds for
# one machine, whose CPU chooses the kernels.
set -eu
if [[ ${1:-} == --compare ]]; then
  compared=0 differ=0
  for file in "$2"/*.txt "$2"/*.json "$2"/weights.sha "$2"/help/*; do
    other=$3/${file#"$2"/}; compared=$((compared + 1))
    cmp -s "$file" "$other" || { echo "differs: ${file#"$2"/}"; differ=$((differ + 1)); }
  done
  echo "$compared files compared, $differ differ"; exit $((differ > 0))
fi
CODE=$(realpath "$1"); OUT=$(realpath -m "$2"); PORT=${3:-18123}
DATA=$(realpath "${4:-$(dirname "$0")/../../shared/data/multi30k}")
export PYTHONPATH=$CODE COLUMNS=200 MTKIT_CACHE_DIR=$OUT/cache
mtkit() { python -m mtkit "$@"; }
rm -rf "$OUT"; mkdir -p "$OUT/help" "$OUT/data"; cd "$OUT"
zcat "$DATA/train.en.gz" | head -4000 > data/train.en; zcat "$DATA/train.de.gz" | head -4000 > data/train.de
zcat "$DATA/val.en.gz" | head -100 > data/valid.en; zcat "$DATA/val.de.gz" | head -100 > data/valid.de
zcat "$DATA/test_2016_flickr.en.gz" | head -150 > data/test.en
cat > train.yaml <<YAML
data: {train_src: data/train.en, train_tgt: data/train.de, valid_src: data/valid.en, valid_tgt: data/valid.de, src_lang: en, tgt_lang: de}
tokenizer: {type: unigram, vocab_size: 1000, joint: true}
model: {encoder_layers: 2, decoder_layers: 2, d_model: 64, heads: 4, ffn: 128, dropout: 0.1, positions: rotary}
train: {max_steps: 200, batch_tokens: 1024, lr: 0.003, warmup: 50, valid_every: 100, save_every: 100, keep_last: 0, log_every: 1, seed: 3, device: cpu}
decode: {beam: 4}
YAML
mtkit --help > help/main.txt
for command in train translate eval run prepare average export import "import hf" shortlist serve attention doctor tokenizer "tokenizer train"; do
  mtkit $command --help > "help/$command.txt" 2>&1 || true
done
mtkit train train.yaml -o fp32 --precision fp32 > train_fp32.log 2>&1
mtkit train train.yaml -o bf16 --precision bf16 --set train.max_steps=50 > train_bf16.log 2>&1
for run in fp32 bf16; do  # what training computed, without the timings
  python -c "import json, sys; [print(json.dumps({k: v for k, v in json.loads(line).items() if 'loss' in k or 'nll' in k \
    or 'norm' in k or k in ('step', 'lr', 'bleu')})) for line in open(sys.argv[1])]" $run/metrics.jsonl > losses_$run.txt
done
T=data/test.en FIRST=fp32/checkpoints/update-00000100
mtkit translate fp32 -i $T -o t_fp32.txt --device cpu --precision fp32 --nbest 3 --scores
mtkit translate fp32 -i $T -o t_bf16.txt --device cpu --precision bf16 --scores
mtkit translate fp32 -i $T -o t_int8.txt --device cpu --precision int8 --scores
mtkit shortlist fp32 -o shortlist.safetensors --src data/train.en --tgt data/train.de > shortlist.log 2>&1
mtkit translate fp32 -i $T -o t_shortlist_fp32.txt --device cpu --precision fp32 --shortlist shortlist.safetensors --scores
mtkit translate fp32 -i $T -o t_shortlist_int8.txt --device cpu --precision int8 --shortlist shortlist.safetensors
mtkit translate fp32 $FIRST -i $T -o t_ensemble_fp32.txt --device cpu --precision fp32 --scores
mtkit translate fp32 $FIRST -i $T -o t_ensemble_bf16.txt --device cpu --precision bf16
mtkit translate fp32 -i $T -o t_alignments.txt --device cpu --precision fp32 --alignments
mtkit translate fp32 -i $T -o t_sample.txt --device cpu --precision fp32 --sample --seed 5 --nbest 2
mtkit translate fp32 -i $T -o t_greedy_bf16.txt --device cpu --precision bf16 --beam 1
mtkit translate bf16 -i $T -o t_bf16_trained.txt --device cpu --precision bf16
mtkit average fp32 -o average.safetensors > average.log 2>&1
# Weights by tensor: safetensors writes its metadata in an order of its own, so files of equal weights can differ.
python -c "import glob, hashlib, safetensors.torch as st
for name in sorted(glob.glob('average.safetensors') + glob.glob('*/checkpoints/*/*.safetensors') + glob.glob('*/best/*.safetensors')):
    tensors, digest = st.load_file(name), hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode()); digest.update(tensors[key].float().numpy().tobytes())
    print(name, digest.hexdigest())" > weights.sha
cat > ask.py <<'PY'
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, source, out = sys.argv[1:4]
base = f"http://127.0.0.1:{port}"
for _ in range(600):  # until the model is loaded
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.2)
def post(body):
    request = urllib.request.Request(base + "/v1/translate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())
def get(path):
    return json.loads(urllib.request.urlopen(base + path, timeout=30).read())
lines = open(source).read().splitlines()
with ThreadPoolExecutor(8) as pool:
    answers = list(pool.map(lambda i: post({"text": lines[i : i + 7]}), range(0, len(lines), 7)))
nbest = post({"text": lines[:5], "nbest": 3, "beam": 4, "scores": True})
aligned = post({"text": lines[5:10], "alignments": True})
json.dump({"answers": answers, "nbest": nbest, "aligned": aligned, "openapi": get("/openapi.json"),
           "models": get("/v1/models")}, open(out, "w"), indent=1)
PY
for mode in "fp32 --continuous" "int8 --continuous" "fp32 --no-continuous"; do
  set -- $mode
  python -m mtkit serve fp32 --port "$PORT" --device cpu --precision $1 $2 > "serve_$1$2.log" 2>&1 &
  server=$!
  python ask.py "$PORT" $T "serve_$1$2.json"
  kill -TERM $server; wait $server || true
done
echo "outputs in $OUT"
