"""NVFP4 weights: FP4 E2M1 values in groups of 16, each group's scale in FP8 E4M3 over one fp32
global scale per tensor (compressed-tensors' `nvfp4-pack-quantized`, what vLLM serves on FP4 GPUs).

    global = 448 · 6 / absmax(W)              (the group scales then use FP8's range)
    scale_g = fp8(global · absmax(W_g) / 6)   (stored; a zero becomes FP8's 0.125, as CT does)
    code = e2m1(W / (scale_g / global))       (nearest of 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6, ties to even)
    W ≈ value(code) · scale_g / global

Codes are 4 bits, sign in the high bit and the magnitude's index below; two per byte, the
first column in the low nibble. compressed-tensors' NVFP4 compressor is the oracle (tests).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 16
FP4_MAX, FP8_MAX = 6.0, 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
_FP8_EPS = 0.125  # what CT puts in place of a zero group scale


def global_scale(weight: torch.Tensor) -> torch.Tensor:
    """[1] fp32: maps the tensor's absmax onto FP8 max × FP4 max."""
    absmax = weight.detach().abs().max().float().clamp(min=torch.finfo(torch.float32).tiny)
    return (FP8_MAX * FP4_MAX / absmax).reshape(1)


def group_scales(weight: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """[out, in / 16] float8_e4m3fn: each group's absmax / 6, times the global scale."""
    out, cols = weight.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"NVFP4 needs input sizes that are multiples of {GROUP_SIZE}, got {cols}")
    absmax = weight.detach().float().reshape(out, cols // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    scales = (global_.float() * (absmax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    eps = torch.tensor(_FP8_EPS, device=scales.device).to(torch.float8_e4m3fn)
    return torch.where(scales.float() == 0, eps, scales)


def effective_scales(scales: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """[out, in / 16] fp32: what each group's codes multiply by."""
    return scales.float() / global_.float()


def quantize(weight: torch.Tensor, scales: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 codes (0..15): each weight over its group's effective scale, rounded to E2M1."""
    per_column = effective_scales(scales, global_).repeat_interleave(GROUP_SIZE, dim=1)
    return encode(weight.float() / per_column)


def encode(scaled: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scales → uint8 codes of the nearest E2M1 values (clamped to ±6)."""
    x = scaled.clamp(-FP4_MAX, FP4_MAX)
    magnitude, midpoints = x.abs(), _MIDPOINTS.to(x.device)
    index = torch.bucketize(magnitude, midpoints)  # a tie lands on the lower neighbour ...
    tie_to_odd = (index < len(midpoints)) & (magnitude == midpoints[index.clamp(max=len(midpoints) - 1)])
    index = torch.where(tie_to_odd & (index % 2 == 1), index + 1, index)  # ... unless that one is odd
    # a negative weight that rounds to zero keeps its sign (code 8, -0), as CT packs it
    return index.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes → their fp32 E2M1 values."""
    magnitude = E2M1.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes → [out, in / 2] uint8, column 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] uint8 → [out, in] codes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def fake_quantize(x: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """NVFP4 activations (W4A4), as the FP4 GPU computes with them: each token's groups of 16 get
    a scale of their own at run time under the calibrated global one, and x becomes its E2M1 values
    times those scales."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scales = group_scales(rows, global_)
    per_column = effective_scales(scales, global_).repeat_interleave(GROUP_SIZE, dim=1)
    return (values(quantize(rows, scales, global_)) * per_column).reshape(x.shape).to(x.dtype)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] weights the checkpoint tensors stand for."""
    per_column = effective_scales(scales, global_).repeat_interleave(GROUP_SIZE, dim=1)
    return (values(unpack(packed)) * per_column).to(dtype)
