"""RMSNorm with the fused residual add the Llama block uses."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine.layers import cpu_kernels, triton_fused, triton_support

_ARGTYPES = (*[ctypes.c_void_p] * 5, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int)


def _kernel() -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("rms_norm", "rms_norm_f32", _ARGTYPES, None)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalized in fp32 like the reference implementation.

    Llama's reference rounds the normalized x to the model's dtype, then scales; with
    `scale_in_fp32` (Gemma's, whose weights are 1 + w) the fp32 weight scales before the rounding.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, scale_in_fp32: bool = False):
        super().__init__()
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32
        weight_dtype = torch.float32 if scale_in_fp32 else dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (x * self.weight).to(dtype)
        return self.weight * x.to(dtype)

    def _fused_cpu(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(x + residual), x + residual) in one C pass, or None where the kernel does not apply."""
        tensors = (x, self.weight) if residual is None else (x, residual, self.weight)
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            return None
        kernel = _kernel()
        if kernel is None:
            return None
        out = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        kernel(out.data_ptr(), total.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
               self.weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], self.eps, torch.get_num_threads())
        return out, total

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        fused = self._fused_cpu(x, residual)
        if fused is not None:
            return fused[0] if residual is None else fused
        if x.is_cuda and triton_support.available(x.device) and x.is_contiguous() and (
                residual is None or residual.is_contiguous()):
            return triton_fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
