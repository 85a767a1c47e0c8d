"""Paged attention in Triton: decode and chunked prefill in one kernel, GQA, fp8 KV (the CUDA backend).

One program attends a tile of query rows of one sequence to that sequence's cached keys, read
in place through its block table (no gather). A tile's rows are (token, head) pairs of one KV
head's query group, so a decode token's whole group shares each K/V load, and a 1-token decode
still fills a 16-row matrix tile. Queries sit at the end of their sequence's context and see
keys up to their own position (causal within a prompt chunk), and with a sliding window only the
latest WINDOW of them (a tile's key walk then starts at its first query's window).

Long contexts with few sequences would leave most of the GPU idle, so decode batches split each
sequence's keys into `num_splits` ranges (flash-decoding): each writes a partial (max, sum, acc)
and a second kernel merges them. Nothing here reads a tensor's values on the host, so a step
can be captured in a CUDA graph.

fp8 e4m3 caches hold x / scale: K's scale multiplies the scores and V's the output, so the
tiles go to the matrix units as they are, widened exactly to the query's bf16 or to fp16.
With TRITON_INTERPRET=1 the same kernels run on CPU tensors, which is how CPU tests check them.
"""

from __future__ import annotations

import math

import torch

from engine.layers.triton_support import available, interpreting, tl, triton

__all__ = ["available", "decode_splits", "paged_attention"]

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E) if tl is not None else LOG2E


