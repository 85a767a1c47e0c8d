"""The serving engine's CPU weight layout (oneDNN-blocked) computes the same Linear."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM
from engine.layers.linear import DenseLinear, prepack_cpu_weight
from engine.loader import load_model

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_mkldnn
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), in_features=st.sampled_from([8, 64, 96]), sizes=st.lists(st.integers(1, 48), min_size=1,
       max_size=3), bias=st.booleans(), seed=st.integers(0, 100))
def test_packed_linear_equals_plain(rows, in_features, sizes, bias, seed):
    g = torch.Generator().manual_seed(seed)
    layer = DenseLinear(in_features, sizes, bias, torch.float32)
    for i, n in enumerate(sizes):
        tensors = {"weight": torch.randn(n, in_features, generator=g)}
        if bias:
            tensors["bias"] = torch.randn(n, generator=g)
        layer.load_shard(i, tensors)
    layer.finalize()
    weight, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    x = torch.randn(rows, in_features, generator=g)
    layer.prepack()
    assert layer.weight.is_mkldnn
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_only_cpu_fp32_weights_are_packed():
    assert prepack_cpu_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    if torch.cuda.is_available():
        assert prepack_cpu_weight(torch.randn(8, 8, device="cuda")) is None


@needs_mkldnn
def test_engine_packs_its_weights_and_scores_like_the_plain_model(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    model = llm.engine.model
    assert model.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert model.packed_embedding is not None and not model.model.embed_tokens.weight.is_mkldnn  # lookups stay dense
    plain, _ = load_model(tiny_model_dir)  # what calibration uses: never packed
    assert not plain.model.layers[0].mlp.down_proj.weight.is_mkldnn
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7])
    with torch.inference_mode():
        expected = plain.compute_logits(plain(ids, torch.arange(len(ids))))
        got = model.compute_logits(model(ids, torch.arange(len(ids))))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
