"""The fused Triton ops (RMSNorm + residual, rotary, silu·mul) equal their torch definitions.

CPU: Triton's interpreter (tests/conftest.py); the `cuda` cases run the compiled kernels. fp32
agrees to rounding (1e-5); bf16 rounds once where torch rounds after each op (one bf16 step, 1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import triton_fused, triton_support
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, _rotate_half

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not triton_support.available(torch.device("cpu")),
                                                 reason="triton is not installed")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or triton_fused.triton is None, reason="needs CUDA and triton")]),
]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    err = ((got.double().cpu() - expected.double().cpu()).norm() / expected.double().cpu().norm()).item()
    assert err < tol, err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_with_and_without_residual(device, dtype, tol, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(5, hidden, generator=g).to(dtype).to(device) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5, dtype).to(device)
    norm.weight.copy_(torch.rand(hidden, generator=g).to(dtype))
    _close(triton_fused.rms_norm(x, norm.weight, norm.eps), norm._norm(x), tol)
    out, total = triton_fused.rms_norm(x, norm.weight, norm.eps, residual)
    _close(total, x + residual, tol)
    _close(out, norm._norm(x + residual), tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_a_strided_view(device, dtype, tol, head_dim):
    """q and k heads side by side in a fused qkv row, as the model passes them."""
    g = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 500000.0, None)
    qkv = torch.randn(6, 7 * head_dim, generator=g).to(dtype).to(device)
    positions = torch.tensor([0, 1, 2, 100, 2000, 4095], device=device)
    qk = qkv[:, :6 * head_dim].view(6, 6, head_dim)  # rows strided by 7 heads
    cos, sin = rotary.cos[positions.cpu()].unsqueeze(1), rotary.sin[positions.cpu()].unsqueeze(1)
    expected = qk.float().cpu() * cos + _rotate_half(qk.float().cpu()) * sin
    untouched = qkv[:, 6 * head_dim:].clone()
    triton_fused.rotary_in_place(qk, positions, rotary.cos.to(device), rotary.sin.to(device))
    _close(qk, expected, tol)
    assert torch.equal(qkv[:, 6 * head_dim:], untouched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("inter", [96, 1536, 3000])
def test_silu_and_mul(device, dtype, tol, inter):
    x = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype).to(device)
    gate, up = x.float().chunk(2, dim=-1)
    _close(triton_fused.silu_and_mul(x), F.silu(gate) * up, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_kv_writes_what_the_torch_store_writes(device, cache_dtype):
    """k and v as the model passes them (strided views of the fused qkv rows), written to their
    slots with attention._store's rounding, bit for bit; slots not written stay as they were."""
    from engine.layers.attention import _store

    tokens, kv_heads, head_dim, num_slots = 5, 3, 24, 40
    g = torch.Generator().manual_seed(7)
    width = (4 + 2 * kv_heads) * head_dim
    magnitudes = 10 ** (torch.rand(tokens, width, generator=g) * 6 - 5)  # 1e-5 .. 10: fp8 subnormals to saturation
    qkv = (torch.randn(tokens, width, generator=g) * magnitudes).to(device)
    k = qkv[:, 4 * head_dim:(4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 17, 0, 39, 8], device=device)
    k_scale, v_scale = torch.tensor(2.0**-6, device=device), torch.tensor(0.0125, device=device)
    # saturated both ways, zero, a subnormal, then ties (to even) between e4m3 values, subnormal and normal
    k[0, 0, :6] = torch.tensor([1e4, -1e4, 0.0, 2.0**-13, 3 * 2.0**-16, -17 * 2.0**-10])
    v[0, 0, :2] = torch.tensor([1 + 2.0**-8, -(1 + 3 * 2.0**-8)])  # ties between bf16 values
    # e5m2 (k / 2^-6): ties between normals (1.125, 1.375), between subnormals (5 · 2^-17), the
    # smallest normal 2^-14 and the largest subnormal's tie with it, and saturation at 57344
    k[1, 0, :6] = torch.tensor([1.125, -1.375, 5 * 2.0**-17, 2.0**-14, 7 * 2.0**-17, 6e4]) * 2.0**-6
    before = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(cache_dtype).to(device)
    expected_k, expected_v, got_k, got_v = (before.clone() for _ in range(4))
    _store(expected_k, slots, k, k_scale)
    _store(expected_v, slots, v, v_scale)
    assert triton_fused.store_kv(got_k, got_v, slots, k, v, k_scale, v_scale)
    for got, expected in ((got_k, expected_k), (got_v, expected_v)):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(not triton_support.available(torch.device("cpu")), reason="triton is not installed")
@pytest.mark.parametrize("kv", [{"kv_cache_dtype": "fp8", "kv_scales": "dynamic"}, {"kv_cache_dtype": "fp8_e5m2"},
                                {"kv_cache_dtype": "bfloat16"}])
def test_engine_on_triton_writes_the_kv_bytes_the_torch_backend_writes(tiny_model_dir, kv):
    """Through the engine (prompt and decode steps): the first layer's K/V, whose inputs both
    backends compute alike, are the same bytes; and the greedy tokens agree."""
    from engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = []
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", attention_backend=backend, **kv)
        out = llm.generate([list(range(5, 40))], greedy, use_tqdm=False)[0].outputs[0].token_ids
        cache = llm.engine.kv_cache
        runs.append((out, cache.k[0].view(torch.uint8).clone(), cache.v[0].view(torch.uint8).clone()))
    (tokens, k, v), (triton_tokens, triton_k, triton_v) = runs
    assert triton_tokens == tokens
    assert torch.equal(triton_k, k) and torch.equal(triton_v, v)
