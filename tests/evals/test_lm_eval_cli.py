"""`driftgate lm-eval`: lm-eval's own command line, with our engine as `--model driftgate`."""

from __future__ import annotations

import json

import pytest
import torch

from engine.cli import main
from evals.arms import TASKS_DIR


def test_lm_evals_command_line_runs_our_engine(tiny_model_dir, data_dir, tmp_path, capsys):
    argv = ["lm-eval", "run", "--model", "driftgate", "--model_args", f"pretrained={tiny_model_dir},dtype=float32",
            "--tasks", "driftgate_piqa", "--include_path", str(TASKS_DIR), "--limit", "4",
            "--metadata", json.dumps({"data_dir": str(data_dir)}), "--output_path", str(tmp_path)]
    assert main(argv) == 0  # lm-eval's CLI asks for cuda:0 by default: here that means the CPU
    (results,) = tmp_path.rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]["driftgate_piqa"]
    assert 0.0 <= scores["acc,none"] <= 1.0
    assert "driftgate_piqa" in capsys.readouterr().out


def test_lm_evals_help_and_errors_are_its_own(capsys):
    assert main(["lm-eval", "--help"]) == 0
    assert "Language Model Evaluation Harness" in capsys.readouterr().out
    assert main(["lm-eval", "run", "--no-such-flag"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without CUDA")
def test_a_cuda_device_without_cuda_runs_on_the_cpu():
    from evals.lm_eval_model import _device

    assert _device("cuda:0") == "cpu" and _device(None) == "auto" and _device("cpu") == "cpu"
