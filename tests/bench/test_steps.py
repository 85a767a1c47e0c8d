"""`driftgate bench steps` on the tiny model, and cluster-sim calibrated from its result."""

import json

from engine.cli import main as driftgate_main


def test_bench_steps_times_each_shape_and_the_sim_calibrates_from_it(tiny_model_dir, tmp_path):
    steps, plot, sim = tmp_path / "steps.json", tmp_path / "steps.png", tmp_path / "sim.json"
    assert driftgate_main(["bench", "steps", str(tiny_model_dir), "--prefill-lens", "8,16,32",
                           "--decode-batches", "1,3", "--decode-context", "12", "--repeats", "2", "--rounds", "2",
                           "--result-json", str(steps), "--plot", str(plot)]) == 0
    result = json.loads(steps.read_text())
    shapes = [(s["kind"], s["num_batched_tokens"], s["num_decode_seqs"]) for s in result["steps"]]
    assert shapes == [("prefill", 8, 0), ("prefill", 16, 0), ("prefill", 32, 0), ("decode", 1, 1), ("decode", 3, 3)]
    assert all(len(s["samples_ms"]) == 4 and s["step_ms"] > 0 for s in result["steps"])
    assert min(result["fit"]["a_ms"], result["fit"]["b_ms_per_token"], result["fit"]["c_ms_per_decode_seq"]) >= 0
    assert plot.stat().st_size > 0

    assert driftgate_main(["cluster-sim", "--workload", "uniform", "--nodes", "2", "--num-requests", "6",
                           "--load", "0.5", "--num-blocks", "128", "--policies", "coordinated",
                           "--calibrate-from", str(steps), "--result-json", str(sim)]) == 0
    (row,) = json.loads(sim.read_text())
    assert row["cost_model"]["a_ms"] == result["fit"]["a_ms"] and str(steps) in row["cost_model"]["calibration"]
