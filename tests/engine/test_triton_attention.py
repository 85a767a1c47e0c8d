"""The Triton paged-attention kernel equals float64 causal attention over the same cached values.

On CPU it runs under Triton's interpreter (tests/conftest.py); on a GPU the `cuda` cases run the
compiled kernel. Tolerances are relative Frobenius errors: fp32 far under 1e-4; 16-bit queries
and caches round the output to bf16 (≤ 2^-8 relative, so 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from engine.layers import triton_attention

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not triton_attention.available(torch.device("cpu")),
                                                 reason="triton is not installed")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or triton_attention.triton is None, reason="needs CUDA and triton")]),
]


def _reference(q, k, v, first_pos, window=None, softcap=None):
    """Causal attention in float64 (within the latest `window` keys if set); q [Tq, H, D] at
    positions first_pos.., k/v [Tk, KV, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keys, queries = torch.arange(k.shape[0])[None, :], torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    visible = (keys <= queries) & (keys > queries - window if window else True)
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run(device, dtype, cache_dtype, spans, *, kv_heads=2, group=3, head_dim=64, page=16, num_splits=1, seed=0,
         window=None, softcap=None):
    """spans: (query tokens, context length) per sequence. Returns the max relative error."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // page) for _, ctx in spans) + 2
    shape = (num_blocks * page, kv_heads, head_dim)
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k_scale, v_scale = (torch.tensor(0.02), torch.tensor(0.03)) if fp8 else (
        torch.tensor(1.0), torch.tensor(1.0))
    # the cache holds x / scale: draw values whose dequantized size is ~1
    k_cache = (torch.randn(shape, generator=g) / k_scale).to(cache_dtype)
    v_cache = (torch.randn(shape, generator=g) / v_scale).to(cache_dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables = [[free.pop() for _ in range(-(-ctx // page))] for _, ctx in spans]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_start = torch.tensor([0] + [n for n, _ in spans]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([ctx for _, ctx in spans], dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), kv_heads * group, head_dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"), device=device)  # every row must be written
    on = [t.to(device) for t in (q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale)]
    triton_attention.paged_attention(*on[:6], max(n for n, _ in spans), page, head_dim**-0.5, *on[6:],
                                     num_splits=num_splits, out=out, sliding_window=window, softcap=softcap)
    errors = []
    for i, (n, ctx) in enumerate(spans):
        slots = torch.tensor([tables[i][p // page] * page + p % page for p in range(ctx)])
        keys = k_cache[slots].float() * k_scale
        values = v_cache[slots].float() * v_scale
        expected = _reference(q[query_start[i]:query_start[i + 1]], keys, values, ctx - n, window, softcap)
        got = out[query_start[i]:query_start[i + 1]].double().cpu()
        errors.append(float((got - expected).norm() / expected.norm()))
    return max(errors)


MIXED = [(1, 37), (5, 20), (1, 130), (17, 17), (40, 90)]  # decodes, a prompt, chunks after context


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, cache_dtype, tol", [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 1e-2),
    (torch.bfloat16, torch.float8_e4m3fn, 1e-2),
    (torch.float32, torch.float8_e4m3fn, 1e-5),
    (torch.float32, torch.float8_e5m2, 1e-5),
    (torch.bfloat16, torch.float8_e5m2, 1e-2),
])
def test_mixed_batch(device, dtype, cache_dtype, tol):
    assert _run(device, dtype, cache_dtype, MIXED) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [2, 16, 64])
def test_split_decode(device, num_splits):
    """Flash-decoding splits, including splits with no keys (a 1-token context over 16 splits)."""
    assert _run(device, torch.float32, torch.float32, [(1, 1), (1, 33), (1, 300)], num_splits=num_splits) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_heads, group, head_dim, page", [(1, 1, 16, 1), (3, 3, 64, 16), (8, 4, 128, 16),
                                                             (2, 8, 80, 32)])
def test_shapes(device, kv_heads, group, head_dim, page):
    """MHA, SmolLM2's 9/3 heads, Llama-3's 32/8 × 128, and a head size that is not a power of two."""
    err = _run(device, torch.float32, torch.float32, [(1, 50), (9, 9), (3, 40)], kv_heads=kv_heads, group=group,
               head_dim=head_dim, page=page)
    assert err < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 7, 70])
def test_sliding_window(device, num_splits, window):
    """Each query sees its latest `window` keys: prompt tiles whose queries' windows start in
    different key blocks, decodes split over a window that starts mid-block."""
    spans = [(1, 300), (1, 5)] if num_splits > 1 else MIXED
    assert _run(device, torch.float32, torch.float32, spans, num_splits=num_splits, window=window) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_capped_scores(device, num_splits):
    """Gemma 2's softcap: each score becomes cap · tanh(score / cap) before the softmax."""
    spans = [(1, 300), (1, 5)] if num_splits > 1 else MIXED
    assert _run(device, torch.float32, torch.float32, spans, num_splits=num_splits, softcap=0.5) < 1e-5


def test_decode_splits_fill_the_gpu():
    assert triton_attention.decode_splits(1, 8, 132) == 64  # one sequence, 8 KV heads: spread its keys
    assert triton_attention.decode_splits(64, 8, 132) == 1  # 512 programs already
    assert triton_attention.decode_splits(8, 8, 132) == 8
