#!/usr/bin/env bash
# On a CUDA machine (one H200 here, via the device tool): the CUDA tests, then the GPU benchmarks.
# Writes gpu-tests.log, gpu-bench.log and h200-DATE.json to $OUT (default bench/results); exit 1
# if either part failed. Needs torch with CUDA, triton, pytest and hypothesis, run from a checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu-info.txt"
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu-info.txt"
timeout 180 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider \
    tests/engine/test_triton_attention.py tests/engine/test_engine_vs_hf.py \
    tests/engine/test_triton_fused.py tests/engine/test_spec_decode.py tests/quant/test_triton_fp8.py \
    tests/quant/test_linear.py tests/engine/test_lora.py tests/engine/test_moe.py tests/engine/test_embeddings.py \
    tests/engine/test_classify.py tests/quant/test_fp4.py tests/evals/test_arms.py tests/engine/test_memory_budget.py \
    2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}
timeout 270 "$PYTHON" -m bench.gpu --out "$OUT/h200-$(date +%F).json" 2>&1 | tee "$OUT/gpu-bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
exit $(( tests != 0 || bench != 0 ))
