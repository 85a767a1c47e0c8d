"""The fused per-token FP8 activation quantizer equals quant.fp8's torch arithmetic.

On CPU it runs in Triton's interpreter, whose fp32→fp8 cast truncates instead of rounding, so
there only the scales are compared; on a GPU (`cuda` mark) the fp8 values are too: the cast
rounds to nearest even as torch's does, and Triton's fast fp32 division may move a value that
sits on a rounding boundary by one fp8 step (at most 1 in 1000 here).
"""

from __future__ import annotations

import pytest
import torch

from engine.layers import triton_support
from quant import triton_fp8
from quant.fp8 import fp8_scale, quantize_fp8

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not triton_support.available(torch.device("cpu")),
                                                 reason="triton is not installed")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or triton_fp8.triton is None, reason="needs CUDA and triton")]),
]


def _activations(rows: int, cols: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g)
    x[0] = 0.0  # a zero row gets the smallest scale, not a division by zero
    x[-1, cols // 2] = 3000.0  # one loud value sets its row's scale
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, cols", [(2, 16), (7, 300), (33, 4096), (3, 9000)])
def test_scales_equal_torch(device, rows, cols):
    x = _activations(rows, cols, device)
    q, scale = triton_fp8.quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, fp8_scale(x, "token"), rtol=1e-6, atol=0)
    if device == "cuda":
        expected = quantize_fp8(x, scale).float()
        got = q.float()
        assert (got == expected).float().mean() > 0.999
        torch.testing.assert_close(got, expected, rtol=0.125, atol=2.0**-9)  # one e4m3 step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols, depth", [(48, 256), (100, 300), (64, 1000)])
def test_gemv_equals_dequantized_matmul(device, cols, depth):
    """Batch-1 FP8 GEMM: (q_x · s_x)(q_w · s_w)ᵀ in fp64 over the same fp8 values (tails in N and K)."""
    rows = 1
    g = torch.Generator().manual_seed(rows * cols)
    x8 = (torch.randn(rows, depth, generator=g) * 50).to(torch.float8_e4m3fn)
    w8 = (torch.randn(cols, depth, generator=g) * 50).to(torch.float8_e4m3fn)
    x_scale = torch.rand(rows, 1, generator=g) + 0.5
    w_scale = torch.rand(1, cols, generator=g) * 1e-3
    expected = (x8.double() * x_scale.double()) @ (w8.double() * w_scale.double().t()).t()
    on = [t.to(device) for t in (x8, x_scale, w8, w_scale)]
    got = triton_fp8.scaled_gemv(*on, out_dtype=torch.float32).double().cpu()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
