"""The C paged-attention kernels (decode, prefill) equal attention over the dequantized, gathered cache
(fp32, bf16, fp8 e4m3 and e5m2)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import cpu_attention, cpu_kernels
from tests.helpers import MARCH_NEEDS, cpu_kernels_built_for, cpu_kernels_off, skip_unless_cpu_runs

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = [torch.float32, torch.bfloat16, *FP8]

pytestmark = pytest.mark.skipif(not cpu_attention.available(torch.float32, torch.device("cpu")),
                                reason="no C compiler for the attention kernels")


def _gathered(cache, table, n, block_size, scale):
    """The first n tokens of one sequence's cache rows, dequantized: [n, KV, D] float32."""
    pos = torch.arange(n)
    slots = table.long()[pos // block_size] * block_size + pos % block_size
    return cache[slots].float() * scale


def _attend(q, k, v, first_pos, window=None):
    """q [n, H, D] at positions first_pos.. over k/v [L, KV, D]: softmax(q·k/√d)·v, causal, each
    query seeing its latest `window` keys only if set."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    keys, queries = torch.arange(k.shape[0]).unsqueeze(0), torch.arange(first_pos, first_pos + q.shape[0]).unsqueeze(1)
    visible = (keys <= queries) & (keys > queries - window if window else True)
    return torch.einsum("hqk,khd->qhd", F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1), v)


def _reference(q, k_cache, v_cache, tables, lens, block_size, k_scale, v_scale, window):
    """Decode: one query per sequence, at the last of its lens[i] tokens."""
    out = torch.empty_like(q)
    for i, n in enumerate(lens.tolist()):
        k = _gathered(k_cache, tables[i], n, block_size, k_scale)
        v = _gathered(v_cache, tables[i], n, block_size, v_scale)
        out[i] = _attend(q[i:i + 1], k, v, n - 1, window)[0]
    return out


@settings(max_examples=60, deadline=None)
@given(
    cache_dtype=st.sampled_from(CACHE_DTYPES),
    kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([8, 24, 64, 128]), block_size=st.sampled_from([1, 4, 16]),
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=5), seed=st.integers(0, 1000),
    per_head_scales=st.booleans(), window=st.sampled_from([None, 1, 5, 70, 200]),
)
def test_kernel_equals_gathered_reference(cache_dtype, kv_heads, group, head_dim, block_size, lens, seed,
                                          per_head_scales, window):
    """Contexts past 64 tokens merge several ranges, shared among tasks in batches of fewer
    sequences than twice the threads; fp8 caches have one scale, or one per KV head (compressed-tensors' ``attn_head``). bf16 and
    fp8 caches take the tiled walk: contexts end mid-tile, head_dim 8 and 24 end mid-vector, and
    8 query heads of 128 dims hold more weighted sums than its registers. A sliding window
    starts the ranges at its first key."""
    _check_against_reference(cache_dtype, kv_heads, group, head_dim, block_size, lens, seed, per_head_scales, window)


@pytest.mark.parametrize("cache_dtype", [torch.float32, *FP8])
@pytest.mark.parametrize("lens", [[1, 257], [300], [129, 64, 2], [4200]])
def test_split_contexts_merge_to_the_reference(lens, cache_dtype):
    """Few sequences: each context's ranges are shared among tasks across threads (a 1-token one
    leaves tasks without a range); past 64 ranges a range grows to 128 tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tasks per sequence depend on the thread count: pin it
    try:
        _check_against_reference(cache_dtype, 1, 3, 64, 16, lens, 0)
    finally:
        torch.set_num_threads(threads)


def _random_cache(cache_dtype, kv_heads, head_dim, block_size, lens, g, per_head_scales):
    """Caches holding every sequence's tokens, scrambled padded block tables and the KV scales."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    # the kernels take scales for either fp8 format (the engine gives e5m2 unit ones)
    k_scale, v_scale = (torch.tensor(0.02), torch.tensor(0.05)) if cache_dtype in FP8 else (
        torch.tensor(1.0), torch.tensor(1.0))
    if per_head_scales and cache_dtype in FP8:  # [KV, 1], as the loader hands them over
        k_scale = k_scale * torch.arange(1, kv_heads + 1, dtype=torch.float32).reshape(kv_heads, 1)
        v_scale = v_scale * torch.arange(kv_heads, 0, -1, dtype=torch.float32).reshape(kv_heads, 1)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=g) / k_scale).clamp(-448, 448).to(cache_dtype)
    v_cache = (torch.randn(shape, generator=g) / v_scale).clamp(-448, 448).to(cache_dtype)
    # padding entries point at real blocks that must be ignored
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.tensor([[free.pop() for _ in range(b)] + [0] * (max(blocks_per_seq) - b) for b in blocks_per_seq],
                          dtype=torch.int32)
    return k_cache, v_cache, tables, k_scale, v_scale


def _check_against_reference(cache_dtype, kv_heads, group, head_dim, block_size, lens, seed, per_head_scales=False,
                             window=None):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, k_scale, v_scale = _random_cache(cache_dtype, kv_heads, head_dim, block_size, lens, g,
                                                               per_head_scales)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, block_size,
                                              head_dim**-0.5, k_scale, v_scale, window)
    expected = _reference(q, k_cache, v_cache, tables, context_lens, block_size, k_scale, v_scale, window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(
    cache_dtype=st.sampled_from(CACHE_DTYPES),
    kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([8, 24, 64, 128]), block_size=st.sampled_from([1, 4, 16]),
    spans=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 120)), min_size=1, max_size=4),
    seed=st.integers(0, 1000), per_head_scales=st.booleans(), window=st.sampled_from([None, 1, 5, 16, 70]),
)
def test_prefill_kernel_equals_gathered_reference(cache_dtype, kv_heads, group, head_dim, block_size, spans, seed,
                                                  per_head_scales, window):
    """Prompt chunks of (new tokens, earlier context) attend causally to everything before them:
    chunks longer and shorter than the kernel's 16-token tiles (8 on AVX2), contexts that start mid-tile and
    mid-block; fp8 caches with one scale or one per KV head; the fixed shapes (3, 8 heads per KV
    head of 64 and 128) and the general code (1 or 4 of 8); head_dim 24 transposes 16 dimensions
    in registers and the last 8 one by one. A sliding window hides keys from some lanes of a
    tile, and whole leading tiles from later lanes."""
    g = torch.Generator().manual_seed(seed)
    lens = [new + context for new, context in spans]
    k_cache, v_cache, tables, k_scale, v_scale = _random_cache(cache_dtype, kv_heads, head_dim, block_size, lens, g,
                                                               per_head_scales)
    news = [new for new, _ in spans]
    q = torch.randn(sum(news), kv_heads * group, head_dim, generator=g)
    query_start = torch.tensor([0, *news], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = cpu_attention.paged_prefill_attention(q, k_cache, v_cache, tables, query_start,
                                               torch.tensor(lens, dtype=torch.int32), block_size, head_dim**-0.5,
                                               k_scale, v_scale, window)
    for i, (_, context) in enumerate(spans):
        k = _gathered(k_cache, tables[i], lens[i], block_size, k_scale)
        v = _gathered(v_cache, tables[i], lens[i], block_size, v_scale)
        rows = slice(int(query_start[i]), int(query_start[i + 1]))
        torch.testing.assert_close(out[rows], _attend(q[rows], k, v, context, window), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("march", sorted(MARCH_NEEDS))
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decode_built_for_older_cpus_equals_gathered_reference(march, cache_dtype):
    """Built for an AVX2 CPU the tiled walk over bf16 and fp8 caches scores and sums in runs of 8
    dims (16 with AVX-512): contexts of one token, part of a tile, several tiles and ranges."""
    skip_unless_cpu_runs(march)
    with cpu_kernels_built_for(march):
        _check_against_reference(cache_dtype, 3, 3, 64, 16, [1, 7, 300, 70], seed=0)
        _check_against_reference(cache_dtype, 2, 4, 20, 4, [33, 129], seed=1, window=20)  # a part-run of dims


@pytest.mark.parametrize("march", sorted(MARCH_NEEDS))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_gives_the_same_floats_built_for_older_cpus(march, cache_dtype, window):
    """Built for an AVX2 CPU a vector holds 8 query tokens instead of 16 (in registers, not on the
    stack); each lane still computes one query over the same key tiles, so the floats are this
    build's bit for bit (a gate's verdict holds on either)."""
    skip_unless_cpu_runs(march)
    g = torch.Generator().manual_seed(0)
    spans = [(37, 0), (5, 70), (130, 9)]
    lens = [new + context for new, context in spans]
    k_cache, v_cache, tables, k_scale, v_scale = _random_cache(cache_dtype, 3, 64, 16, lens, g, False)
    q = torch.randn(sum(new for new, _ in spans), 9, 64, generator=g)
    query_start = torch.tensor([0, *(new for new, _ in spans)], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def attend() -> torch.Tensor:
        return cpu_attention.paged_prefill_attention(q, k_cache, v_cache, tables, query_start,
                                                     torch.tensor(lens, dtype=torch.int32), 16, 0.125, k_scale,
                                                     v_scale, window)

    here = attend()
    with cpu_kernels_built_for(march):
        assert torch.equal(attend(), here)


def test_prefill_rejects_a_head_dim_its_blocks_cannot_cover():
    cache = torch.zeros(4, 1, 12)
    one, lens = torch.tensor(1.0), torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8, got 12"):
        cpu_attention.paged_prefill_attention(torch.zeros(2, 1, 12), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                              torch.tensor([0, 2], dtype=torch.int32), lens, 4, 1.0, one, one)


def test_bf16_queries_are_accepted():
    """A bf16 model hands bf16 queries; the kernels compute in fp32 and return fp32."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(8, 1, 16, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(1, 2, 16, generator=g).bfloat16()
    tables, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    one = torch.tensor(1.0)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 4, 0.25, one, one)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(q.float(), k_cache, v_cache, tables, lens, 4, one, one, None))
    # and a bf16 prompt chunk: the last 3 of those 6 tokens
    q3 = torch.randn(3, 2, 16, generator=g).bfloat16()
    out = cpu_attention.paged_prefill_attention(q3, k_cache, v_cache, tables, torch.tensor([0, 3], dtype=torch.int32),
                                               lens, 4, 16**-0.5, one, one)
    assert out.dtype == torch.float32
    k, v = (_gathered(c, tables[0], 6, 4, one) for c in (k_cache, v_cache))
    torch.testing.assert_close(out, _attend(q3.float(), k, v, 3))


