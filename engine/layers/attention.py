"""Paged attention: the metadata the runner builds, the per-layer KV storage, the torch backend.

The KV cache of one layer is two tensors `[num_blocks * block_size, num_kv_heads, head_dim]`
(flat slots: slot = block_id * block_size + offset). Writes go through `slot_mapping`; reads
gather a sequence's slots through precomputed flat indices, then call SDPA; on CPUs queries
instead go to C kernels that read the blocks in place (engine/layers/cpu_attention.py), one for
decode tokens and one for prompt chunks, and on CUDA every query goes to a Triton kernel that
does (engine/layers/triton_attention.py).
FP8 storage keeps `float8_e4m3fn` and a per-layer scale (x ≈ stored · scale), or `float8_e5m2`
at unit scale (its range needs none); CPUs cannot do arithmetic on fp8, so values are upcast
right after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import host_memory
from engine.layers import triton_attention, triton_fused
from engine.layers.cpu_attention import paged_decode_attention, paged_prefill_attention

FP8_MAX = 448.0
# What each fp8 cache dtype saturates to (torch's casts overflow: e4m3 to NaN, e5m2 to infinity).
FP8_KV_LIMITS = {torch.float8_e4m3fn: FP8_MAX, torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max}
# Dynamic KV scales map the first batch's absmax to half the fp8 range: later tokens up to twice
# as large still fit, and e4m3 keeps the same relative precision across its normal range, so the
# headroom only pushes the very smallest values into subnormals.
DYNAMIC_KV_HEADROOM = 2.0


@dataclass(slots=True)
class PrefillSpan:
    """One sequence with more than one new token in this step (a prompt chunk)."""

    token_start: int  # first row of this sequence's queries in the flat batch
    num_query_tokens: int
    context_slots: torch.Tensor  # [context_len] flat slot ids of every token it attends to
    mask: torch.Tensor | None  # [num_query_tokens, context_len] bool, None when plainly causal
    window_mask: torch.Tensor | None = None  # the same within the model's sliding window, where that hides keys


@dataclass(slots=True)
class DecodeGroup:
    """Single-token queries of sequences with similar context lengths, attended in one batched call.

    Grouping by length bounds the padding each gather reads (one 1000-token context would
    otherwise make every short sequence in the batch gather 1000 slots).
    """

    row_start: int
    slots: torch.Tensor  # [num_seqs, max_context] flat slot ids (padded with 0)
    mask: torch.Tensor | None  # [num_seqs, 1, 1, max_context] bool, True = attend (None: no layer attends fully)
    window_mask: torch.Tensor | None = None  # the same within the model's sliding window (None: no window)


@dataclass(slots=True)
class PagedDecode:
    """Single-token queries for the C kernel, which reads each sequence's blocks in place."""

    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor  # int32 [num_seqs], the new token included
    block_size: int


@dataclass(slots=True)
class PagedPrefill:
    """Prompt chunks for the C kernel, which reads each sequence's blocks in place (causal, after any context)."""

    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start: torch.Tensor  # int32 [num_seqs + 1], each chunk's rows counted from the first prompt row
    context_lens: torch.Tensor  # int32 [num_seqs], this step's tokens included
    block_size: int


