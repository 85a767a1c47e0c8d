"""Paged attention equals dense causal attention (random shapes, GQA, block boundaries, fp8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import cpu_attention, triton_attention
from engine.layers.attention import Attention, ForwardContext, KVCache
from engine.runner import ModelRunner
from engine.scheduler import ScheduledChunk
from tests.helpers import make_requests


def _dense(q, k, v, window=None):
    """Reference: plain causal attention (each query within its latest `window` keys if set), K/V
    heads repeated for GQA. q [T,H,D], k/v [T,KV,D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    if window:
        mask &= torch.ones_like(mask).triu(-(window - 1))
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


class _NullModel:
    """What the runner reads of a model: its attention window (none unless given)."""

    def __init__(self, window: int | None = None):
        self.args = SimpleNamespace(layer_windows=(window,))


BACKENDS = [
    "torch",
    pytest.param("c", marks=pytest.mark.skipif(
        not cpu_attention.available(torch.float32, torch.device("cpu")), reason="no C compiler for the attention kernels")),
    # CPU: the Triton kernel under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no GPU)
    pytest.param("triton", marks=pytest.mark.skipif(
        not triton_attention.available(torch.device("cpu")), reason="triton is not installed")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([8, 16]),
    block_size=st.sampled_from([1, 2, 4, 16]), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    split=st.floats(0.0, 1.0), seed=st.integers(0, 1000), window=st.sampled_from([None, 1, 5]),
)
def test_paged_equals_dense(backend, kv_heads, group, head_dim, block_size, lengths, split, seed, window):
    """Each sequence is fed in up to three steps (a prompt chunk, a middle chunk, a decode), on
    each attention backend; with a sliding window each query sees its latest `window` keys."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    cache = KVCache(1, num_blocks * block_size, kv_heads, head_dim, torch.float32)
    runner = ModelRunner(_NullModel(window), cache, block_size)
    runner.backend = backend
    attn = Attention(0, heads, kv_heads, head_dim, window)
    reqs = make_requests(len(lengths), lengths)
    # hand out blocks in a scrambled order so block tables are not contiguous
    free = torch.randperm(num_blocks, generator=g).tolist()
    for r in reqs:
        r.block_ids = [free.pop() for _ in range(-(-r.num_tokens // block_size))]
    qkv = {r.request_id: [torch.randn(r.num_tokens, n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads)]
           for r in reqs}
    outputs = {r.request_id: torch.empty(r.num_tokens, heads * head_dim) for r in reqs}
    # a prompt chunk, the middle as one chunk, the last token as a decode (steps mix both kinds)
    firsts = [max(1, min(r.num_tokens - 1, int(r.num_tokens * split))) for r in reqs]
    steps = [[ScheduledChunk(r, 0, f) for r, f in zip(reqs, firsts, strict=True)],
             [ScheduledChunk(r, f, r.num_tokens - 1 - f) for r, f in zip(reqs, firsts, strict=True)
              if f < r.num_tokens - 1],
             [ScheduledChunk(r, r.num_tokens - 1, 1) for r in reqs if r.num_tokens > 1]]
    for chunks in filter(None, steps):
        chunks = sorted(chunks, key=lambda c: c.num_tokens != 1)
        _, _, meta = runner.build_metadata(chunks)
        q, k, v = (torch.cat([qkv[c.request.request_id][i][c.start:c.start + c.num_tokens] for c in chunks])
                   for i in range(3))
        out = attn(q, k, v, ForwardContext(meta, cache))
        row = 0
        for c in chunks:
            outputs[c.request.request_id][c.start:c.start + c.num_tokens] = out[row:row + c.num_tokens]
            row += c.num_tokens
    for r in reqs:
        q, k, v = qkv[r.request_id]
        expected = _dense(q, k, v, window).reshape(r.num_tokens, -1)
        torch.testing.assert_close(outputs[r.request_id], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(torch.float32, torch.device("cpu"), "prefill"),
                    reason="no C compiler for the attention kernels")
@pytest.mark.parametrize("head_dim", [16, 12])
def test_c_backend_prompts_take_the_prefill_kernel_where_its_blocks_fit(head_dim):
    """head_dim 16: prompt chunks go to the C kernel (no gathered spans); 12 is no multiple of its
    8-wide blocks, so they take the torch spans while decode stays on C. Both equal dense."""
    g = torch.Generator().manual_seed(0)
    reqs = make_requests(2, [20, 9])
    cache = KVCache(1, 64, 2, head_dim, torch.float32)
    runner = ModelRunner(_NullModel(), cache, 4, backend="c")
    for i, r in enumerate(reqs):
        r.block_ids = list(range(8 * i, 8 * i + 5))
    attn = Attention(0, 6, 2, head_dim)
    chunks = [ScheduledChunk(r, 0, r.num_tokens) for r in reqs]
    _, _, meta = runner.build_metadata(chunks)
    assert (meta.paged_prefill is not None, len(meta.prefills)) == ((True, 0) if head_dim == 16 else (False, 2))
    qkv = [[torch.randn(r.num_tokens, n, head_dim, generator=g) for n in (6, 2, 2)] for r in reqs]
    out = attn(*(torch.cat([t[i] for t in qkv]) for i in range(3)), ForwardContext(meta, cache))
    torch.testing.assert_close(out, torch.cat([_dense(*t).reshape(t[0].shape[0], -1) for t in qkv]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_dense_on_dequantized_values(fp8):
    """FP8 storage: attention equals dense attention over the values the cache can represent."""
    g = torch.Generator().manual_seed(0)
    (req,) = make_requests(1, 20)
    cache = KVCache(1, 32, 2, 16, fp8)
    runner = ModelRunner(_NullModel(), cache, 4)
    req.block_ids = list(range(5))
    attn = Attention(0, 4, 2, 16)
    attn.k_scale, attn.v_scale = torch.tensor(0.01), torch.tensor(0.02)
    q, k, v = (torch.randn(20, n, 16, generator=g) for n in (4, 2, 2))
    _, _, meta = runner.build_metadata([ScheduledChunk(req, 0, 20)])
    out = attn(q, k, v, ForwardContext(meta, cache))
    k8 = (k / 0.01).to(fp8).float() * 0.01  # all well inside both formats' ranges
    v8 = (v / 0.02).to(fp8).float() * 0.02
    torch.testing.assert_close(out, _dense(q, k8, v8).reshape(20, -1), atol=1e-5, rtol=1e-5)
    # and it saturates instead of overflowing to NaN (e4m3) or infinity (e5m2)
    attn.k_scale = torch.tensor(1e-4)
    out = attn(q, k * 1e4, v, ForwardContext(meta, cache))
    assert torch.isfinite(out).all()
