"""`driftgate bench attention` on the tiny model's head shape: both contenders checked, timed, plotted."""

import json

import pytest
import torch

from engine.cli import main as driftgate_main
from engine.layers import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(torch.float32, torch.device("cpu"), "prefill"),
                                reason="no C compiler for the attention kernels")


def test_bench_attention_times_both_contenders_at_every_length(tiny_model_dir, tmp_path):
    """Three prompts a call: the kernel's batched output must equal SDPA's prompt by prompt (checked before timing)."""
    out, plot = tmp_path / "attention.json", tmp_path / "attention.png"
    assert driftgate_main(["bench", "attention", str(tiny_model_dir), "--prompt-lens", "7,40", "--prompts", "3",
                           "--runs", "2", "--block-size", "4", "--result-json", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    assert [(r["prompt_len"], r["kernel"]) for r in result["rows"]] == [
        (n, k) for n in (7, 40) for k in ("c-kernel", "sdpa")]
    assert all(len(r["runs"]) == 2 and r["ms"] > 0 and r["gflop_s"] > 0 for r in result["rows"])
    assert (result["prompts"], result["num_heads"], result["num_kv_heads"], result["head_dim"]) == (3, 4, 2, 16)
    assert plot.stat().st_size > 0
