#!/usr/bin/env bash
# driftgate serve vs llama.cpp's llama-server -np 32, the same client and workload, one server at a time.
#
#   scripts/bench_vs_llama_server.sh MODEL_DIR [OUT_DIR]
#
# MODEL_DIR is the checkpoint driftgate serves (bf16 folder or a quantized one); llama-server
# serves $GGUF (default: the Q8_0 GGUF from scripts/build_llama_cpp.sh). Workload as in
# peers.md: random 256-token prompts, exactly 128 output tokens, closed loop at concurrency 1
# and 32; then a ShareGPT request-rate sweep on driftgate. $OURS_ARGS adds `driftgate serve` flags
# (e.g. OURS_ARGS="--kv-cache-dtype bfloat16"). Each side runs $RUNS times,
# alternating, so machine noise hits both alike. Results: OUT_DIR/{ours,llama}-c{1,32}-runN.json.
set -euo pipefail

MODEL=${1:?usage: $0 MODEL_DIR [OUT_DIR]}
OUT=${2:-bench/results/vs-llama-server}
RUNS=${RUNS:-2}
THREADS=${THREADS:-2}
BIN=${BIN:-.venv/bin}
LLAMA_BIN=${DRIFTGATE_LLAMA_CPP:-${DRIFTGATE_HOME:-$HOME/.cache/driftgate}/llama.cpp/bin}
GGUF=${GGUF:-${DRIFTGATE_HOME:-$HOME/.cache/driftgate}/gguf/smollm2-135m-instruct.Q8_0.gguf}
TOKENIZER=${TOKENIZER:-${DRIFTGATE_HOME:-$HOME/.cache/driftgate}/models/smollm2-135m-instruct}
SWEEP=${SWEEP-0.5,1,2,4}
PORT_OURS=${PORT_OURS:-18431}
PORT_LLAMA=${PORT_LLAMA:-18432}

[[ -f $MODEL/config.json ]] || { echo "no model folder at $MODEL" >&2; exit 2; }
[[ -x $LLAMA_BIN/llama-server ]] || { echo "no llama-server in $LLAMA_BIN: run scripts/build_llama_cpp.sh" >&2; exit 2; }
[[ -f $GGUF ]] || { echo "no GGUF at $GGUF: run scripts/build_llama_cpp.sh" >&2; exit 2; }
mkdir -p "$OUT"

wait_healthy() {  # url pid
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited before it was healthy" >&2; return 1; }
    sleep 0.5
  done
  echo "server not healthy after 300 s" >&2; return 1
}

client() {  # url name concurrency prompts json [extra...]
  local url=$1 name=$2 conc=$3 n=$4 json=$5; shift 5
  "$BIN/driftgate" bench serve --base-url "$url" --model "$name" --tokenizer "$TOKENIZER" --dataset random \
    --input-len 256 --output-len 128 --ignore-eos --num-prompts "$n" --max-concurrency "$conc" \
    --no-progress --result-json "$json" "$@"
}

start_ours() {
  OMP_NUM_THREADS=$THREADS "$BIN/driftgate" serve "$MODEL" --port "$PORT_OURS" --served-model-name smollm2 \
    --max-num-seqs 32 --log-level warning ${OURS_ARGS:-} &
  SERVER=$!
  wait_healthy "http://127.0.0.1:$PORT_OURS" "$SERVER"
}

start_llama() {
  "$LLAMA_BIN/llama-server" -m "$GGUF" --port "$PORT_LLAMA" -np 32 -c 16384 -t "$THREADS" -tb "$THREADS" \
    --cont-batching --no-webui --alias smollm2 >"$OUT/llama-server.log" 2>&1 &
  SERVER=$!
  wait_healthy "http://127.0.0.1:$PORT_LLAMA" "$SERVER"
}

stop() { kill -TERM "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap stop EXIT

for run in $(seq "$RUNS"); do
  start_llama
  client "http://127.0.0.1:$PORT_LLAMA" smollm2 1 8 "$OUT/llama-c1-run$run.json"
  client "http://127.0.0.1:$PORT_LLAMA" smollm2 32 64 "$OUT/llama-c32-run$run.json"
  stop
  start_ours
  client "http://127.0.0.1:$PORT_OURS" smollm2 1 8 "$OUT/ours-c1-run$run.json"
  client "http://127.0.0.1:$PORT_OURS" smollm2 32 64 "$OUT/ours-c32-run$run.json"
  stop
done

if [[ -n $SWEEP ]]; then  # SWEEP= (empty) skips it
  start_ours
  "$BIN/driftgate" bench serve --base-url "http://127.0.0.1:$PORT_OURS" --model smollm2 --tokenizer "$TOKENIZER" \
    --dataset sharegpt --num-prompts 64 --sweep "$SWEEP" --ignore-eos --no-progress \
    --result-json "$OUT/ours-sharegpt-sweep.json" --plot "$OUT/ours-sharegpt-sweep.png"
  stop
fi
echo "results in $OUT"
