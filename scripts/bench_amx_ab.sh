#!/usr/bin/env bash
# The AMX routes end to end: `driftgate bench offline` on one checkpoint with DRIFTGATE_AMX=1 and 0
# alternating (so the shared machine's noise lands on both), ROUNDS rounds (default 3), merged into
# one JSON: every run, and per side the medians of output tok/s at 32 concurrent requests and of
# batch-1 TTFT and decode tok/s.
#
#   scripts/bench_amx_ab.sh CKPT OUT.json [more `bench offline` arguments]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 CKPT OUT.json [bench offline args]" >&2; exit 2; }
ckpt=$1 out=$2
shift 2
rounds=${ROUNDS:-3}
driftgate=${DRIFTGATE:-driftgate}
args=(--no-hf --dataset random --prompt-len 256 --output-len 128 --num-requests 32 --runs 1 "$@")
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for round in $(seq "$rounds"); do
  for amx in 1 0; do
    DRIFTGATE_AMX=$amx "$driftgate" bench offline "$ckpt" "${args[@]}" --result-json "$runs/$round-$amx.json"
  done
done
python3 - "$runs" "$out" "$rounds" "DRIFTGATE_AMX=\$amx driftgate bench offline $ckpt ${args[*]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
runs_dir, out, rounds, command = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
runs, summary = [], {}
for round_ in range(1, rounds + 1):
    for amx in (1, 0):
        run = json.loads((runs_dir / f"{round_}-{amx}.json").read_text())
        runs.append({"round": round_, "DRIFTGATE_AMX": amx, **run})
for amx in (1, 0):
    side = [r for r in runs if r["DRIFTGATE_AMX"] == amx]
    summary[f"amx={amx}"] = {
        "output_tok_s_median": statistics.median(r["throughput"]["ours"]["output_tok_s"] for r in side),
        "batch1_ttft_s_median": statistics.median(r["batch1"]["ours"]["ttft_s"] for r in side),
        "batch1_decode_tok_s_median": statistics.median(r["batch1"]["ours"]["decode_tok_s"] for r in side)}
out.write_text(json.dumps({"command": command, "rounds": rounds, "summary": summary, "runs": runs}, indent=1) + "\n")
print(json.dumps(summary, indent=1))
EOF
