"""``quantize`` on the imported SmolLM2-135M-Instruct (skipped when it has not been imported)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from calibration.cli import main

MODEL_DIR = Path.home() / ".cache" / "driftgate" / "models" / "smollm2-135m-instruct"
DATA_DIR = Path(os.environ.get("DRIFTGATE_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")
CALIB = DATA_DIR / "calib" / "self_instruct_seed_tasks.jsonl"

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                       reason=f"SmolLM2 not imported at {MODEL_DIR} (driftgate import-model smollm2-135m)"),
    pytest.mark.skipif(not CALIB.is_file(), reason=f"calibration set not found at {CALIB}"),
]


def test_w4a16_rtn_with_few_samples(tmp_path):
    from transformers import AutoTokenizer

    from engine.loader import load_model

    out = tmp_path / "smollm2-w4a16"
    assert main([str(MODEL_DIR), "--calib", str(CALIB), "-o", str(out), "--scheme", "w4a16", "--kv-cache", "fp8",
                 "--num-samples", "8", "--num-heldout", "4", "--max-seq-len", "128"]) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert report["group_size"] == 64  # hidden 576 = 9 × 64: 128 does not divide it
    assert len(report["layers"]) == 30
    assert all(0 < layer["output_error"] < 0.5 for layer in report["layers"])
    assert all(min(layer["k_absmax"]) > 0 and min(layer["v_absmax"]) > 0 for layer in report["layers"])

    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    prompt = torch.tensor(AutoTokenizer.from_pretrained(MODEL_DIR)(text)["input_ids"])
    positions = torch.arange(prompt.numel())
    top1 = {}
    for key, folder in (("bf16", MODEL_DIR), ("w4a16", out)):
        model, _ = load_model(folder, dtype=torch.float32)
        with torch.no_grad():
            top1[key] = model.compute_logits(model(prompt, positions)).argmax(-1)
    agreement = (top1["bf16"] == top1["w4a16"]).float().mean().item()
    assert agreement >= 0.5, agreement
