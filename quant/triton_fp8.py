"""Dynamic per-token FP8 quantization of activations in one Triton kernel (the CUDA W8A8 path).

In torch, scale-then-cast is ~7 passes over the activations (abs, amax, divide, clamp, divide,
clamp, cast); before an FP8 GEMM at prefill sizes that costs a large share of the GEMM itself.
One program per row reads it twice (absmax, then quantize) and writes the fp8 row and its scale,
with the same arithmetic as quant.fp8: scale = max(absmax / 448, eps), q = clamp(x / scale).
"""

from __future__ import annotations

import torch

from quant.fp8 import _EPS, FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the `gpu` extra; quant.fp8's torch functions do the same without it
    triton = None


if triton is not None:

    @triton.jit
    def _quantize_rows(x_ptr, out_ptr, scale_ptr, cols, stride_x, stride_out,
                       FP8_LIMIT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / FP8_LIMIT, EPS)
        tl.store(scale_ptr + row, scale)
        out_row = out_ptr + row.to(tl.int64) * stride_out
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
            tl.store(out_row + offs, q.to(out_ptr.dtype.element_ty), mask=offs < cols)


def available(x: torch.Tensor) -> bool:
    """CUDA tensors with triton installed (the interpreter also runs it on CPU, for tests)."""
    import os
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) → (fp8 [M, K], fp32 scales [M, 1]), x ≈ q · scale per row."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(max(cols, 16)))
    _quantize_rows[(rows,)](x, out, scale, cols, x.stride(0), out.stride(0),
                            FP8_LIMIT=FP8_MAX, EPS=_EPS, BLOCK=block)
    return out, scale
