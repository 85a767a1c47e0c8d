"""The decoder layer's small CUDA ops, each one Triton kernel: RMSNorm (with the residual add),
rotary embedding (in place on q and k), SwiGLU's silu(gate) · up, and the KV-cache write.

In torch each is 5-10 kernels; a batch-1 decode step of an 8B model ran ~35 kernels per layer,
and at a few microseconds each they cost as much GPU time as reading the weights. Arithmetic is
fp32 with one rounding to the model dtype at the end (torch rounds after each op, so bf16
results can differ in the last bit). The CPU has its C kernels (engine/csrc) for the same ops.
"""

from __future__ import annotations

import torch

from engine.layers.triton_support import tl, triton

# fp8 KV caches the store writes, saturating at their largest finite value as attention._store
# does: (mantissa bits, exponent bias)
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}

if triton is not None:

    @triton.jit
    def _rms_norm(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, cols, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * cols
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # the sum is rounded to the model dtype: it is the next residual
            x = (x.to(tl.float32) + tl.load(residual_ptr + row + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row + offs, x, mask=mask)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / cols + eps)
        normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # as torch: round, then weigh
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_token, stride_head,
                HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        pos = tl.load(positions_ptr + token)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        base = x_ptr + token.to(tl.int64) * stride_token + head * stride_head
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * 2 * HALF + offs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + pos * 2 * HALF + offs, mask=mask, other=0.0)
        tl.store(base + offs, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF + offs, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul(out_ptr, x_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
        silu = gate / (1.0 + tl.exp(-gate))
        tl.store(out_ptr + row * inter + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_bits(x, LIMIT: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
        """x (fp32) saturated to ±LIMIT and rounded to the nearest fp8 value with MANTISSA bits and
        exponent BIAS (e4m3: 3, 7; e5m2: 2, 15), ties to even, as its byte: spelled in integer
        operations so the interpreter (whose casts truncate) and the GPU agree."""
        x = tl.minimum(tl.maximum(x, -LIMIT), LIMIT)
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        drop: tl.constexpr = 23 - MANTISSA
        mag = mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)  # keep MANTISSA of 23 mantissa bits
        normal = (((mag >> 23) - (127 - BIAS)) << MANTISSA) | ((mag >> drop) & ((1 << MANTISSA) - 1))
        # below the smallest normal 2^(1 - BIAS), multiples of 2^(1 - BIAS - MANTISSA) (the smallest
        # normal's own byte included): adding 2^23 rounds the count to an integer
        step_inverse: tl.constexpr = 2.0 ** (BIAS + MANTISSA - 1)
        subnormal = ((tl.abs(x) * step_inverse + 8388608.0) - 8388608.0).to(tl.uint32)
        smallest_normal: tl.constexpr = 2.0 ** (1 - BIAS)
        return (sign | tl.where(tl.abs(x) < smallest_normal, subnormal, normal)).to(tl.uint8)

    @triton.jit
    def _cache_row(x_ptr, cache_ptr, scale_ptr, token, slot, stride_token, stride_head,
                   HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr,
                   FP8_LIMIT: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        x = tl.load(x_ptr + token * stride_token + (offs // HEAD_DIM) * stride_head + offs % HEAD_DIM, mask=mask)
        if STORE == 1:  # float32 → bfloat16, nearest even (torch's cast), on the cache's 16-bit view
            bits = x.to(tl.uint32, bitcast=True)
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        elif STORE == 2:  # fp8 (attention._store): x / scale (IEEE division, as torch's), then e4m3 or e5m2
            x = _fp8_bits(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), FP8_LIMIT, FP8_MANTISSA, FP8_BIAS)
        tl.store(cache_ptr + slot * ROW + offs, x, mask=mask)

    @triton.jit
    def _store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr, v_scale_ptr,
                  stride_k, stride_k_head, stride_v, stride_v_head,
                  HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr,
                  FP8_LIMIT: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        _cache_row(k_ptr, k_cache_ptr, k_scale_ptr, token, slot, stride_k, stride_k_head, HEAD_DIM, ROW, BLOCK, STORE,
                   FP8_LIMIT, FP8_MANTISSA, FP8_BIAS)
        _cache_row(v_ptr, v_cache_ptr, v_scale_ptr, token, slot, stride_v, stride_v_head, HEAD_DIM, ROW, BLOCK, STORE,
                   FP8_LIMIT, FP8_MANTISSA, FP8_BIAS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) · weight, or with `residual` (norm(x + residual) · weight, x + residual); x [T, H] contiguous."""
    cols = x.shape[-1]
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    _rms_norm[(x.numel() // cols,)](out, residual_out, x, residual, weight, cols, eps,
                                    HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out if residual is None else (out, residual_out)


def rotary_in_place(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] (rows may be strided, head vectors contiguous) by cos/sin [positions, D]."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    _rotary[(tokens, heads)](x, positions, cos, sin, x.stride(0), x.stride(1), HALF=half,
                             BLOCK=triton.next_power_of_2(half))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2·I] contiguous (gate then up) → silu(gate) · up [T, I]."""
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul[(x.numel() // x.shape[-1], triton.cdiv(inter, block))](out, x, inter, BLOCK=block)
    return out


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """Write k, v [T, KV, D] (rows may be strided, head vectors contiguous) into the caches
    [slots, KV, D] at `slots` [T], bit for bit as attention._store does, in one kernel for both
    where torch takes one per tensor (five for fp8: divide, clamp, cast, ...). The scales are only
    read for fp8 caches (e4m3 or e5m2). Returns False, writing nothing, for a pair of dtypes it
    does not cover."""
    mantissa, bias = _FP8_FORMATS.get(k_cache.dtype, (0, 0))
    if k_cache.dtype == k.dtype:
        store, k_view, v_view = 0, k_cache, v_cache
    elif k_cache.dtype == torch.bfloat16 and k.dtype == torch.float32:
        store, k_view, v_view = 1, k_cache.view(torch.uint16), v_cache.view(torch.uint16)
    elif mantissa:
        store, k_view, v_view = 2, k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        return False
    tokens, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    _store_kv[(tokens,)](k, v, k_view, v_view, slots, k_scale, v_scale, k.stride(0), k.stride(1), v.stride(0),
                         v.stride(1), HEAD_DIM=head_dim, ROW=row, BLOCK=triton.next_power_of_2(row), STORE=store,
                         FP8_LIMIT=float(torch.finfo(k_cache.dtype).max) if mantissa else 0.0,
                         FP8_MANTISSA=mantissa, FP8_BIAS=bias)
    return True
