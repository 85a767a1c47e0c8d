"""FP8 KV-cache helpers: quantize on write, dequantize on read, and scale validation.

A bad KV scale is a load error, never a silent 1.0: LLMC releases have shipped all-zero
scales, and vLLM's fallback to 1.0 on a missing scale hides calibration bugs.
"""

from __future__ import annotations

import torch

from quant.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating ``x / scale`` → float8_e4m3fn.

    x: [..., num_kv_heads, head_dim]; scale: fp32 [num_kv_heads, 1] (from :func:`validate_kv_scale`).
    """
    return quantize_fp8(x, scale)


def dequantize_kv(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 cache entries → ``dtype`` (x8: [..., num_kv_heads, head_dim])."""
    if x8.dtype != FP8_DTYPE:
        raise ValueError(f"KV cache entries must be {FP8_DTYPE}, got {x8.dtype}")
    return dequantize_fp8(x8, scale, dtype)


def validate_kv_scale(name: str, scale: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """Check a checkpoint KV scale and return it as fp32 [num_kv_heads, 1].

    Accepts shapes [], [1] (per tensor, broadcast to every head) and [num_kv_heads, 1, 1]
    (per head, CT ``attn_head``). Raises ValueError naming ``name`` when the scale is
    missing, has another shape, or holds a zero, negative or non-finite value.
    """
    if scale is None:
        raise ValueError(f"{name}: missing; FP8 KV cache needs a calibrated scale for every layer")
    if not scale.is_floating_point():
        raise ValueError(f"{name}: dtype {scale.dtype} is not a floating-point scale")
    if scale.numel() == 1 and scale.dim() <= 1:
        per_head = scale.reshape(1).float().expand(num_kv_heads)
    elif tuple(scale.shape) == (num_kv_heads, 1, 1):
        per_head = scale.reshape(num_kv_heads).float()
    else:
        raise ValueError(f"{name}: shape {tuple(scale.shape)} is not [], [1] or [{num_kv_heads}, 1, 1]")
    if not torch.isfinite(per_head).all():
        raise ValueError(f"{name}: non-finite value(s) {per_head.tolist()}")
    if (per_head <= 0).any():
        raise ValueError(f"{name}: zero or negative value(s) {per_head.tolist()} (uncalibrated checkpoint?)")
    return per_head.reshape(num_kv_heads, 1).contiguous()
