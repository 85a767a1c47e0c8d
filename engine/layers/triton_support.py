"""Triton where installed (the `gpu` extra): the import, and whether its kernels can run somewhere.

Kernels run on CUDA tensors; with TRITON_INTERPRET=1 (set by tests/conftest.py on machines with
no GPU) Triton's interpreter runs them on CPU tensors, which is how CI checks their arithmetic.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # serving falls back to torch ops and the CPU kernels
    triton = tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device`."""
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and interpreting()))
