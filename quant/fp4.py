"""FP4 E2M1 weights and activations in two scalings, each a compressed-tensors format vLLM serves:

NVFP4 (`nvfp4-pack-quantized`): groups of 16, each group's scale in FP8 E4M3 over one fp32
global scale per tensor.

    global = 448 · 6 / absmax(W)              (the group scales then use FP8's range)
    scale_g = fp8(global · absmax(W_g) / 6)   (stored; a zero becomes FP8's 0.125, as CT does)
    W ≈ value(code) · scale_g / global

MXFP4 (`mxfp4-pack-quantized`, the OCP microscaling format): groups of 32, each scale a power of
two stored as its biased exponent byte (E8M0), no global scale.

    scale_g = 2^(e − 2), e the exponent of absmax(W_g) rounded to a power of two (up from a
              mantissa of 1.75), so the group's largest value lands at 3.5 to 7 scales (above 6: clamped)
    W ≈ value(code) · scale_g

In both, code = e2m1(W / scale), the nearest of 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6 (ties to even,
clamped to ±6). Codes are 4 bits, sign in the high bit and the magnitude's index below; two per
byte, the first column in the low nibble. compressed-tensors' compressors are the oracle (tests).
"""

from __future__ import annotations

import torch

FP4_MAX, FP8_MAX = 6.0, 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
_FP8_EPS = 0.125  # what CT puts in place of a zero group scale
_E8M0_BIAS = 127


def _group_absmax(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """[rows, cols / group_size] fp32 absmax of each group along the rows of x [rows, cols]."""
    rows, cols = x.shape
    if cols % group_size:
        raise ValueError(f"{name} needs input sizes that are multiples of {group_size}, got {cols}")
    return x.detach().float().reshape(rows, cols // group_size, group_size).abs().amax(dim=-1)


class Nvfp4:
    """NVFP4's scaling: FP8 group scales of 16 columns under ``global_scale`` (fp32 [1])."""

    name, group_size, scale_dtype = "NVFP4", 16, torch.float8_e4m3fn

    def __init__(self, global_scale: torch.Tensor) -> None:
        self.global_scale = global_scale.float().reshape(1)

    @classmethod
    def of(cls, x: torch.Tensor) -> Nvfp4:
        """The scaling whose global scale maps x's absmax onto FP8 max × FP4 max."""
        absmax = x.detach().abs().max().float().clamp(min=torch.finfo(torch.float32).tiny)
        return cls((FP8_MAX * FP4_MAX / absmax).reshape(1))

    def group_scales(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols / 16] float8_e4m3fn: each group's absmax / 6, times the global scale."""
        absmax = _group_absmax(x, self.group_size, self.name)
        scales = (self.global_scale.to(absmax.device) * (absmax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX)
        scales = scales.to(torch.float8_e4m3fn)
        eps = torch.tensor(_FP8_EPS, device=scales.device).to(torch.float8_e4m3fn)
        return torch.where(scales.float() == 0, eps, scales)

    def effective(self, scales: torch.Tensor) -> torch.Tensor:
        """[rows, cols / 16] fp32: what each group's codes multiply by."""
        return scales.float() / self.global_scale.to(scales.device)


class Mxfp4:
    """MXFP4's scaling: a power-of-two scale per 32 columns, stored as its E8M0 byte."""

    name, group_size, scale_dtype = "MXFP4", 32, torch.uint8

    @classmethod
    def of(cls, x: torch.Tensor) -> Mxfp4:
        return cls()

    def group_scales(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols / 32] uint8 biased exponents. A zero group gets 0 (its codes are all zero);
        exponents past E8M0's largest finite one are clamped to it (CT would store infinity)."""
        mantissa, exponent = torch.frexp(_group_absmax(x, self.group_size, self.name))  # absmax = m · 2^e, m in [0.5, 1)
        power = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)  # round to a power of two from 1.75 up
        biased = torch.where(mantissa == 0, 0, power - 2 + _E8M0_BIAS)  # E2M1's largest power is 2^2
        return biased.clamp(0, 254).to(torch.uint8)

    def effective(self, scales: torch.Tensor) -> torch.Tensor:
        """[rows, cols / 32] fp32 powers of two (2^-127 is a subnormal fp32, still exact)."""
        return torch.ldexp(torch.ones(scales.shape, device=scales.device), scales.to(torch.int32) - _E8M0_BIAS)


Scaling = Nvfp4 | Mxfp4
SCALINGS: dict[str, type[Nvfp4] | type[Mxfp4]] = {"nvfp4": Nvfp4, "mxfp4": Mxfp4}  # by QuantArgs.fp4_kind


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """[1] fp32: NVFP4's global scale for x."""
    return Nvfp4.of(x).global_scale


def _per_column(scaling: Scaling, scales: torch.Tensor) -> torch.Tensor:
    return scaling.effective(scales).repeat_interleave(scaling.group_size, dim=1)


def quantize(weight: torch.Tensor, scaling: Scaling, scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] uint8 codes (0..15): each value over its group's effective scale, rounded to E2M1."""
    return encode(weight.float() / _per_column(scaling, scales))


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


def fake_quantize(x: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """x as FP4 with its own group scales (under ``scaling``'s global scale, for NVFP4): what an FP4
    GPU computes with for activations, which get their group scales per token at run time."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scales = scaling.group_scales(rows)
    return (values(quantize(rows, scaling, scales)) * _per_column(scaling, scales)).reshape(x.shape).to(x.dtype)


def dequantize(packed: torch.Tensor, scaling: Scaling, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] weights the checkpoint tensors stand for."""
    return (values(unpack(packed)) * _per_column(scaling, scales)).to(dtype)
