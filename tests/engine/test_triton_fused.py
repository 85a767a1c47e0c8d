"""The fused Triton ops (RMSNorm + residual, rotary, silu·mul) equal their torch definitions.

CPU: Triton's interpreter (tests/conftest.py); the `cuda` cases run the compiled kernels. fp32
agrees to rounding (1e-5); bf16 rounds once where torch rounds after each op (one bf16 step, 1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import triton_fused, triton_support
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, _rotate_half

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not triton_support.available(torch.device("cpu")),
                                                 reason="triton is not installed")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or triton_fused.triton is None, reason="needs CUDA and triton")]),
]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    err = ((got.double().cpu() - expected.double().cpu()).norm() / expected.double().cpu().norm()).item()
    assert err < tol, err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_with_and_without_residual(device, dtype, tol, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(5, hidden, generator=g).to(dtype).to(device) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5, dtype).to(device)
    norm.weight.copy_(torch.rand(hidden, generator=g).to(dtype))
    _close(triton_fused.rms_norm(x, norm.weight, norm.eps), norm._norm(x), tol)
    out, total = triton_fused.rms_norm(x, norm.weight, norm.eps, residual)
    _close(total, x + residual, tol)
    _close(out, norm._norm(x + residual), tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_a_strided_view(device, dtype, tol, head_dim):
    """q and k heads side by side in a fused qkv row, as the model passes them."""
    g = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 500000.0, None)
    qkv = torch.randn(6, 7 * head_dim, generator=g).to(dtype).to(device)
    positions = torch.tensor([0, 1, 2, 100, 2000, 4095], device=device)
    qk = qkv[:, :6 * head_dim].view(6, 6, head_dim)  # rows strided by 7 heads
    cos, sin = rotary.cos[positions.cpu()].unsqueeze(1), rotary.sin[positions.cpu()].unsqueeze(1)
    expected = qk.float().cpu() * cos + _rotate_half(qk.float().cpu()) * sin
    untouched = qkv[:, 6 * head_dim:].clone()
    triton_fused.rotary_in_place(qk, positions, rotary.cos.to(device), rotary.sin.to(device))
    _close(qk, expected, tol)
    assert torch.equal(qkv[:, 6 * head_dim:], untouched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("inter", [96, 1536, 3000])
def test_silu_and_mul(device, dtype, tol, inter):
    x = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype).to(device)
    gate, up = x.float().chunk(2, dim=-1)
    _close(triton_fused.silu_and_mul(x), F.silu(gate) * up, tol)
