"""FP8 primitives and KV-cache scale handling."""

import math

import pytest
import torch

from quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_scale, quantize_fp8
from quant.kv_cache import dequantize_kv, quantize_kv, validate_kv_scale


def test_quantize_saturates_instead_of_nan():
    x8 = quantize_fp8(torch.tensor([1e6, -1e6, 3.0]), torch.tensor([1.0]))
    assert x8.dtype == FP8_DTYPE
    assert x8.float().tolist() == [FP8_MAX, -FP8_MAX, 3.0]


def test_scale_is_absmax_over_448_per_strategy():
    x = torch.tensor([[1.0, -896.0], [4.48, 0.0]])
    torch.testing.assert_close(fp8_scale(x, "tensor"), torch.tensor([2.0]))
    torch.testing.assert_close(fp8_scale(x, "token"), torch.tensor([[2.0], [0.01]]))
    assert fp8_scale(torch.zeros(2, 2), "channel").min() > 0


def test_round_trip_relative_error_within_e4m3_precision():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    s = fp8_scale(x, "token")
    err = (dequantize_fp8(quantize_fp8(x, s), s) - x).abs()
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normal values.
    assert (err <= x.abs() * 2**-4 + s * 2**-9).all()


def test_kv_round_trip_per_head_scales():
    x = torch.randn(5, 3, 8)  # [tokens, kv_heads, head_dim]
    scale = validate_kv_scale("k_scale", torch.tensor([[[0.01]], [[0.02]], [[0.03]]]), 3)
    assert scale.shape == (3, 1)
    x8 = quantize_kv(x, scale)
    back = dequantize_kv(x8, scale, torch.float32)
    assert back.shape == x.shape
    assert ((back - x).abs() <= x.abs() / 16 + scale * 2**-9).all()


@pytest.mark.parametrize("shape", [(), (1,)])
def test_per_tensor_kv_scale_broadcasts_to_heads(shape):
    s = torch.full(shape, 0.5, dtype=torch.bfloat16)
    assert validate_kv_scale("v_scale", s, 4).tolist() == [[0.5]] * 4


@pytest.mark.parametrize("value,match", [(0.0, "zero or negative"), (-1.0, "zero or negative"),
                                         (math.nan, "non-finite"), (math.inf, "non-finite")])
def test_bad_kv_scales_name_the_tensor(value, match):
    name = "model.layers.3.self_attn.k_scale"
    with pytest.raises(ValueError, match=rf"model\.layers\.3\.self_attn\.k_scale.*{match}"):
        validate_kv_scale(name, torch.tensor([value]), 2)


def test_missing_and_misshapen_kv_scales_are_errors():
    with pytest.raises(ValueError, match="v_scale: missing"):
        validate_kv_scale("v_scale", None, 2)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        validate_kv_scale("v_scale", torch.tensor([0.1, 0.2]), 2)