@dataclass(slots=True)
class TritonBatch:
    """The whole step for the Triton kernel (CUDA): every sequence's queries attend in one launch."""

    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], rows of each sequence's queries
    seq_lens: torch.Tensor  # int32 [num_seqs], context including this step's tokens
    max_query_len: int
    block_size: int
    num_splits: int  # key-range splits per sequence (decode batches on a big GPU), see triton_attention


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's flat token batch (shared by all layers).

    Decode sequences (one new token each) come first: rows [0, num_decode_tokens).
    """

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]  # the torch path's decode batches
    prefills: list[PrefillSpan]
    paged_decode: PagedDecode | None = None  # set instead of decode_groups when the kernel is used
    paged_prefill: PagedPrefill | None = None  # set instead of prefills when the kernel is used
    triton: TritonBatch | None = None  # set instead of all the above on the Triton backend


class KVCache:
    """Preallocated K and V storage for every layer, in the model dtype or fp8."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_slots, num_kv_heads, head_dim)
        self.dtype = dtype
        # host_memory: huge pages on CPU, where decode attention reads scattered blocks every step
        self.k = [host_memory.zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [host_memory.zeros(shape, dtype, device) for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_KV_LIMITS

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class ForwardContext:
    """Passed explicitly through the model: the step's metadata and the cache it writes."""

    metadata: AttentionMetadata
    kv_cache: KVCache


def attention_mask(query_positions: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """[queries, num_keys] bool, True = attend: keys up to each query's position, and within its
    window (the latest `sliding_window` keys) where there is one."""
    keys = torch.arange(num_keys, device=query_positions.device).unsqueeze(0)
    queries = query_positions.unsqueeze(1)
    mask = keys <= queries
    return mask & (keys > queries - sliding_window) if sliding_window else mask


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    limit = FP8_KV_LIMITS.get(cache.dtype)
    if limit is not None:
        x = (x.float() / scale).clamp_(-limit, limit).to(cache.dtype)  # saturate rather than overflow
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)  # index_copy_ has no fp8 kernel on CPU
    cache.index_copy_(0, slots, x.to(cache.dtype))  # no host sync, so CUDA graphs can capture it


def _dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-layer scale from the values at hand, never zero (an all-zero first batch must not divide by 0)."""
    amax = x.detach().abs().amax().float()
    return (amax * DYNAMIC_KV_HEADROOM / FP8_MAX).clamp(min=torch.finfo(torch.float32).eps)


def _load(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    # index_select on flat slots is ~2x faster than advanced indexing with a 2-D index on CPU
    x = cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
    if cache.dtype in FP8_KV_LIMITS:
        return x.to(torch.float32).mul_(scale).to(dtype)
    return x.to(dtype)  # a bfloat16 cache under an fp32 model


class Attention(nn.Module):
    """Scaled dot-product attention of one layer over the paged cache (torch backend, the oracle)."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, scale: float | None = None, softcap: float | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        # each query sees only the latest `sliding_window` keys, itself included (Mistral v0.1, Phi-3):
        # the C and Triton kernels take it as an argument; the torch path takes the runner's window masks
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale  # Gemma's comes from query_pre_attn_scalar
        self.softcap = softcap  # Gemma 2: scores become softcap · tanh(score / softcap) before the softmax
        # Multiply-to-dequantize FP8 KV scales; set by the loader from the checkpoint (or, with
        # dynamic scales, from the first K/V this layer stores).
        self.register_buffer("k_scale", torch.ones(()), persistent=False)
        self.register_buffer("v_scale", torch.ones(()), persistent=False)
        self.scales_pending = False  # True: take k/v scales from the first K/V written (dynamic scales)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Unit scales until the loader sets calibrated ones (they only matter for fp8 storage)."""
        device = "cpu" if self.k_scale.is_meta else self.k_scale.device
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext | None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D] (post-RoPE) → [T, H·D].

        With ctx None the T tokens are one sequence attended causally with no cache (the
        calibration and dense-reference path).
        """
        num_tokens = q.shape[0]
        if ctx is None:
            window = self.sliding_window if self.sliding_window and num_tokens > self.sliding_window else None
            mask = None if window is None else attention_mask(torch.arange(num_tokens, device=q.device),
                                                              num_tokens, window)
            out = self._sdpa(q, k, v, mask=mask, causal=mask is None)
            return out.reshape(num_tokens, -1)
        meta, cache = ctx.metadata, ctx.kv_cache
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        if self.scales_pending and cache.is_fp8:
            self.k_scale, self.v_scale = _dynamic_scale(k), _dynamic_scale(v)
            self.scales_pending = False
        # on the Triton path one kernel writes both (a decode step's CUDA graph holds one per layer)
        if meta.triton is None or not triton_fused.store_kv(k_cache, v_cache, meta.slot_mapping, k, v,
                                                            self.k_scale, self.v_scale):
            _store(k_cache, meta.slot_mapping, k, self.k_scale)
            _store(v_cache, meta.slot_mapping, v, self.v_scale)
        if meta.triton is not None:
            batch = meta.triton
            out = triton_attention.paged_attention(
                q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                batch.max_query_len, batch.block_size, self.scale, self.k_scale, self.v_scale, batch.num_splits,
                sliding_window=self.sliding_window, softcap=self.softcap)
            return out.reshape(num_tokens, -1)
        out = torch.empty_like(q)
        if meta.paged_decode is not None:
            decode = meta.paged_decode
            rows = slice(0, meta.num_decode_tokens)
            out[rows] = paged_decode_attention(
                q[rows], k_cache, v_cache, decode.block_tables, decode.context_lens, decode.block_size,
                self.scale, self.k_scale, self.v_scale, self.sliding_window, self.softcap,
            )
        if meta.paged_prefill is not None:
            prefill = meta.paged_prefill
            rows = slice(meta.num_decode_tokens, num_tokens)
            out[rows] = paged_prefill_attention(
                q[rows], k_cache, v_cache, prefill.block_tables, prefill.query_start, prefill.context_lens,
                prefill.block_size, self.scale, self.k_scale, self.v_scale, self.sliding_window, self.softcap,
            )
        for group in meta.decode_groups:
            rows = slice(group.row_start, group.row_start + group.slots.shape[0])
            keys = _load(k_cache, group.slots, self.k_scale, q.dtype)  # [n, L, KV, D]
            values = _load(v_cache, group.slots, self.v_scale, q.dtype)
            o = self._attend(
                q[rows].unsqueeze(2),  # [n, H, 1, D]
                keys.transpose(1, 2), values.transpose(1, 2),  # [n, KV, L, D]
                group.window_mask if self.sliding_window else group.mask, causal=False,
            )
            out[rows] = o.squeeze(2)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_query_tokens)
            if span.context_slots.shape[0] == span.num_query_tokens and k_cache.dtype == k.dtype:
                keys, values = k[rows], v[rows]  # a fresh prompt: its cache rows hold exactly these
            else:
                keys = _load(k_cache, span.context_slots, self.k_scale, q.dtype)  # [L, KV, D]
                values = _load(v_cache, span.context_slots, self.v_scale, q.dtype)
            mask = span.window_mask if self.sliding_window and span.window_mask is not None else span.mask
            out[rows] = self._sdpa(q[rows], keys, values, mask=mask, causal=mask is None)
        return out.reshape(num_tokens, -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """One sequence: q [Tq, H, D], k/v [Tk, KV, D] → [Tq, H, D]."""
        o = self._attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                         v.transpose(0, 1).unsqueeze(0), mask, causal)
        return o.squeeze(0).transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor:
        """q [B, H, Tq, D], k/v [B, KV, Tk, D] → [B, H, Tq, D]: SDPA, or written out where the scores
        are capped (SDPA has no softcap), as the reference does it."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
