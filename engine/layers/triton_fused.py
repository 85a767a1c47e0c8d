"""The decoder layer's small CUDA ops, each one Triton kernel: RMSNorm (with the residual add),
rotary embedding (in place on q and k), and SwiGLU's silu(gate) · up.

In torch each is 5-10 kernels; a batch-1 decode step of an 8B model ran ~35 kernels per layer,
and at a few microseconds each they cost as much GPU time as reading the weights. Arithmetic is
fp32 with one rounding to the model dtype at the end (torch rounds after each op, so bf16
results can differ in the last bit). The CPU has its C kernels (engine/csrc) for the same ops.
"""

from __future__ import annotations

import torch

from engine.layers.triton_support import tl, triton

if triton is not None:

    @triton.jit
    def _rms_norm(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, cols, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * cols
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # the sum is rounded to the model dtype: it is the next residual
            x = (x.to(tl.float32) + tl.load(residual_ptr + row + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row + offs, x, mask=mask)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / cols + eps)
        normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # as torch: round, then weigh
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_token, stride_head,
                HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        pos = tl.load(positions_ptr + token)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        base = x_ptr + token.to(tl.int64) * stride_token + head * stride_head
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * 2 * HALF + offs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + pos * 2 * HALF + offs, mask=mask, other=0.0)
        tl.store(base + offs, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF + offs, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul(out_ptr, x_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
        silu = gate / (1.0 + tl.exp(-gate))
        tl.store(out_ptr + row * inter + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) · weight, or with `residual` (norm(x + residual) · weight, x + residual); x [T, H] contiguous."""
    cols = x.shape[-1]
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    _rms_norm[(x.numel() // cols,)](out, residual_out, x, residual, weight, cols, eps,
                                    HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out if residual is None else (out, residual_out)


def rotary_in_place(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] (rows may be strided, head vectors contiguous) by cos/sin [positions, D]."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    _rotary[(tokens, heads)](x, positions, cos, sin, x.stride(0), x.stride(1), HALF=half,
                             BLOCK=triton.next_power_of_2(half))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2·I] contiguous (gate then up) → silu(gate) · up [T, I]."""
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul[(x.numel() // x.shape[-1], triton.cdiv(inter, block))](out, x, inter, BLOCK=block)
    return out
