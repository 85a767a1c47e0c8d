"""`driftgate bench schemes` end to end on tiny checkpoints (llama.cpp skipped: it is not built in CI)."""

import argparse
import json

import pytest

from bench.schemes import Checkpoint, size_on_disk
from engine.cli import main as driftgate_main


def test_checkpoint_spec_parsing(tiny_model_dir):
    assert Checkpoint.parse(f"w4={tiny_model_dir}@bfloat16") == Checkpoint("w4", tiny_model_dir, "bfloat16")
    assert Checkpoint.parse(f"fp32={tiny_model_dir}").dtype == "auto"
    for bad in ["nodir", f"={tiny_model_dir}", "x=/no/such/folder"]:
        with pytest.raises(argparse.ArgumentTypeError):
            Checkpoint.parse(bad)


def test_bench_schemes_runs_each_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "schemes.json"
    rc = driftgate_main(["bench", "schemes", f"a={tiny_model_dir}", f"b={tiny_model_dir}@bfloat16",
                         "--llama-cpp", "", "--runs", "2", "--concurrency", "3", "--prompt-len", "16",
                         "--output-len", "4", "--result-json", str(out), "--plot", str(tmp_path / "s.png")])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"a", "b"} and rows["b"]["dtype"] == "torch.bfloat16"
    for row in rows.values():
        assert len(row["runs"]) == 2 and row["batch1_decode_tok_s"] > 0 and row["concurrent_output_tok_s"] > 0
        assert row["size_bytes"] == size_on_disk(tiny_model_dir) > 0
    # the engine holds the fp32 model's weights (no fewer bytes than the file), the bf16 one about half
    assert rows["a"]["resident_weight_bytes"] >= size_on_disk(tiny_model_dir)
    assert rows["b"]["resident_weight_bytes"] < 0.6 * rows["a"]["resident_weight_bytes"]
    assert (tmp_path / "s.png").stat().st_size > 0
