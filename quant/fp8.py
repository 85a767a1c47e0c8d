"""FP8 (float8_e4m3fn) quantize / dequantize with multiply-to-dequantize scales.

PyTorch's cast to float8 does not saturate (out-of-range becomes NaN), so every quantize
clamps to ±448 first, as compressed-tensors and vLLM's kernels do.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_EPS = torch.finfo(torch.float32).eps


def fp8_scale(x: torch.Tensor, strategy: str) -> torch.Tensor:
    """absmax / 448 over the whole tensor ([1]) or per row (channel/token: [rows, 1]), fp32.

    Rows are the last-dim slices; zero rows get a tiny scale instead of 0 so division stays finite.
    """
    a = x.detach().abs().float()  # abs+amax: ~10x faster on CPU than vector_norm(ord=inf)
    if strategy == "tensor":
        amax = a.amax().reshape(1)
    elif strategy in ("channel", "token"):
        amax = a.amax(-1, keepdim=True)
    else:
        raise ValueError(f"fp8 scales support tensor/channel/token, got {strategy!r}")
    return (amax / FP8_MAX).clamp_(min=_EPS)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating cast of ``x / scale`` to float8_e4m3fn (scale broadcasts over x)."""
    return (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x8 · scale`` in ``dtype`` (computed in fp32)."""
    return (x8.float() * scale.float()).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-trip through FP8 in x's dtype: what an FP8 kernel sees of ``x``."""
    return quantize_fp8(x, scale).float().mul_(scale).to(x.dtype)


def tile_scales(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """absmax / 448 per tile of ``block`` (rows, columns) → fp32 [row tiles, column tiles]; the
    last tiles of each dimension may be partial."""
    (block_rows, block_cols), (rows, cols) = block, weight.shape
    padded = torch.nn.functional.pad(weight.detach().abs().float(), (0, -cols % block_cols, 0, -rows % block_rows))
    tiles = padded.reshape(-(-rows // block_rows), block_rows, -(-cols // block_cols), block_cols)
    return (tiles.amax(dim=(1, 3)) / FP8_MAX).clamp_(min=_EPS)


def spread_tiles(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Tile scales [row tiles, column tiles] → one per weight element [rows, columns], fp32."""
    (block_rows, block_cols), (rows, cols) = block, shape
    return scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
