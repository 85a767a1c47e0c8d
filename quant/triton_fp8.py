"""Triton kernels of the CUDA FP8 W8A8 path: per-token activation quantization, and the GEMM
for decode-sized batches.

In torch, scale-then-cast is ~7 passes over the activations (abs, amax, divide, clamp, divide,
clamp, cast); before an FP8 GEMM at prefill sizes that costs a large share of the GEMM itself.
One program per row reads it twice (absmax, then quantize) and writes the fp8 row and its scale,
with the same arithmetic as quant.fp8: scale = max(absmax / 448, eps), q = clamp(x / scale).

For one row (batch-1 decode) a GEMM is a pass over the weight, where cuBLASLt's FP8 GEMM read
fp8 bytes at 0.9-1.7 TB/s on the H200 (bf16 F.linear: 2.4-3.2). `scaled_gemv` streams the fp8
weight across many programs, each a narrow slab of output columns, accumulating products
elementwise and reducing once (1.2-2.0 TB/s); fp8 widens exactly, so the products are the W8A8
oracle's. From two rows on, cuBLASLt's GEMM was as fast as the Triton kernels tried.
"""

from __future__ import annotations

import torch

from engine.layers.triton_support import tl, triton
from quant.fp8 import _EPS, FP8_DTYPE, FP8_MAX

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


    @triton.jit
    def _scaled_gemv(out_ptr, x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, cols, depth,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row: products accumulate elementwise across K; one reduction at the end."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for start in range(0, depth, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * depth + k[None, :],
                        mask=(n < cols)[:, None] & (k < depth)[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + k, mask=k < depth, other=0.0).to(tl.float32)
            acc += w * x[None, :]
        y = tl.sum(acc, 1) * tl.load(x_scale_ptr) * tl.load(w_scale_ptr + n, mask=n < cols, other=0.0)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < cols)

def scaled_gemv(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16, *, block_n: int = 8, block_k: int = 512,
                num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """(x8 [1, K] fp8 · x_scale [1, 1]) @ (w8 [N, K] fp8 · w_scale [N] per row)ᵀ → [1, N].

    Products of exact fp8 values summed in fp32: the W8A8 oracle's arithmetic. The tile defaults
    are bench/gpu.py's sweep winner on an H200 (Llama-3-8B shapes); its arguments exist for it.
    """
    cols, depth = w8.shape
    if x8.shape != (1, depth):
        raise ValueError(f"scaled_gemv takes one row of {depth}, got {tuple(x8.shape)}")
    x8, w8 = x8.contiguous(), w8.contiguous()
    out = torch.empty(1, cols, dtype=out_dtype, device=x8.device)
    _scaled_gemv[(triton.cdiv(cols, block_n),)](out, x8, x_scale, w8, w_scale, cols, depth, BLOCK_N=block_n,
                                                BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


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
