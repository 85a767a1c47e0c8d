"""The C paged-decode kernel equals attention over the dequantized, gathered cache (fp32, bf16, fp8)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import cpu_kernels, paged_decode
from tests.helpers import cpu_kernels_off

pytestmark = pytest.mark.skipif(not paged_decode.available(torch.float32, torch.device("cpu")),
                                reason="no C compiler for the decode kernel")


def _reference(q, k_cache, v_cache, tables, lens, block_size, k_scale, v_scale):
    """Gather each sequence's slots, dequantize, repeat KV heads, softmax(q·k/√d)·v."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k_cache.shape[1]
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float() * k_scale
        v = v_cache[slots].float() * v_scale
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [n, H, D]
        weights = F.softmax(torch.einsum("hd,thd->ht", q[i], k) * q.shape[-1] ** -0.5, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", weights, v)
    return out


@settings(max_examples=60, deadline=None)
@given(
    cache_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
    kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([8, 64]),
    block_size=st.sampled_from([1, 4, 16]), lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    seed=st.integers(0, 1000), per_head_scales=st.booleans(),
)
def test_kernel_equals_gathered_reference(cache_dtype, kv_heads, group, head_dim, block_size, lens, seed,
                                          per_head_scales):
    """Contexts past 128 in batches of fewer sequences than twice the threads take the split-context
    path; fp8 caches have one scale, or one per KV head (compressed-tensors' ``attn_head``)."""
    _check_against_reference(cache_dtype, kv_heads, group, head_dim, block_size, lens, seed, per_head_scales)


@pytest.mark.parametrize("lens", [[1, 257], [300], [129, 64, 2]])
def test_split_contexts_merge_to_the_reference(lens):
    """Few sequences: each context is cut into ranges across threads (a 1-token one leaves a range empty)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split count depends on the thread count: pin it
    try:
        _check_against_reference(torch.float32, 1, 3, 64, 16, lens, 0)
    finally:
        torch.set_num_threads(threads)


def _check_against_reference(cache_dtype, kv_heads, group, head_dim, block_size, lens, seed, per_head_scales=False):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_scale, v_scale = (torch.tensor(0.02), torch.tensor(0.05)) if cache_dtype == torch.float8_e4m3fn else (
        torch.tensor(1.0), torch.tensor(1.0))
    if per_head_scales and cache_dtype == torch.float8_e4m3fn:  # [KV, 1], as the loader hands them over
        k_scale = k_scale * torch.arange(1, kv_heads + 1, dtype=torch.float32).reshape(kv_heads, 1)
        v_scale = v_scale * torch.arange(kv_heads, 0, -1, dtype=torch.float32).reshape(kv_heads, 1)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=g) / k_scale).clamp(-448, 448).to(cache_dtype)
    v_cache = (torch.randn(shape, generator=g) / v_scale).clamp(-448, 448).to(cache_dtype)
    # scrambled, padded block tables: padding entries point at real blocks that must be ignored
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.tensor([[free.pop() for _ in range(b)] + [0] * (max(blocks_per_seq) - b) for b in blocks_per_seq],
                          dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
    out = paged_decode.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, block_size,
                                              head_dim**-0.5, k_scale, v_scale)
    expected = _reference(q, k_cache, v_cache, tables, context_lens, block_size, k_scale, v_scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_bf16_queries_are_accepted():
    """A bf16 model hands bf16 queries; the kernel computes in fp32 and returns fp32."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(8, 1, 16, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(1, 2, 16, generator=g).bfloat16()
    tables, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    one = torch.tensor(1.0)
    out = paged_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 4, 0.25, one, one)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(q.float(), k_cache, v_cache, tables, lens, 4, one, one))


def test_disabled_by_environment():
    with cpu_kernels_off():
        assert not paged_decode.available(torch.float32, torch.device("cpu"))


def test_missing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DRIFTGATE_HOME", str(tmp_path))  # no cached build to reuse
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_kernels.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not paged_decode.available(torch.float32, torch.device("cpu"))
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.kernel.cache_clear()


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("DRIFTGATE_HOME", str(tmp_path))
    cpu_kernels.kernel.cache_clear()
    try:
        assert paged_decode.available(torch.float32, torch.device("cpu"))
        built = list((tmp_path / "kernels").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        mtime = built[0].stat().st_mtime_ns
        cpu_kernels.kernel.cache_clear()
        assert paged_decode.available(torch.float32, torch.device("cpu"))
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()] == [mtime]  # reused, not rebuilt
    finally:
        monkeypatch.undo()
        cpu_kernels.kernel.cache_clear()


def test_block_size_must_be_a_power_of_two():
    cache = torch.zeros(12, 1, 8)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode.paged_decode_attention(torch.zeros(1, 1, 8), cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                                            torch.tensor([4], dtype=torch.int32), 3, 1.0, one, one)
