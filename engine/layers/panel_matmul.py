"""The CPU matmul kernel (engine/csrc/panel_matmul.c) and the weight layout it reads.

A weight [N, K] is re-laid out as 16-column panels [N / 16, K, 16], so decode's few activation
rows stream every weight byte exactly once, sequentially. Measured against oneDNN's blocked
layout on SmolLM2's fp32 shapes (`driftgate bench matmul`): 1.3–1.4× faster at 1–8 rows,
1.1× at 16–64, on par from 256 rows up.
"""

from __future__ import annotations

import ctypes

import torch

from engine.layers import cpu_kernels

PANEL = 16
_ARGTYPES = (*[ctypes.c_void_p] * 4, *[ctypes.c_int] * 4)


def _kernel() -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("panel_matmul", "panel_matmul_f32", _ARGTYPES, None)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] → panels [N / 16, K, 16], or None where the kernel does not apply
    (not a CPU fp32 weight, N not a multiple of 16, or no kernel on this machine)."""
    n, k = weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or n % PANEL or _kernel() is None:
        return None
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for x [..., K] float32 and W given as `pack(W)`."""
    num_panels, k, _ = panels.shape
    n = num_panels * PANEL
    x2d = x.reshape(-1, k).to(torch.float32).contiguous()
    y = torch.empty(x2d.shape[0], n, dtype=torch.float32)
    if x2d.shape[0]:
        _kernel()(y.data_ptr(), x2d.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                  x2d.shape[0], n, k, torch.get_num_threads())
    return y.reshape(*x.shape[:-1], n)
