"""The fused C RMSNorm (residual add + norm in one pass) equals the step-by-step fp32 formula."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import norm
from engine.layers.norm import RMSNorm
from tests.helpers import cpu_kernels_off

needs_kernel = pytest.mark.skipif(norm._kernel() is None, reason="no C compiler here")


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 130), hidden=st.sampled_from([1, 7, 64, 576]), seed=st.integers(0, 100))
def test_fused_kernel_equals_the_formula(rows, hidden, seed):
    """Rows cross the kernel's threshold for splitting rows across threads (64)."""
    g = torch.Generator().manual_seed(seed)
    layer = RMSNorm(hidden, 1e-5, torch.float32)
    layer.weight.data = torch.randn(hidden, generator=g)
    x, residual = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    torch.testing.assert_close(layer(x), _reference(x, layer.weight, 1e-5), rtol=1e-5, atol=1e-5)
    x_before, residual_before = x.clone(), residual.clone()
    out, total = layer(x, residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
    torch.testing.assert_close(total, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, _reference(x + residual, layer.weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_torch_path_where_the_kernel_does_not_apply():
    layer = RMSNorm(8, 1e-6, torch.float32)
    x = torch.randn(3, 8)
    strided = torch.randn(8, 3).t()  # not contiguous: torch path
    torch.testing.assert_close(layer(strided), _reference(strided, layer.weight, 1e-6))
    with cpu_kernels_off():
        assert layer._fused_cpu(x, None) is None
        out, total = layer(x, x)
        torch.testing.assert_close(out, _reference(2 * x, layer.weight, 1e-6))


def test_bf16_keeps_the_torch_path():
    layer = RMSNorm(8, 1e-6, torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert layer._fused_cpu(x, None) is None
    assert layer(x).dtype == torch.bfloat16


def test_bf16_norms_round_where_their_references_do():
    """In bf16, Llama's reference rounds the normalized x, then scales by its bf16 weight; Gemma's
    scales by (1 + w) in fp32 and rounds once: each of ours equals its reference bit for bit
    (the Gemma one with the loader's folded offset, its weight kept fp32)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(64, generator=g) * 0.3
    llama, theirs = RMSNorm(64, 1e-6, torch.bfloat16), LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    llama.weight.data.copy_(w)
    theirs.weight.data.copy_(w)
    assert torch.equal(llama(x), theirs(x))
    gemma, theirs = RMSNorm(64, 1e-6, torch.bfloat16, scale_in_fp32=True), Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    theirs.weight.data.copy_(w)  # the checkpoint's w, in bf16
    gemma.weight.data.copy_(theirs.weight.float() + 1.0)  # as the loader stores it
    assert gemma.weight.dtype == torch.float32
    assert torch.equal(gemma(x), theirs(x))


def test_gemma_models_build_their_norms_the_gemma_way(tmp_path):
    from engine.loader import load_model
    from tests.helpers import make_tiny_model_dir

    gemma = make_tiny_model_dir(tmp_path / "gemma", architecture="Gemma3ForCausalLM", head_dim=16,
                                extra_config={"query_pre_attn_scalar": 16, "pad_token_id": 0})
    for folder, fp32_scale in ((gemma, True), (make_tiny_model_dir(tmp_path / "llama"), False)):
        model, _ = load_model(folder, "bfloat16")
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        assert {(n.scale_in_fp32, n.weight.dtype) for n in norms} == {
            (fp32_scale, torch.float32 if fp32_scale else torch.bfloat16)}
