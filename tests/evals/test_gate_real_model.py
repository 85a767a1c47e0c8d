"""`driftgate gate` on the real SmolLM2-135M: it separates a faithful checkpoint from a drifting one.

Three candidates against the imported BF16 model, under a reduced policy sized for a test
run (one cheap MC task, short Tier 0, no Tier 2 or noise floor): a byte copy passes with
zero flips, fp8-dynamic passes, and a checkpoint with noise in one layer fails with the
report naming that layer. The baseline arm runs once and is cached for the other two.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evals import data, verdict
from evals.cli import EXIT_DRIFT, EXIT_PASS, add_gate_args, run_gate

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

# Coarse on purpose: ~80 paired items resolve only large drops, so the margins are wide. It
# still fails a scorer at chance, a layer-sized fault (Tier 0) and a big accuracy loss.
REDUCED_POLICY = """
inconclusive = "fail"

[engine]
max_num_batched_tokens = 2048
max_num_seqs = 64
max_model_len = 2048
block_size = 4

[noise_floor]
enabled = false

[tier0]
num_documents = 2
max_tokens_per_sequence = 256
max_kl_mean = 0.05
max_kl_p99 = 1.0
min_top1_agreement = 0.85

[tier1]
max_pooled_drop = 0.10
max_flip_rate_above_floor = 0.10
max_confident_flip_rate = 0.05

[[tier1.tasks]]
name = "driftgate_arc_easy"
metric = "acc_norm,none"
items = 80
chance = 0.25

[tier2]
enabled = false
"""
DAMAGED_LAYER = 10
DAMAGED_WEIGHT = f"model.layers.{DAMAGED_LAYER}.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def env(real_model_dir, tmp_path_factory, data_dir) -> tuple[Path, Path, Path]:
    """(model, work folder, policy); the gate's baseline cache lives in the work folder, shared by the tests."""
    if not (data_dir / "calib" / "self_instruct_seed_tasks.jsonl").is_file():
        pytest.skip("calibration set not present")
    root = tmp_path_factory.mktemp("gate-real")
    policy = root / "reduced.toml"
    policy.write_text(REDUCED_POLICY)
    return real_model_dir, root, policy


def _gate(env: tuple[Path, Path, Path], candidate: Path) -> tuple[int, dict, str]:
    model, root, policy = env
    parser = argparse.ArgumentParser()
    add_gate_args(parser)
    report_dir = root / f"{candidate.name}-report"
    code = run_gate(parser.parse_args(["--baseline", str(model), "--candidate", str(candidate), "--policy",
                                       str(policy), "--cache-dir", str(root / "cache"),
                                       "--report-dir", str(report_dir)]))
    return code, json.loads((report_dir / "report.json").read_text()), (report_dir / "report.md").read_text()


def test_bf16_copy_passes_with_zero_flips(env):
    model, root, _ = env
    copy = root / "bf16-copy"
    shutil.copytree(model, copy)
    code, report, _ = _gate(env, copy)
    assert code == EXIT_PASS, [c for c in report["checks"] if c["status"] != "pass"]
    pooled = report["tier1"]["pooled"]
    assert pooled["right_to_wrong"] == 0 and pooled["wrong_to_right"] == 0
    assert report["tier0"]["overall"]["kl_mean"] == pytest.approx(0.0, abs=1e-9)
    assert max(report["tier0"]["by_layer"]["relative_drift"]) == pytest.approx(0.0, abs=1e-9)
    verdict.check_verdict(copy)


def test_fp8_dynamic_passes(env):
    from calibration.cli import main as quantize

    model, root, _ = env
    fp8 = root / "fp8-dynamic"
    calib = data.resolve_data_dir() / "calib" / "self_instruct_seed_tasks.jsonl"
    assert quantize([str(model), "--calib", str(calib), "--scheme", "fp8-dynamic", "-o", str(fp8),
                     "--num-samples", "8", "--num-heldout", "0", "--max-seq-len", "64"]) == 0
    code, report, _ = _gate(env, fp8)
    assert code == EXIT_PASS, [c for c in report["checks"] if c["status"] != "pass"]
    assert 0 < report["tier0"]["overall"]["kl_mean"]  # it is a different checkpoint, just a faithful one
    verdict.check_verdict(fp8)


def test_noise_in_one_layer_fails_and_the_report_names_the_layer(env):
    model, root, _ = env
    damaged = root / "damaged"
    shutil.copytree(model, damaged)
    tensors = load_file(damaged / "model.safetensors")
    weight = tensors[DAMAGED_WEIGHT].float()
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * weight.std()
    tensors[DAMAGED_WEIGHT] = (weight + noise).to(tensors[DAMAGED_WEIGHT].dtype)  # noise as large as the weights
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})

    code, report, markdown = _gate(env, damaged)
    assert code == EXIT_DRIFT
    failed = {c["name"] for c in report["checks"] if c["status"] == "fail"}
    assert "tier0.kl_mean" in failed
    layers = report["tier0"]["by_layer"]
    assert layers["largest_step_layer"] == DAMAGED_LAYER
    assert max(layers["relative_drift"][:DAMAGED_LAYER]) == pytest.approx(0.0, abs=1e-9)  # untouched layers agree
    assert f"model.layers.{DAMAGED_LAYER})" in markdown.splitlines()[0]  # the verdict line points at it
    with pytest.raises(verdict.VerdictError, match="failing"):
        verdict.check_verdict(damaged)