if triton is not None:

    @triton.jit
    def _attend_tile(
        out_ptr, m_ptr, l_ptr,  # out [T, H, D]; with splits, partials [T, H, S, D] and [T, H, S]
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
        k_scale_ptr, v_scale_ptr, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kvh, stride_table,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
        DOT_F16: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        seq = tl.program_id(0)
        tile = tl.program_id(1) // NUM_SPLITS
        split = tl.program_id(1) % NUM_SPLITS
        kv_head = tl.program_id(2)
        TOKENS: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile

        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if tile * TOKENS >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len  # position of the sequence's first query token

        rows = tl.arange(0, BLOCK_M)
        token = tile * TOKENS + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < TOKENS * GROUP) & (token < q_len)
        dims = tl.arange(0, BLOCK_DIM)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)  # every tile follows q's dtype into the dots
        if DOT_F16:  # fp8 widens to fp16 in one instruction (bf16 takes several); q's values fit
            q = q.to(tl.float16)
        q_pos = first_pos + token  # rows past the tile's tokens see every key: never a fully masked row

        # keys this tile needs end at its last query's position and start at the first query's
        # window (block-aligned); a split takes an aligned share
        end = tl.minimum(seq_len, first_pos + tl.minimum((tile + 1) * TOKENS, q_len))
        begin = 0
        if WINDOW > 0:
            begin = tl.maximum(first_pos + tile * TOKENS - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(end - begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = begin + split * per_split
        hi = tl.minimum(end, lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DIM], tl.float32)
        k_scale = tl.load(k_scale_ptr) * qk_scale  # scores in log2 units, fp8 scale folded in
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            block = tl.load(block_tables_ptr + seq * stride_table + keys // PAGE, mask=key_ok, other=0)
            slot = block.to(tl.int64) * PAGE + keys % PAGE
            kv_off = slot[:, None] * stride_slot + kv_head * stride_kvh + dims[None, :]
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            if DOT_FP32:  # exact fp32 products (the default would round them through tf32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * k_scale
            else:
                s = tl.dot(q, tl.trans(k)) * k_scale
            if SOFTCAP > 0:  # Gemma 2: cap · tanh(score / cap) on the natural-log score (s is in log2 units)
                capped = s / (LOG2E_C * SOFTCAP)
                s = (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * (SOFTCAP * LOG2E_C)
            visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (keys[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split may hold no visible key
            p = tl.math.exp2(s - base[:, None])
            alpha = tl.math.exp2(m_i - base)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new

        t = q_start + token
        if NUM_SPLITS == 1:
            o = acc * (tl.load(v_scale_ptr) / l_i)[:, None]
            tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:
            part = (t * (stride_ot // HEAD_DIM) + head) * NUM_SPLITS + split  # [T, H, S] index
            tl.store(m_ptr + part, m_i, mask=row_ok)
            tl.store(l_ptr + part, l_i, mask=row_ok)
            tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit
    def _merge_splits(
        out_ptr, acc_ptr, m_ptr, l_ptr, v_scale_ptr, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, BLOCK_DIM)
        part = (t * NUM_HEADS + h) * NUM_SPLITS + splits
        m = tl.load(m_ptr + part)
        weight = tl.math.exp2(m - tl.max(m, 0))  # empty splits: m = -inf, weight 0
        total = tl.sum(tl.load(l_ptr + part) * weight, 0)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=(dims < HEAD_DIM)[None, :], other=0.0)
        o = tl.sum(acc * weight[:, None], 0) * (tl.load(v_scale_ptr) / total)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Key-range splits per sequence for a decode batch: programs for ~2 waves of the GPU.

    Fixed per batch size (a CUDA graph cannot read the context length); at short contexts most
    splits are empty and return at once.
    """
    want = math.ceil(2 * num_sms / max(1, num_seqs * num_kv_heads))
    return 1 << min(6, max(0, math.ceil(math.log2(want))))  # 1..64, a power of two for tl.arange


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, page_size: int,
                    scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, num_splits: int = 1,
                    out: torch.Tensor | None = None, *, sliding_window: int | None = None, softcap: float | None = None,
                    block_n: int | None = None,
                    num_warps: int = 4, fp8_dot_f16: bool | None = None) -> torch.Tensor:
    """q [T, H, D] (each sequence's queries contiguous, in `query_start_loc` order) → out [T, H, D].

    k/v_cache [slots, KV, D] (slot = block · page_size + offset); block_tables int32 [S, max_blocks];
    query_start_loc int32 [S + 1]; seq_lens int32 [S] (context including the new tokens);
    k/v_scale fp32 scalars (dequantize by multiplying; ones for a model-dtype cache); each query
    sees its latest `sliding_window` keys only, if set, and its scores are capped at ±`softcap` if set.
    `max_query_len` and `num_splits` only size the grid (host ints, no device reads); `block_n`
    (keys per iteration), `num_warps` and `fp8_dot_f16` (an fp8 cache's tiles meet q in fp16
    rather than q's bf16) exist for bench/gpu.py's sweep. Its H200 timings at 32k context chose
    fp16 for long key ranges per program (8 splits: 0.36 vs 0.42 ms a layer) and bf16 for short
    ones (64 splits: 0.11 vs 0.14 ms).
    """
    if fp8_dot_f16 is None:
        fp8_dot_f16 = num_splits < 16
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    block_dim = max(16, triton.next_power_of_2(head_dim))
    # at least 16 rows for the matrix units; prompt tiles take 64 rows of (token, head) pairs
    block_m = max(16, triton.next_power_of_2(group)) if max_query_len == 1 else max(64, triton.next_power_of_2(group))
    tiles = triton.cdiv(max_query_len, block_m // group)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, k_scale, v_scale, scale * LOG2E,
            q.stride(0), q.stride(1))
    shape = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_DIM=block_dim, PAGE=page_size, BLOCK_M=block_m,
                 BLOCK_N=block_n or (64 if head_dim <= 128 else 32),
                 # the interpreter's dot is wrong on 16-bit floats: it gets fp32 tiles (values unchanged)
                 DOT_FP32=q.dtype == torch.float32 or interpreting(),
                 DOT_F16=fp8_dot_f16 and k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
                 and not interpreting(), WINDOW=sliding_window or 0, SOFTCAP=softcap or 0.0)
    grid = (num_seqs, tiles * num_splits, num_kv_heads)
    if num_splits == 1:
        _attend_tile[grid](out, None, None, *args, out.stride(0), out.stride(1), k_cache.stride(0),
                           k_cache.stride(1), block_tables.stride(0), NUM_SPLITS=1, num_warps=num_warps, **shape)
        return out
    acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    # partials are dense [T, H, S, D]: their token stride is H · D
    _attend_tile[grid](acc, m, l_sum, *args, num_heads * head_dim, head_dim, k_cache.stride(0),
                       k_cache.stride(1), block_tables.stride(0), NUM_SPLITS=num_splits, num_warps=num_warps,
                       **shape)
    _merge_splits[(num_tokens, num_heads)](out, acc, m, l_sum, v_scale, out.stride(0), out.stride(1),
                                           NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_DIM=block_dim,
                                           NUM_SPLITS=num_splits)
    return out
