"""Shared fixtures: tiny random models (built once per session) and the real default model if imported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (the CUDA backend) run on CPU tensors in Triton's interpreter; read when
    # kernels are defined, so before any test imports engine.layers.triton_attention.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import make_tiny_model_dir, write_lora_adapter

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared evaluation data (../shared/data, or $DRIFTGATE_DATA). CI has it, so there a missing
    folder fails the tests that read it; a checkout without it skips them, saying where to point."""
    from evals.data import DATA_ENV_VAR, DataMissingError, resolve_data_dir

    try:
        return resolve_data_dir()
    except DataMissingError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc}; CI runs with the shared data beside the checkout")
        pytest.skip(f"{exc}; set ${DATA_ENV_VAR} to the shared data folder to run this test")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_lora_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter on the tiny model's q, v and down projections."""
    pytest.importorskip("peft")
    return write_lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("tiny-lora") / "adapter",
                              ["q_proj", "v_proj", "down_proj"], seed=5)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from engine.model_import import default_model_dir, is_imported

    path = default_model_dir()
    if not is_imported(path):
        pytest.skip(f"the default model is not imported at {path}; run `make model` first")
    return path
