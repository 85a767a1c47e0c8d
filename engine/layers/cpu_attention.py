"""The CPU paged-attention kernels (engine/csrc/paged_decode.c, paged_prefill.c): load, declare, call.

Attention in torch gathers every sequence's cached K and V into a dense copy first; the C
kernels read them in place through the block tables: one for single-token (decode) queries,
one for prompt chunks. Where they cannot be built (engine/layers/cpu_kernels.py),
`available()` is False and attention keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from engine.layers import cpu_kernels

CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
# Every fp8 bit pattern's value; times the layer scale it is the kernel's dequantization table.
_FP8_VALUES = {dtype: torch.arange(256, dtype=torch.uint8).view(dtype).float()
               for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}

PREFILL_HEAD_DIM_MULTIPLE = 8  # the prefill kernel's register blocks span 8 dimensions

_PTR, _INT = ctypes.c_void_p, ctypes.c_int
# out, q, k_cache, v_cache, block_tables, [query_start,] context_lens; num_seqs, max_blocks,
# num_heads, num_kv_heads, head_dim, block_size; scale; cache_type; k/v tables; window; softcap; num_threads
_TAIL = (*[_INT] * 6, ctypes.c_float, _INT, _PTR, _PTR, _INT, ctypes.c_float, _INT)
_KERNELS = {
    "decode": ("paged_decode", "paged_decode_attention", (*[_PTR] * 6, *_TAIL)),
    "prefill": ("paged_prefill", "paged_prefill_attention", (*[_PTR] * 7, *_TAIL)),
}


def _kernel(kind: str) -> ctypes._CFuncPtr | None:
    source, symbol, argtypes = _KERNELS[kind]
    return cpu_kernels.kernel(source, symbol, argtypes, ctypes.c_int)


def available(cache_dtype: torch.dtype, device: torch.device, kind: str = "decode") -> bool:
    """Whether the `kind` kernel (decode | prefill) can serve attention over this cache on this device."""
    return device.type == "cpu" and cache_dtype in CACHE_TYPES and _kernel(kind) is not None


def fp8_table(scale: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_kv_heads, 256]: the fp8 `dtype`'s values times each KV head's scale (one scale for every
    head, or one per head as [num_kv_heads, 1]), the kernel's decoding of an fp8 byte."""
    return (_FP8_VALUES[dtype] * scale.float().reshape(-1, 1)).expand(num_kv_heads, -1).contiguous()


def _call(kind: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_args: list[torch.Tensor],
          block_size: int, scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor,
          sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Run a kernel over q [rows, H, D]; seq_args are its int32 per-sequence tensors, block tables first."""
    kernel = _kernel(kind)
    if kernel is None:
        raise RuntimeError(f"the paged-{kind} kernel is not available (check available() first)")
    q = q.to(torch.float32).contiguous()
    _, num_heads, head_dim = q.shape
    block_tables = seq_args[0]
    out = torch.empty_like(q)
    cache_type = CACHE_TYPES[k_cache.dtype]
    fp8 = k_cache.dtype in _FP8_VALUES
    k_table = fp8_table(k_scale, k_cache.shape[1], k_cache.dtype) if fp8 else None
    v_table = fp8_table(v_scale, v_cache.shape[1], v_cache.dtype) if fp8 else None
    status = kernel(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *(t.data_ptr() for t in seq_args),
        block_tables.shape[0], block_tables.shape[1], num_heads, k_cache.shape[1], head_dim, block_size, scale,
        cache_type, None if k_table is None else k_table.data_ptr(), None if v_table is None else v_table.data_ptr(),
        sliding_window or 0, softcap or 0.0, torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"paged-{kind} kernel: block_size must be a power of two, got {block_size}")
    if status == -3:
        raise ValueError(f"paged-{kind} kernel: head_dim must be a multiple of {PREFILL_HEAD_DIM_MULTIPLE}, got {head_dim}")
    if status != 0:
        raise MemoryError(f"paged-{kind} kernel: scratch allocation failed")
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor,
                           sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [n, H, D] (one query token per sequence) → attention output [n, H, D] float32.

    block_tables int32 [n, max_blocks] and context_lens int32 [n] describe each sequence's
    cached tokens (its own new token included), of which it sees the last `sliding_window`
    only if set; scores are capped at ±`softcap` (softcap · tanh(score / softcap)) if set;
    k/v_scale matter only for fp8 caches.
    """
    return _call("decode", q, k_cache, v_cache, [block_tables, context_lens], block_size, scale, k_scale, v_scale,
                 sliding_window, softcap)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int, scale: float, k_scale: torch.Tensor,
                            v_scale: torch.Tensor, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """q [rows, H, D] (sequence s owns rows query_start[s]:query_start[s + 1]) → causal attention [rows, H, D] float32.

    A sequence's queries are the last tokens of its context_lens[s] cached tokens (prompt chunks
    after a prefix-cache hit or earlier chunks attend to those too), each seeing the last
    `sliding_window` keys up to itself if set, its scores capped as in decode. All int32; the new
    tokens' K/V must already be in the cache.
    """
    return _call("prefill", q, k_cache, v_cache, [block_tables, query_start, context_lens], block_size, scale,
                 k_scale, v_scale, sliding_window, softcap)
