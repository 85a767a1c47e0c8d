"""How much memory the KV cache gets: vLLM's gpu_memory_utilization on CUDA, a fixed budget on a CPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig
from engine.config import DEFAULT_CPU_KV_BYTES
from engine.llm_engine import cuda_kv_budget

GiB = 1 << 30


def test_the_cache_gets_the_engines_share_less_its_weights_and_working_memory():
    # an 80 GiB GPU, 16 GiB of weights, 2 GiB of prefill working memory
    assert cuda_kv_budget(80 * GiB, 64 * GiB, 16 * GiB, 2 * GiB, 0.9) == int(0.9 * 80 * GiB) - 18 * GiB
    # two engines at 0.45 each: the second's share is the same, whatever the first one took
    first = cuda_kv_budget(80 * GiB, 64 * GiB, 16 * GiB, 2 * GiB, 0.45)
    assert first == int(0.45 * 80 * GiB) - 18 * GiB
    assert cuda_kv_budget(80 * GiB, 64 * GiB - 16 * GiB - first, 16 * GiB, 2 * GiB, 0.45) == first
    # never more than is free (another process holds memory), never negative
    assert cuda_kv_budget(80 * GiB, 20 * GiB, 16 * GiB, 2 * GiB, 0.9) == 18 * GiB
    assert cuda_kv_budget(80 * GiB, 64 * GiB, 40 * GiB, 2 * GiB, 0.45) == 0


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_must_be_a_share(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in \\(0, 1\\]"):
        EngineConfig(model="m", gpu_memory_utilization=value)


def test_on_a_cpu_the_cache_takes_its_fixed_budget(tiny_model_dir):
    def num_blocks(**kwargs) -> int:
        return LLM(str(tiny_model_dir), dtype="float32", device="cpu", **kwargs).engine.block_manager.num_blocks

    assert num_blocks(gpu_memory_utilization=0.1) == num_blocks() == num_blocks(kv_cache_memory_bytes=DEFAULT_CPU_KV_BYTES)
    assert num_blocks(kv_cache_memory_bytes=DEFAULT_CPU_KV_BYTES // 2) == num_blocks() // 2


def test_a_cache_too_small_for_one_block_or_one_sequence_says_what_to_raise(tiny_model_dir):
    with pytest.raises(ValueError, match="cannot hold one block of 16 tokens; raise kv_cache_memory_bytes"):
        LLM(str(tiny_model_dir), kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="less than max_model_len=512; raise kv_cache_memory_bytes"):
        LLM(str(tiny_model_dir), num_kv_blocks=4, max_model_len=512)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_engines_share_a_gpu_each_within_its_part(tiny_model_dir):
    """The gate's arms on one GPU: each engine's weights, cache and working memory stay within its share."""
    total = torch.cuda.mem_get_info()[1]
    engines = []
    for _ in range(2):
        before = torch.cuda.memory_allocated()
        engines.append(LLM(str(tiny_model_dir), device="cuda", gpu_memory_utilization=0.3, max_model_len=512))
        assert torch.cuda.memory_allocated() - before <= 0.3 * total
        assert engines[-1].engine.block_manager.num_blocks > 0
