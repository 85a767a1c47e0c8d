"""engine/host_memory.py: KV-cache storage on huge pages behaves like torch.zeros."""

import gc

import pytest
import torch

from engine import host_memory
from engine.layers.attention import KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(1, 1, 1), (5000, 3, 64)])  # below and above one huge page
def test_zeros_is_zeroed_contiguous_and_writable(shape, dtype):
    t = host_memory.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t.float()) == 0
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
