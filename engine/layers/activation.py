"""The gated MLP's activation over the fused gate_up projection's output: SwiGLU's silu(gate) · up
(Llama), GeGLU's gelu_tanh(gate) · up (Gemma)."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine.layers import cpu_kernels, triton_fused, triton_support

_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int)


def _kernel() -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("activation", "silu_mul_f32", _ARGTYPES, None)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2·I] (gate then up) → silu(gate) · up [..., I]; one C pass on CPU fp32, one Triton kernel on CUDA."""
    inter = x.shape[-1] // 2
    kernel = _kernel() if x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() else None
    if kernel is None and x.is_cuda and triton_support.available(x.device) and x.is_contiguous():
        return triton_fused.silu_and_mul(x)
    if kernel is None:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = x.new_empty(*x.shape[:-1], inter)
    kernel(out.data_ptr(), x.data_ptr(), x.numel() // x.shape[-1], inter, torch.get_num_threads())
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2·I] (gate then up) → gelu(gate, tanh approximation) · up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