def test_disabled_by_environment():
    with cpu_kernels_off():
        assert not cpu_attention.available(torch.float32, torch.device("cpu"))


def test_missing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DRIFTGATE_HOME", str(tmp_path))  # no cached build to reuse
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_kernels.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not cpu_attention.available(torch.float32, torch.device("cpu"))
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.kernel.cache_clear()


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("DRIFTGATE_HOME", str(tmp_path))
    cpu_kernels.kernel.cache_clear()
    try:
        assert cpu_attention.available(torch.float32, torch.device("cpu"))
        built = list((tmp_path / "kernels").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        mtime = built[0].stat().st_mtime_ns
        cpu_kernels.kernel.cache_clear()
        assert cpu_attention.available(torch.float32, torch.device("cpu"))
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()] == [mtime]  # reused, not rebuilt
    finally:
        monkeypatch.undo()
        cpu_kernels.kernel.cache_clear()


def test_block_size_must_be_a_power_of_two():
    cache = torch.zeros(12, 1, 8)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="power of two"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 1, 8), cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                                            torch.tensor([4], dtype=torch.int32), 3, 1.0, one, one)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_capped_scores_equal_the_formula(cache_dtype):
    """Gemma 2's softcap: each score becomes cap · tanh(score / cap) before the softmax, in the
    decode kernel (contexts over several ranges) and the prefill kernel (masked lanes stay -inf)."""
    g = torch.Generator().manual_seed(3)
    cap, lens, news = 2.0, [5, 130, 300], [5, 20, 1]
    k_cache, v_cache, tables, k_scale, v_scale = _random_cache(cache_dtype, 2, 64, 16, lens, g, False)
    q = torch.randn(len(lens), 6, 64, generator=g) * 4  # scores large enough for the cap to bite
    decoded = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                                   16, 64**-0.5, k_scale, v_scale, softcap=cap)
    queries = torch.randn(sum(news), 6, 64, generator=g) * 4
    query_start = torch.tensor([0, *news], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    prefilled = cpu_attention.paged_prefill_attention(queries, k_cache, v_cache, tables, query_start,
                                                      torch.tensor(lens, dtype=torch.int32), 16, 64**-0.5, k_scale,
                                                      v_scale, softcap=cap)
    for i, n in enumerate(lens):
        k, v = _gathered(k_cache, tables[i], n, 16, k_scale), _gathered(v_cache, tables[i], n, 16, v_scale)
        rows = slice(int(query_start[i]), int(query_start[i + 1]))
        for out, qs, first in ((decoded[i:i + 1], q[i:i + 1], n - 1), (prefilled[rows], queries[rows], n - news[i])):
            rep = qs.shape[1] // k.shape[1]
            scores = torch.einsum("qhd,khd->hqk", qs, k.repeat_interleave(rep, 1)) * 64**-0.5
            scores = torch.tanh(scores / cap) * cap
            visible = torch.arange(n)[None, :] <= torch.arange(first, first + qs.shape[0])[:, None]
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", weights, v.repeat_interleave(rep, 1)),
                                       atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_every_fp8_byte_decodes_as_torch(cache_dtype):
    """A one-token context's output is its V row: with all 256 byte patterns in V (NaN and
    infinity, never stored, as zero), both kernels decode each as torch does, subnormals and
    the extremes included, in the vector lanes and the scalar tail (head_dim 136 = 8 × 16 + 8)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(cache_dtype).float()
    codes[~values.isfinite()] = 0
    v_cache = torch.cat([codes, codes[:16]]).reshape(2, 1, 136).view(cache_dtype)
    k_cache = torch.zeros_like(v_cache)
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
    scale = torch.tensor(0.5)
    expected = v_cache.float() * scale  # [2, 1, 136]
    q = torch.randn(2, 1, 136)
    decoded = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1, 136**-0.5, scale, scale)
    prefilled = cpu_attention.paged_prefill_attention(q, k_cache, v_cache, tables,
                                                      torch.tensor([0, 1, 2], dtype=torch.int32), lens, 1,
                                                      136**-0.5, scale, scale)
    assert torch.equal(decoded, expected) and torch.equal(prefilled, expected)
