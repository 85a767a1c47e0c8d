"""The CPU paged-decode kernel (engine/csrc/paged_decode.c): load, declare, call.

Decode attention in torch gathers every sequence's cached K and V into a dense copy first;
the C kernel reads them in place from the block tables. Where it cannot be built
(engine/layers/cpu_kernels.py), `available()` is False and attention keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from engine.layers import cpu_kernels

CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# Every e4m3 bit pattern's value; times the layer scale it is the kernel's dequantization table.
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


_ARGTYPES = (*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int)


def _kernel() -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("paged_decode", "paged_decode_attention", _ARGTYPES, ctypes.c_int)


def available(cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can serve decode attention over a cache of this dtype on this device."""
    return device.type == "cpu" and cache_dtype in CACHE_TYPES and _kernel() is not None


def fp8_table(scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[num_kv_heads, 256]: the e4m3 values times each KV head's scale (one scale for every head,
    or one per head as [num_kv_heads, 1]), the kernel's decoding of an fp8 byte."""
    return (_FP8_VALUES * scale.float().reshape(-1, 1)).expand(num_kv_heads, -1).contiguous()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] (one query token per sequence) → attention output [n, H, D] float32.

    block_tables int32 [n, max_blocks] and context_lens int32 [n] describe each sequence's
    cached tokens (its own new token included); k/v_scale matter only for fp8 caches.
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the paged-decode kernel is not available (check available() first)")
    q = q.to(torch.float32).contiguous()
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    cache_type = CACHE_TYPES[k_cache.dtype]
    k_table = fp8_table(k_scale, k_cache.shape[1]) if cache_type == 2 else None
    v_table = fp8_table(v_scale, v_cache.shape[1]) if cache_type == 2 else None
    status = kernel(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), num_seqs, block_tables.shape[1],
        num_heads, k_cache.shape[1], head_dim, block_size, scale, cache_type,
        None if k_table is None else k_table.data_ptr(), None if v_table is None else v_table.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"paged-decode kernel: block_size must be a power of two, got {block_size}")
    if status != 0:
        raise MemoryError("paged-decode kernel: scratch allocation failed")
    return out
