"""The gated MLP's activation over the fused gate_up projection's output: SwiGLU's silu(gate) · up
(Llama), GeGLU's gelu_tanh(gate) · up (Gemma)."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine.layers import cpu_kernels, triton_fused, triton_support

_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int)


def _kernel(symbol: str = "silu_mul_f32") -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("activation", symbol, _ARGTYPES, None)


def _on_cpu(x: torch.Tensor, symbol: str) -> torch.Tensor | None:
    """The C kernel's output for fp32 CPU rows, or None where it does not apply."""
    kernel = _kernel(symbol) if x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() else None
    if kernel is None:
        return None
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    kernel(out.data_ptr(), x.data_ptr(), x.numel() // x.shape[-1], inter, torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2·I] (gate then up) → silu(gate) · up [..., I]; one C pass on CPU fp32, one Triton kernel on CUDA."""
    out = _on_cpu(x, "silu_mul_f32")
    if out is not None:
        return out
    if x.is_cuda and triton_support.available(x.device) and x.is_contiguous():
        return triton_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2·I] (gate then up) → gelu(gate, tanh approximation) · up [..., I]; one C pass on CPU fp32
    (the kernel the one-call decode step runs too)."""
    out = _on_cpu(x, "gelu_tanh_mul_f32")
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
