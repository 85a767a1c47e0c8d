"""`driftgate bench matmul` on the tiny model's shapes: every contender checked, timed, plotted."""

import json

import pytest

from bench.matmul import _contenders
from engine.cli import main as driftgate_main
from engine.layers import panel_matmul


def test_bench_matmul_times_every_kernel_at_every_row_count(tiny_model_dir, tmp_path):
    """17 rows: the W8A8 and FP8 contenders take AMX tiles where the CPU has them."""
    amx = panel_matmul.use_amx()
    out, plot = tmp_path / "matmul.json", tmp_path / "matmul.png"
    assert driftgate_main(["bench", "matmul", str(tiny_model_dir), "--rows", "1,3,17", "--runs", "2",
                           "--result-json", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    kernels = list(_contenders())
    assert "linear" in kernels
    assert [(r["rows"], r["kernel"]) for r in result["rows"]] == [(n, k) for n in (1, 3, 17) for k in kernels]
    assert all(len(r["runs"]) == 2 and r["layers_ms"] > 0 and r["lm_head_ms"] > 0 for r in result["rows"])
    assert result["layer_shapes"][0] == [64 + 2 * 32, 64]  # fused qkv of 4 heads + 2 KV heads of 16 dims
    assert plot.stat().st_size > 0
    assert panel_matmul.use_amx() == amx  # the AMX contenders leave the route as they found it


def test_bad_rows_are_a_usage_error(tiny_model_dir):
    with pytest.raises(SystemExit):
        driftgate_main(["bench", "matmul", str(tiny_model_dir), "--rows", "0,2"])
