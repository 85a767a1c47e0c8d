"""Integer weight quantization (4/8-bit, tensor/channel/group, sym/asym) and CT int32 packing.

Conventions are compressed-tensors': scales multiply to dequantize, ``x̂ = (q − zp)·scale``;
symmetric scale = absmax / ((q_max − q_min)/2) (absmax/7.5 for INT4), so −8 is reachable and
the positive extreme clips to +7; groups are consecutive input columns unless ``g_idx`` says otherwise.
"""

from __future__ import annotations

import sys

import torch

_EPS = torch.finfo(torch.float32).eps


def int_range(num_bits: int) -> tuple[int, int]:
    """Signed range of a ``num_bits`` integer: (−2^(b−1), 2^(b−1) − 1)."""
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


def num_groups(in_features: int, group_size: int | None) -> int:
    """Scale columns for a weight of ``in_features`` columns (1 for tensor/channel)."""
    return 1 if group_size is None else -(-in_features // group_size)


def column_groups(in_features: int, group_size: int | None, g_idx: torch.Tensor | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Group index of every input column: ``g_idx`` if given, else consecutive groups."""
    if g_idx is not None:
        return g_idx.long()
    if group_size is None:
        return torch.zeros(in_features, dtype=torch.long, device=device)
    return torch.arange(in_features, device=device) // group_size


def compute_qparams(
    weight: torch.Tensor, num_bits: int, *, group_size: int | None, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scales (and zero points) per row and consecutive group.

    weight: [out, in]. Returns scale fp32 [out, n_groups] and, when asymmetric, zero_point
    int8 [out, n_groups]. A last partial group covers the remaining columns.
    """
    out, in_features = weight.shape
    g = group_size or in_features
    n = num_groups(in_features, group_size)
    w = weight.float()
    if n * g != in_features:
        # Pad with zeros: min/max are widened to include 0 anyway.
        w = torch.nn.functional.pad(w, (0, n * g - in_features))
    w = w.view(out, n, g)
    qmin, qmax = int_range(num_bits)
    lo = w.amin(-1).clamp(max=0)  # [out, n]
    hi = w.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(-lo, hi) / ((qmax - qmin) / 2)
        return scale.clamp(min=_EPS), None
    scale = ((hi - lo) / (qmax - qmin)).clamp(min=_EPS)
    zero_point = torch.round(qmin - lo / scale).clamp(qmin, qmax).to(torch.int8)
    return scale, zero_point


def _per_column(t: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    # t: [out, n_groups] (or [out, 1]) → [out, in]
    return t[:, groups] if t.shape[1] > 1 else t.expand(-1, groups.numel())


def quantize_int(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    *,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """q = clamp(round(w / scale + zp)), returned as int8 [out, in]."""
    groups = column_groups(weight.shape[1], group_size, g_idx, weight.device)
    q = weight.float() / _per_column(scale.float(), groups)
    if zero_point is not None:
        q = q + _per_column(zero_point.float(), groups)
    qmin, qmax = int_range(num_bits)
    return torch.round(q).clamp(qmin, qmax).to(torch.int8)


def dequantize_int(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    *,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x̂ = (q − zp) · scale, [out, in] in ``dtype`` (computed in fp32)."""
    groups = column_groups(q.shape[1], group_size, g_idx, q.device)
    w = q.float()
    if zero_point is not None:
        w = w - _per_column(zero_point.float(), groups)
    return (w * _per_column(scale.float(), groups)).to(dtype)


def fake_quantize_int(
    weight: torch.Tensor, num_bits: int, *, group_size: int | None, symmetric: bool
) -> torch.Tensor:
    """Round-to-nearest quantize then dequantize (min-max scales), same shape and dtype."""
    scale, zp = compute_qparams(weight, num_bits, group_size=group_size, symmetric=symmetric)
    q = quantize_int(weight, scale, zp, num_bits, group_size=group_size)
    return dequantize_int(q, scale, zp, group_size=group_size, dtype=weight.dtype)


def pack_int32(q: torch.Tensor, num_bits: int, *, dim: int = 1) -> torch.Tensor:
    """Pack signed ``num_bits`` values (4 or 8) into int32 words along ``dim`` (CT layout).

    Each value is offset by 2^(b−1) to unsigned; element i of a word sits at bits
    ``b·(i % (32/b))``, the first element in the least-significant bits. The tail is padded
    with unsigned zeros. q: [rows, cols] → dim 1: [rows, ceil(cols·b/32)]; dim 0: [ceil(rows·b/32), cols].
    """
    if num_bits not in (4, 8):
        raise ValueError(f"packing supports 4 or 8 bits, got {num_bits}")
    if dim == 0:
        return pack_int32(q.t(), num_bits, dim=1).t().contiguous()
    per_word = 32 // num_bits
    rows, cols = q.shape
    words = -(-cols // per_word)
    u = (q.to(torch.int64) + (1 << (num_bits - 1))).clamp(0, (1 << num_bits) - 1)
    u = torch.nn.functional.pad(u, (0, words * per_word - cols)).view(rows, words, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=q.device) * num_bits
    packed = (u << shifts).sum(-1)  # [rows, words], uint32 range in int64
    # Reinterpret the unsigned 32-bit pattern as int32 (top nibble ≥ 8 ⇒ negative word).
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int], *, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 words → int8 values of ``shape`` (padding dropped)."""
    if num_bits not in (4, 8):
        raise ValueError(f"packing supports 4 or 8 bits, got {num_bits}")
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, (shape[1], shape[0]), dim=1).t().contiguous()
    if packed.dtype != torch.int32 or sys.byteorder != "little":
        raise ValueError(f"unpack_int32 reads int32 words as little-endian bytes, got {packed.dtype} on a {sys.byteorder}-endian host")
    # a word's bytes, least significant first: byte i of a row holds value i at 8 bits, values 2i
    # and 2i + 1 in its low and high nibbles at 4; byte-wide steps make no temporary wider than
    # the unpacked values
    u = packed.contiguous().reshape(-1).view(torch.uint8)  # flat: a [G, 1] view may keep a stride ≠ 1
    if num_bits == 4:
        u = torch.stack((u & 15, u >> 4), dim=-1)
    u = u.reshape(packed.shape[0], -1)[: shape[0], : shape[1]]
    if num_bits == 8:
        return (u ^ 0x80).view(torch.int8)  # u − 128 in two's complement
    return u.to(torch.int8) - 8
