"""The GPU benchmark harness on CPU with tiny shapes: random models, decode timing, KV capacity."""

from __future__ import annotations

import torch

from bench import gpu
from engine.models.llama import LlamaArgs


def test_random_model_decodes_and_counts_its_weight_bytes():
    model = gpu.random_model(gpu.TINY, "bf16", "cpu")
    linears = [m for m in model.modules() if hasattr(m, "load_shard")]
    assert gpu.weight_bytes(model) == sum(m.weight.nbytes for m in linears)
    row = gpu.decode(model, batch=2, context=40, kv_dtype=torch.bfloat16, steps=2)
    assert row["batch"] == 2 and row["tokens_per_s"] > 0 and row["kv_cache_bytes"] > 0
    drafted = gpu.decode(model, batch=2, context=40, kv_dtype=torch.bfloat16, steps=2, drafts=4)
    assert drafted["drafts"] == 4 and drafted["step_ms"] > 0


def test_fp8_kv_fits_twice_the_sequences():
    args = LlamaArgs.from_hf_config(gpu.TINY)
    fits = gpu.kv_capacity(args, 64 << 20, 1024)["sequences"]
    assert fits["float8_e4m3fn"] == 2 * fits["bfloat16"] > 0


def test_the_gpu_check_script_names_test_files_that_exist():
    """bench/gpu_check.sh runs once per lent GPU: a renamed test file must not silently drop out of it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    named = re.findall(r"tests/\S+\.py", (root / "bench" / "gpu_check.sh").read_text())
    assert named and all((root / path).is_file() for path in named), [p for p in named if not (root / p).is_file()]
