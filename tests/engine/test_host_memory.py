"""engine/host_memory.py: the KV cache's zeros() behaves like torch.zeros; the weight arena hands out
aligned, disjoint, contiguous tensors; freed heap pages go back to the OS."""

import gc
import os
from itertools import pairwise

import pytest
import torch

from engine import LLM, host_memory, loader
from engine.layers.attention import KVCache
from engine.layers.linear import DenseLinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(0, 3, 64), (1, 1, 1), (5000, 3, 64)])  # empty, below and above a huge page
def test_zeros_is_zeroed_contiguous_and_writable(shape, dtype):
    t = host_memory.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t.float()) == 0
    if t.numel():
        t[-1] = 1.0
        assert t.float()[-1].eq(1.0).all() and torch.count_nonzero(t.float()) == t[-1].numel()


def test_the_mapping_outlives_the_function_that_made_it():
    t = host_memory.zeros((4096, 128), torch.float32).fill_(2.5)
    tail = t[4000:]
    del t
    gc.collect()
    torch.testing.assert_close(tail.sum(), torch.tensor(2.5 * 96 * 128))


def test_kv_cache_layers_are_separate_zeroed_tensors():
    cache = KVCache(num_layers=3, num_slots=2048, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    cache.k[0].fill_(1.0)
    assert len({t.data_ptr() for t in cache.k + cache.v}) == 6
    assert all(torch.count_nonzero(t) == 0 for t in cache.k[1:] + cache.v)


def test_arena_tensors_are_aligned_disjoint_copies():
    arena = host_memory.Arena(chunk_bytes=1 << 16)
    sources = [torch.randn(n, 7).to(dtype) for n, dtype in [(3, torch.float32), (100, torch.bfloat16), (1000, torch.float32),
                                                            (500, torch.float32), (5, torch.int8)]]
    copies = [arena.copy(s.t()) for s in sources]  # transposed sources: copy() makes them contiguous
    for src, out in zip(sources, copies, strict=True):
        assert out.is_contiguous() and out.data_ptr() % host_memory.Arena.ALIGN == 0
        assert torch.equal(out, src.t())
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))  # no two overlap


def test_arena_starts_a_new_chunk_when_full_and_maps_large_tensors_alone():
    arena = host_memory.Arena(chunk_bytes=8192)
    chunk = [arena.empty((500,), torch.float32) for _ in range(4)]  # 2000 B each, 2048 apart: one chunk
    assert len({t.untyped_storage().data_ptr() for t in chunk}) == 1
    assert [t.data_ptr() - chunk[0].data_ptr() for t in chunk] == [0, 2048, 4096, 6144]
    after = arena.empty((500,), torch.float32)  # does not fit: a second chunk
    assert after.untyped_storage().data_ptr() != chunk[0].untyped_storage().data_ptr()
    assert arena.empty((0, 4), torch.float32).shape == (0, 4)
    big = arena.empty((750,), torch.float32)  # over a quarter chunk: a mapping of its own
    assert big.untyped_storage().nbytes() == 3000
    assert arena.empty((16,), torch.float32).untyped_storage().data_ptr() == after.untyped_storage().data_ptr()


def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


@pytest.mark.skipif(host_memory._malloc_trim() is None or not os.path.exists("/proc/self/statm"),
                    reason="not glibc, or no /proc to read RSS from")
def test_freed_heap_pages_go_back_to_the_os():
    """As loading does: many tensors made and freed below glibc's mmap threshold (so on its heap),
    one made after them still in use (the heap's top cannot shrink). The freed pages stay
    resident until they are handed back."""
    churn = [torch.ones(16 << 10) for _ in range(3000)]  # 3000 × 64 KiB, written
    kept = torch.ones(16 << 10)
    del churn
    before = _rss_mib()
    assert host_memory.return_freed_memory()
    assert _rss_mib() < before - 100, "the ~190 MiB freed stayed resident"
    assert kept.sum() == kept.numel()


def test_the_engine_hands_back_what_loading_freed(tiny_model_dir, monkeypatch):
    calls = []
    real = host_memory.return_freed_memory
    monkeypatch.setattr(host_memory, "return_freed_memory", lambda: calls.append(1) or real())
    assert LLM(str(tiny_model_dir)).engine and calls == [1]  # the tiny model reads less than a trim's worth
    monkeypatch.setattr(loader, "_TRIM_EVERY", 1)
    calls.clear()
    model = LLM(str(tiny_model_dir)).engine.model
    # after each Linear is built as the loader goes (each reads a byte or more), and once at the end
    assert len(calls) == sum(isinstance(m, DenseLinear) for m in model.modules()) + 1
