"""scripts/bench_amx_ab.sh: `bench offline` with the AMX routes on and off, alternating, merged."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_amx_ab.sh"


def test_amx_ab_alternates_the_routes_and_takes_medians(tiny_model_dir, tmp_path):
    out = tmp_path / "ab.json"
    env = {**os.environ, "ROUNDS": "2", "DRIFTGATE": str(Path(sys.executable).parent / "driftgate")}
    subprocess.run(["bash", str(SCRIPT), str(tiny_model_dir), str(out), "--num-requests", "2", "--prompt-len", "8",
                    "--output-len", "2"], env=env, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert [(r["round"], r["DRIFTGATE_AMX"]) for r in result["runs"]] == [(1, 1), (1, 0), (2, 1), (2, 0)]
    for amx in (1, 0):
        side = [r for r in result["runs"] if r["DRIFTGATE_AMX"] == amx]
        tok_s = sorted(r["throughput"]["ours"]["output_tok_s"] for r in side)
        assert result["summary"][f"amx={amx}"]["output_tok_s_median"] == sum(tok_s) / 2  # two runs' median
        assert all(r["throughput"]["num_requests"] == 2 and r["batch1"]["prompt_len"] == 8 for r in side)
    assert "--prompt-len 8" in result["command"]


def test_amx_ab_without_arguments_says_how_to_call_it():
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 2 and "usage:" in run.stderr
