"""The C rotary and SwiGLU-gate kernels equal their torch formulas, and fall back where they do not apply."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import activation, rotary
from engine.layers.activation import gelu_tanh_and_mul, silu_and_mul
from engine.layers.rotary import RotaryEmbedding, _rotate_half
from tests.helpers import cpu_kernels_off

needs_kernels = pytest.mark.skipif(rotary._kernel() is None or activation._kernel() is None,
                                   reason="no C compiler here")
ROPE = RotaryEmbedding(64, 4096, 10000.0, None)


def _rope_reference(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cos, sin = (table[positions].unsqueeze(1).to(x.dtype) for table in (ROPE.cos, ROPE.sin))
    return x * cos + _rotate_half(x) * sin


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(0, 80), heads=st.integers(1, 12), extra=st.integers(0, 200), seed=st.integers(0, 100))
def test_rotary_kernel_rotates_the_heads_in_place_and_leaves_the_rest(tokens, heads, extra, seed):
    """A row-strided view like the fused qkv output: q/k heads rotated, the v columns after them untouched.

    Token counts cross the kernel's threshold for splitting rows across threads (16 per thread).
    """
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, heads * 64 + extra, generator=g)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    x = rows[:, :heads * 64].view(tokens, heads, 64)
    expected, tail = _rope_reference(positions, x), rows[:, heads * 64:].clone()
    out = ROPE(positions, x)
    assert out.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(rows[:, heads * 64:], tail)


@needs_kernels
def test_a_partial_rotation_turns_the_leading_dims_only():
    """Phi-4-mini rotates 3/4 of each head: the kernel turns those dims in place, the rest stay."""
    partial = RotaryEmbedding(48, 4096, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 5, 64, generator=g)
    positions = torch.randint(0, 4096, (20,), generator=g)
    cos, sin = (table[positions].unsqueeze(1) for table in (partial.cos, partial.sin))
    expected = torch.cat([x[..., :48] * cos + _rotate_half(x[..., :48]) * sin, x[..., 48:]], dim=-1)
    before = x.clone()
    out = partial(positions, x)
    assert out.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    with cpu_kernels_off():  # the torch path, on a copy
        torch.testing.assert_close(partial(positions, before), expected, rtol=1e-6, atol=1e-6)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(0, 40), inter=st.sampled_from([1, 15, 16, 17, 1536]), seed=st.integers(0, 100))
def test_silu_and_mul_kernel_equals_the_formula(tokens, inter, seed):
    """Sizes around the 16-lane vector width; token counts cross the threading threshold at 1536."""
    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(seed)) * 6
    before = x.clone()
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :inter]) * x[:, inter:], rtol=1e-6, atol=1e-6)
    assert torch.equal(x, before)


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(0, 40), inter=st.sampled_from([1, 17, 1536]), seed=st.integers(0, 100))
def test_gelu_tanh_and_mul_kernel_equals_the_formula(tokens, inter, seed):
    """Gemma's GeGLU gate in C (the module path and the one-call decode step share it)."""
    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(seed)) * 6
    expected = F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]
    torch.testing.assert_close(gelu_tanh_and_mul(x), expected, rtol=1e-5, atol=1e-5)
    with cpu_kernels_off():
        torch.testing.assert_close(gelu_tanh_and_mul(x), expected)


def test_torch_paths_where_the_kernels_do_not_apply():
    x = torch.randn(3, 2, 64)
    positions = torch.tensor([0, 5, 4095])
    bf16 = x.bfloat16()
    torch.testing.assert_close(ROPE(positions, bf16), _rope_reference(positions, bf16))  # bf16: torch path
    assert silu_and_mul(bf16.view(3, 128)).dtype == torch.bfloat16
    with cpu_kernels_off():
        expected = _rope_reference(positions, x)
        out = ROPE(positions, x)
        assert out.data_ptr() != x.data_ptr()  # not in place without the kernel
        torch.testing.assert_close(out, expected)
        flat = x.view(3, 128)
        torch.testing.assert_close(silu_and_mul(flat), F.silu(flat[:, :64]) * flat[:, 64:])
