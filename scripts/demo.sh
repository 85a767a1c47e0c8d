#!/usr/bin/env bash
# The main job on the default model: import → quantize → gate → serve what passed.
# Usage: scripts/demo.sh MODEL_DIR OUT_DIR DATA_DIR   (make demo fills these in)
set -uo pipefail
model=$1 out=$2 data=$3
bin=$(dirname "$0")/../.venv/bin
calib=$data/calib/self_instruct_seed_tasks.jsonl
mkdir -p "$out"

step() { printf '\n==> %s\n' "$*"; }

step "quantize: fp8-dynamic (no calibration needed), w4a16 RTN with a calibrated fp8 KV cache, w8a16 RTN"
"$bin/quantize" "$model" --calib "$calib" --scheme fp8-dynamic -o "$out/smollm2-fp8-dynamic" --overwrite --num-samples 32 || exit 2
"$bin/quantize" "$model" --calib "$calib" --scheme w4a16 --algo rtn --kv-cache fp8 -o "$out/smollm2-w4a16-kvfp8" \
    --overwrite --num-samples 64 --max-seq-len 512 || exit 2
"$bin/quantize" "$model" --calib "$calib" --scheme w8a16 --algo rtn -o "$out/smollm2-w8a16" --overwrite --num-samples 32 \
    || exit 2

step "generate with each checkpoint"
"$bin/driftgate" generate "$out/smollm2-fp8-dynamic" --chat --max-tokens 32 "What is the capital of France?" || exit 2
"$bin/driftgate" generate "$out/smollm2-w4a16-kvfp8" --chat --max-tokens 32 "What is the capital of France?" || exit 2
"$bin/driftgate" generate "$out/smollm2-w8a16" --chat --max-tokens 32 "What is the capital of France?" || exit 2

# Every passing candidate may be served; the demo serves the one closest to BF16 (lowest Tier 0 KL).
# A checkpoint with calibrated KV scales is generated, gated and served with its fp8 KV cache by
# default (--kv-cache-dtype auto), as vLLM would serve it.
passed="" best_kl=""
for name in smollm2-fp8-dynamic smollm2-w4a16-kvfp8 smollm2-w8a16; do
    step "gate $name against BF16 (quick policy; the baseline arm is cached after the first run)"
    "$bin/driftgate" gate --baseline "$model" --candidate "$out/$name" --policy quick \
        --report-dir "$out/$name-gate" --data-dir "$data"
    code=$?
    echo "verdict for $name: exit $code (0 pass, 1 drift, 2 could not evaluate); report: $out/$name-gate/report.md"
    if [ $code -eq 0 ]; then
        kl=$("$bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["tier0"]["overall"]["kl_mean"])' \
            "$out/$name-gate/report.json")
        if [ -z "$best_kl" ] || "$bin/python" -c 'import sys; sys.exit(float(sys.argv[1]) >= float(sys.argv[2]))' \
                "$kl" "$best_kl"; then
            passed=$out/$name best_kl=$kl
        fi
    fi
done

[ -n "$passed" ] && step "serving the passing checkpoint closest to BF16: $passed (Tier 0 KL $best_kl)"
if [ -z "$passed" ]; then
    step "no candidate passed the gate: serving the BF16 model instead"
    passed=$model gate_flag=""
else
    gate_flag="--require-gate"
fi
step "serving $passed on http://127.0.0.1:8000 (Ctrl-C to stop). Try:"
echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "       -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
echo "  and the same held to JSON by a schema (structured outputs) with"
echo "       -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"The capital of France, as JSON\"}],"
echo "            \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"city\", \"schema\":"
echo "            {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}}'"
exec "$bin/driftgate" serve "$passed" --served-model-name smollm2 $gate_flag
