"""GPTQ: equals RTN when inputs are uncorrelated, beats RTN on correlated inputs, and its output loads."""

import pytest
import torch

from quant.checkpoint import quantize_weight
from quant.gptq import accumulate_hessian, gptq_quantize
from quant.int_quant import compute_qparams, dequantize_int, quantize_int
from quant.linear import make_quantized_linear
from quant.schemes import QuantArgs, QuantScheme


def correlated_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few dominant, correlated directions (as real hidden states have)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, cols, generator=g)
    scales = torch.rand(cols, generator=g) * 4 + 0.1  # uneven channel magnitudes
    return (torch.randn(n, 8, generator=g) @ basis + 0.3 * torch.randn(n, cols, generator=g)) * scales


def output_error(x, w, w_hat) -> float:
    return ((x @ (w - w_hat).t()).norm() / (x @ w.t()).norm()).item()


def test_identity_hessian_reduces_to_rtn():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    res = gptq_quantize(w, torch.eye(64), num_bits=4, group_size=16)
    scale, _ = compute_qparams(w, 4, group_size=16, symmetric=True)
    assert torch.equal(res.q, quantize_int(w, scale, None, 4, group_size=16))
    assert res.g_idx is None and res.zero_point is None


@pytest.mark.parametrize("bits,group,sym,actorder", [
    (4, 32, True, None), (4, 32, False, None), (4, 32, True, "weight"), (4, 32, True, "group"),
    (8, None, True, None), (4, None, True, "weight"),
])
def test_gptq_beats_rtn_on_correlated_inputs(bits, group, sym, actorder):
    x = correlated_inputs(512, 128)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    h = accumulate_hessian(accumulate_hessian(None, x[:256]), x[256:].reshape(4, 64, 128))
    torch.testing.assert_close(h, 2 * x.t() @ x, rtol=1e-4, atol=1e-2)
    res = gptq_quantize(w, h, num_bits=bits, group_size=group, symmetric=sym, actorder=actorder, block_size=32)
    w_gptq = dequantize_int(res.q, res.scale, res.zero_point, group_size=group, g_idx=res.g_idx)
    scale, zp = compute_qparams(w, bits, group_size=group, symmetric=sym)
    w_rtn = dequantize_int(quantize_int(w, scale, zp, bits, group_size=group), scale, zp, group_size=group)
    assert output_error(x, w, w_gptq) < 0.8 * output_error(x, w, w_rtn)
    assert (res.g_idx is not None) == (actorder == "group")


def test_actorder_group_output_loads_into_the_linear_module():
    x = correlated_inputs(256, 64)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    res = gptq_quantize(w, x.t() @ x, num_bits=4, group_size=16, actorder="group", scale_dtype=torch.bfloat16)
    assert sorted(torch.bincount(res.g_idx.long()).tolist()) == [16] * 4  # every group still has 16 columns
    scheme = QuantScheme(QuantArgs(num_bits=4, strategy="group", group_size=16, actorder="group"), None,
                         "pack-quantized")
    tensors = quantize_weight(w, scheme, q=res.q, scale=res.scale, g_idx=res.g_idx)
    assert tensors["weight_g_idx"].dtype == torch.int32 and tensors["weight_scale"].dtype == torch.bfloat16
    module = make_quantized_linear(scheme, 64, [32], bias=False, dtype=torch.float32)
    module.load_shard(0, tensors)
    module.finalize()
    expected = dequantize_int(res.q, res.scale, None, group_size=16, g_idx=res.g_idx)
    torch.testing.assert_close(module.dequantized_weight(), expected)


def test_dead_columns_are_zeroed_and_shapes_checked():
    x = correlated_inputs(128, 32)
    x[:, 5] = 0
    w = torch.randn(8, 32)
    res = gptq_quantize(w, x.t() @ x, num_bits=8, group_size=None)
    assert (res.q[:, 5] == 0).all()
    with pytest.raises(ValueError, match="hessian shape"):
        gptq_quantize(w, torch.eye(16), num_bits=4, group_size=None)
    with pytest.raises(ValueError, match="positive definite"):
        gptq_quantize(w, torch.full((32, 32), float("nan")), num_bits=4, group_size=None)


def test_group_scales_come_from_the_error_updated_weights():
    """Without act-order a group's scale is taken when the solve reaches it: the first group sees
    the original weights, later groups the weights error feedback moved (so nothing is clipped)."""
    x = correlated_inputs(512, 64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    res = gptq_quantize(w, x.t() @ x, num_bits=4, group_size=16, block_size=32)
    original, _ = compute_qparams(w, 4, group_size=16, symmetric=True)
    torch.testing.assert_close(res.scale[:, 0], original[:, 0])
    assert not torch.allclose(res.scale[:, 1:], original[:, 1:])
    torch.testing.assert_close(dequantize_int(res.q, res.scale, None, group_size=16),
                               res.q.float() * res.scale.repeat_interleave(16, dim=1))


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_fp4_gptq_beats_round_to_nearest_and_identity_h_reduces_to_it(scheme):
    """FP4 codes under group scales taken as the solve reaches each group (NVFP4: FP8 under one
    global scale; MXFP4: powers of two): with H = I it is round to nearest; on correlated inputs its
    output error is well below it; its codes and scales load into the FP4 Linear and dequantize to
    what was solved."""
    from quant import fp4
    from quant.schemes import preset

    x = correlated_inputs(512, 128)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    scaling = fp4.SCALINGS[preset(scheme).weights.fp4_kind].of(w)
    g = scaling.group_size
    rtn_scales = scaling.group_scales(w)
    rtn = fp4.dequantize(fp4.pack(fp4.quantize(w, scaling, rtn_scales)), scaling, rtn_scales)
    same = gptq_quantize(w, torch.eye(128), num_bits=4, group_size=g, fp4_scaling=scaling)
    assert torch.equal(same.q, fp4.quantize(w, scaling, rtn_scales)) and torch.equal(same.scale, rtn_scales)
    res = gptq_quantize(w, x.t() @ x, num_bits=4, group_size=g, fp4_scaling=scaling, block_size=32)
    solved = fp4.dequantize(fp4.pack(res.q), scaling, res.scale)
    assert output_error(x, w, solved) < 0.8 * output_error(x, w, rtn)
    global_ = {"global_scale": scaling.global_scale} if scheme == "nvfp4a16" else {}
    tensors = quantize_weight(w, preset(scheme), q=res.q, scale=res.scale, **global_)
    module = make_quantized_linear(preset(scheme), 128, [48], bias=False, dtype=torch.float32)
    module.load_shard(0, tensors)
    module.finalize()
    assert torch.equal(module.dequantized_weight(), solved)
    with pytest.raises(ValueError, match=f"{scaling.name} GPTQ takes symmetric groups of {g}"):
        gptq_quantize(w, x.t() @ x, num_bits=4, group_size=64, fp4_scaling=scaling)
