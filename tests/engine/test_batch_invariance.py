"""A sequence's decode is the same bit for bit whatever else shares its batch (CPU kernels).

Greedy tokens that depend on the batch make a quality gate's verdict depend on its batch size:
per-token int8 or fp8 activations turn a last-bit difference in attention into a different token
at a near-tie. So the decode attention kernel cuts each context at fixed offsets, and the tests
below hold the kernel and the engine to exact equality, not a tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers import cpu_attention
from engine.layers.linear import matmul_kernels
from quant.checkpoint import write_checkpoint
from quant.config import QuantizationConfig
from quant.schemes import preset
from tests.engine.test_cpu_attention import _random_cache
from tests.helpers import cpu_kernels_built_for, make_tiny_model_dir, quantized_tensors, skip_unless_cpu_runs

pytestmark = pytest.mark.skipif(not cpu_attention.available(torch.float32, torch.device("cpu")),
                                reason="no C compiler for the attention kernels")


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; the count it had comes back afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_decode_rows_do_not_depend_on_the_batch_or_threads(cache_dtype, threads):
    """Each row of a batch equals that sequence decoded alone on one thread: contexts of 1 token, a
    range and a token either side of one, several ranges, and one past 64 ranges (wider ranges)."""
    lens = [1, 63, 64, 65, 300, 4200, 129, 2]
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables, k_scale, v_scale = _random_cache(cache_dtype, 3, 64, 16, lens, g, False)
    q = torch.randn(len(lens), 9, 64, generator=g)
    context_lens = torch.tensor(lens, dtype=torch.int32)

    def decode(rows: list[int]) -> torch.Tensor:
        return cpu_attention.paged_decode_attention(q[rows], k_cache, v_cache, tables[rows], context_lens[rows], 16,
                                                    0.125, k_scale, v_scale)

    threads(1)
    alone = torch.cat([decode([i]) for i in range(len(lens))])
    for num_threads in (1, 2, 3):
        threads(num_threads)
        for rows in ([4], [5], [4, 1], [0, 4, 5], list(range(len(lens))), [4] * 9):
            assert torch.equal(decode(rows), alone[rows]), (num_threads, rows)


def _checkpoint(tmp_path, scheme: str | None):
    source = make_tiny_model_dir(tmp_path / "source")
    if scheme is None:
        return source
    return write_checkpoint(tmp_path / scheme, source_dir=source,
                            quant_config=QuantizationConfig.for_scheme(preset(scheme)),
                            tensors=quantized_tensors(source, preset(scheme), kv=False))


# w4a8's groups of 128 do not fit the tiny model's 64 columns: it runs the oracle on prepacked weights
SCHEMES = [None, "fp8-dynamic", "fp8-static", "w8a16", "w4a16", "w4a16-asym", "w4a8", "mxfp4a16",
           "w8a8-int8"]


def _assert_greedy_outputs_alone_equal_together(llm: LLM) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (150, 90, 200, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    def decoded(outputs) -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    together = decoded(llm.generate(prompts, params, use_tqdm=False))
    alone = [decoded(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_outputs_do_not_depend_on_the_batch(tmp_path, threads, scheme):
    """Four prompts decoded together give each one's tokens and logprobs decoded alone, exactly:
    at two threads a lone sequence's context is spread over both, in a batch each walks its own."""
    threads(2)
    _assert_greedy_outputs_alone_equal_together(LLM(str(_checkpoint(tmp_path, scheme)), enable_prefix_caching=False))


def test_w8a8_on_an_avx2_build_does_not_depend_on_the_batch(tmp_path, threads):
    """Every C kernel built for an AVX2 CPU without VNNI (W8A8 on pmaddubsw, 4-row tiles, the
    float kernels on 8-lane vectors): a row's outputs are the same alone and in a batch."""
    skip_unless_cpu_runs("haswell")
    threads(2)
    with cpu_kernels_built_for("haswell"):
        llm = LLM(str(_checkpoint(tmp_path, "w8a8-int8")), enable_prefix_caching=False)
        assert set(matmul_kernels(llm.engine.model)) == {"w8a8panel"}
        _assert_greedy_outputs_alone_equal_together(llm)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_speculative_drafts_do_not_change_outputs(tmp_path, threads, scheme):
    """Drafts are verified as extra decode rows of their sequence, each with its own context: the
    tokens and logprobs are plain decoding's exactly, on quantized activations too."""
    threads(2)
    model_dir = str(_checkpoint(tmp_path, scheme))
    spec_config = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "disable_by_batch_size": 0}
    plain = LLM(model_dir, enable_prefix_caching=False)
    spec = LLM(model_dir, enable_prefix_caching=False, speculative_config=spec_config)
    prompts = [[5, 6, 7, 8, 9] * 30, [11, 12] * 40 + [11], list(range(20, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = {llm: [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params,
                                                                                          use_tqdm=False)]
               for llm in (plain, spec)}
    assert outputs[spec] == outputs[plain]
    assert spec.stats().num_accepted_draft_tokens > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prompt_logprobs_do_not_depend_on_batch_or_chunking(tmp_path, threads, scheme):
    """What the gate scores (prompt logprobs) is the same alone or beside other prompts, in one
    chunk or cut into 16-token chunks by the step budget."""
    threads(2)
    model_dir = str(_checkpoint(tmp_path, scheme))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (300, 120, 77)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    runs = []
    for budget in (2048, 16):
        llm = LLM(model_dir, enable_prefix_caching=False, max_num_batched_tokens=budget, max_model_len=512)
        runs.append([o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)])
        runs.append([llm.generate([p], params, use_tqdm=False)[0].prompt_logprobs for p in prompts])
    assert all(run == runs[0] for run in runs[1:])
