"""The serving engine's CPU weight layout (16-column panels, C kernel) computes the same Linear."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM
from engine.layers import panel_matmul
from engine.layers.linear import DenseLinear
from engine.loader import load_model
from tests.helpers import cpu_kernels_off

needs_kernel = pytest.mark.skipif(panel_matmul.pack(torch.zeros(16, 1)) is None, reason="no C compiler here")


def _layer(in_features: int, sizes: list[int], bias: bool, g: torch.Generator,
           bf16_values: bool = False) -> DenseLinear:
    layer = DenseLinear(in_features, sizes, bias, torch.float32)
    for i, n in enumerate(sizes):
        weight = torch.randn(n, in_features, generator=g)
        tensors = {"weight": weight.bfloat16().float() if bf16_values else weight}
        if bias:
            tensors["bias"] = torch.randn(n, generator=g)
        layer.load_shard(i, tensors)
    layer.finalize()
    return layer


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), in_features=st.sampled_from([1, 8, 37, 96]),
       sizes=st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3), bias=st.booleans(),
       seed=st.integers(0, 100), bf16_values=st.booleans())
def test_packed_linear_equals_plain(rows, in_features, sizes, bias, seed, bf16_values):
    """Every row count crosses the kernel's row tiles and their leftovers (tiles of 4 or 8).
    Weights that are all bf16 values (a BF16 checkpoint) pack as bf16 and give the very same
    floats as fp32 panels."""
    g = torch.Generator().manual_seed(seed)
    layer = _layer(in_features, sizes, bias, g, bf16_values)
    weight, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    x = torch.randn(rows, in_features, generator=g)
    layer.prepack()
    assert layer.weight.shape == (sum(sizes) // 16, in_features, 16)
    assert layer.weight.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    if bf16_values:
        assert torch.equal(layer(x), panel_matmul.matmul(x, panel_matmul.pack(weight, narrow=False), b))
    x3d = torch.randn(2, 3, in_features, generator=g)
    torch.testing.assert_close(layer(x3d), F.linear(x3d, weight, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(in_features, rows, generator=g).t()  # not contiguous: copied for the kernel
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, b), rtol=1e-5, atol=1e-5)


def test_weights_the_kernel_cannot_take_stay_plain():
    assert panel_matmul.pack(torch.randn(16, 8, dtype=torch.bfloat16)) is None
    assert panel_matmul.pack(torch.randn(24, 8)) is None  # not whole panels
    if torch.cuda.is_available():
        assert panel_matmul.pack(torch.randn(16, 8, device="cuda")) is None
    with cpu_kernels_off():
        layer = _layer(8, [16], True, torch.Generator().manual_seed(0))
        weight = layer.weight.clone()
        layer.prepack()
        assert torch.equal(layer.weight, weight)  # no kernel: the plain layout and F.linear


@needs_kernel
def test_engine_packs_its_weights_and_scores_like_the_plain_model(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    model = llm.engine.model
    assert model.model.layers[0].mlp.down_proj.weight.dim() == 3
    assert model.model.embed_tokens.weight.dim() == 2  # lookups stay dense
    plain, _ = load_model(tiny_model_dir)  # what calibration uses: never packed
    assert plain.model.layers[0].mlp.down_proj.weight.dim() == 2
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7])
    with torch.inference_mode():
        expected = plain.compute_logits(plain(ids, torch.arange(len(ids))))
        got = model.compute_logits(model(ids, torch.arange(len(ids))))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
