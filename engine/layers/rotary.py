"""Rotary position embedding (HF "rotate half" layout), with Llama 3, LongRoPE and YaRN frequency scaling
(and dynamic NTK, which within the served context is the plain one)."""

from __future__ import annotations

import ctypes
import math

import torch
from torch import nn

from engine.layers import cpu_kernels, triton_fused, triton_support

_ARGTYPES = (*[ctypes.c_void_p] * 4, ctypes.c_int, ctypes.c_int64, *[ctypes.c_int] * 4)


def _kernel() -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("rotary", "rotary_f32", _ARGTYPES, None)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 long-context scaling: slow down low frequencies, keep high ones, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _longrope(inv_freq: torch.Tensor, scaling: dict, max_positions: int,
              served_context: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, from the long list when the
    served context goes past the pretraining one, else the short list; cos and sin scaled by
    sqrt(1 + ln(extension) / ln(pretraining context)).

    HF and vLLM switch lists per forward pass by the longest position in it, so a token's keys
    would depend on what was batched or cached with it; here the served context decides once,
    which keeps prefix-cache hits and batching exact (serve --max-model-len at or under the
    pretraining context to get the short factors, as HF uses them for short sequences)."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if (served_context or max_positions) > original else scaling["short_factor"]
    extension = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(extension) / math.log(original)) if extension > 1 else 1.0
    return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu"), attention_factor


def _yarn(theta: float, rotary_dim: int, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 long context, DeepSeek): high frequencies keep their rotations, low ones
    are interpolated by `factor`, and a linear ramp between the dims whose wavelength fits
    beta_fast and beta_slow times in the pretraining context blends the two; cos and sin are
    scaled by 0.1 ln(factor) + 1 (or the ratio of two such terms with mscale / mscale_all_dim)."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        weight, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(weight) / mscale(all_dims) if weight and all_dims else mscale(1.0)

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the context
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the rotation), 0: interpolate
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, attention_factor


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position, shared by every layer of a model.

    The first `rotary_dim` dims of each head rotate (all of them but in partially rotary models
    such as Phi-4-mini). The tables are plain attributes, not buffers: moving one layer (the
    calibration pipeline sends each finished layer to the meta device) must not move the table
    the others use. They follow the device of the positions they are asked for.
    """

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 served_context: int | None = None):
        super().__init__()
        self.rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if self.rope_type not in ("default", "linear", "llama3", "longrope", "yarn", "dynamic", None):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r} "
                             "(supported: default, linear, llama3, longrope, yarn, dynamic)")
        # dynamic NTK grows the base only for sequences past max_position_embeddings, which caps
        # the served context: within it, HF's frequencies are the plain ones
        self.rotary_dim, self.max_positions, self.theta, self.scaling = rotary_dim, max_positions, theta, scaling
        self.cos, self.sin = self._tables(served_context)
        self._last_positions: torch.Tensor | None = None
        self._last = (self.cos, self.sin)

    def _tables(self, served_context: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, [max_positions, rotary_dim]."""
        rotary_dim, scaling = self.rotary_dim, self.scaling
        dims = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (self.theta ** (dims / rotary_dim))
        attention_factor = 1.0
        if self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif self.rope_type == "longrope":
            inv_freq, attention_factor = _longrope(inv_freq, scaling, self.max_positions, served_context)
        elif self.rope_type == "yarn":
            inv_freq, attention_factor = _yarn(self.theta, rotary_dim, scaling, self.max_positions)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        # [max_positions, rotary_dim]: the two halves repeat so rotate_half needs no re-indexing
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor

    def serve(self, served_context: int) -> None:
        """The engine serves `served_context` tokens after all (its KV cache holds no more): LongRoPE's
        factors follow the served context, so its tables are rewritten in place (kernels that hold
        them keep valid pointers); other scalings do not depend on it."""
        if self.rope_type == "longrope":
            cos, sin = self._tables(served_context)
            self.cos.copy_(cos)
            self.sin.copy_(sin)
            self._last_positions = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (queries and keys together) → rotated, same shape.

        On CPU fp32 the C kernel, and on CUDA a Triton kernel, rotate x in place (x may be a
        row-strided view of the fused qkv output) and return it; elsewhere the result is a new tensor.
        """
        if self._rotate_in_place(positions, x):
            return x
        whole_heads = self.rotary_dim == x.shape[-1]
        if whole_heads and x.is_cuda and triton_support.available(x.device) and x.stride(2) == 1:
            self._tables_on(x.device)
            triton_fused.rotary_in_place(x, positions, self.cos, self.sin)
            return x
        cos, sin = self._lookup(positions, x.dtype)
        if whole_heads:
            return x * cos + _rotate_half(x) * sin
        rotating = x[..., :self.rotary_dim]  # partial rotation: the leading dims turn, the rest pass
        return torch.cat([rotating * cos + _rotate_half(rotating) * sin, x[..., self.rotary_dim:]], dim=-1)

    def _rotate_in_place(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """Apply the C kernel where it fits (fp32 CPU, head vectors contiguous within each row)."""
        num_tokens, heads, head_dim = x.shape
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(2) != 1 or x.stride(1) != head_dim
                or positions.dtype != torch.int64 or not positions.is_contiguous() or self.cos.device != x.device):
            return False
        kernel = _kernel()
        if kernel is None:
            return False
        kernel(x.data_ptr(), positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), num_tokens,
               x.stride(0), heads, head_dim, self.rotary_dim, torch.get_num_threads())
        return True

    def _tables_on(self, device: torch.device) -> None:
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, head_dim] of `positions`. One module serves every layer and all layers
        of a forward pass get the same positions tensor, so the table is indexed once per step."""
        if positions is not self._last_positions or dtype != self._last[0].dtype:
            self._tables_on(positions.device)
            self._last = (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))
            self._last_positions = positions
        return self._last


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
