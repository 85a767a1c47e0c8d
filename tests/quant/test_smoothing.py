"""AWQ, SmoothQuant and scale folding: the function is preserved and the quantization error drops."""

import pytest
import torch
import torch.nn.functional as F

from quant.awq import awq_search_scales
from quant.int_quant import fake_quantize_int
from quant.smoothing import fold_smoothing_scales
from quant.smoothquant import smoothquant_scales


def salient_inputs(n=256, cols=128, seed=0):
    """Activations where a few channels are 20-50x larger than the rest (AWQ's premise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g)
    x[:, :4] *= torch.tensor([20.0, 30.0, 40.0, 50.0])
    return x


def rms_norm(h, weight):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def test_fold_preserves_norm_then_linears():
    g = torch.Generator().manual_seed(0)
    h, norm_w = torch.randn(5, 32, generator=g), torch.rand(32, generator=g) + 0.5
    ws = [torch.randn(8, 32, generator=g), torch.randn(16, 32, generator=g)]
    s = torch.rand(32, generator=g) * 4 + 0.1
    new_ws, new_norm, _ = fold_smoothing_scales(s, balance_weights=ws, smooth_weight=norm_w)
    for w, nw in zip(ws, new_ws, strict=True):
        torch.testing.assert_close(F.linear(rms_norm(h, new_norm), nw), F.linear(rms_norm(h, norm_w), w),
                                   rtol=1e-4, atol=1e-4)


def test_fold_preserves_linear_then_linear_with_bias():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 24, generator=g)
    prev_w, prev_b, w = torch.randn(32, 24, generator=g), torch.randn(32, generator=g), torch.randn(8, 32, generator=g)
    s = torch.rand(32, generator=g) + 0.2
    (new_w,), new_prev, new_b = fold_smoothing_scales(s, balance_weights=[w], smooth_weight=prev_w, smooth_bias=prev_b)
    torch.testing.assert_close(F.linear(F.linear(x, new_prev, new_b), new_w), F.linear(F.linear(x, prev_w, prev_b), w),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="positive"):
        fold_smoothing_scales(-s, balance_weights=[w], smooth_weight=prev_w)


def test_awq_beats_rtn_on_salient_channels():
    x = salient_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    res = awq_search_scales(w, x[:128], num_bits=4, group_size=32, act_mean_abs=x.abs().mean(0))
    assert res.alpha > 0 and res.loss < 0.8 * res.rtn_loss
    assert res.scales.shape == (128,) and (res.scales > 0).all()
    torch.testing.assert_close(res.scales.max() * res.scales.min(), torch.tensor(1.0))
    # Folded into the weights, the scales lower the error on held-out inputs too.
    held_out = x[128:]
    w_rtn = fake_quantize_int(w, 4, group_size=32, symmetric=True)
    w_awq = fake_quantize_int(w * res.scales, 4, group_size=32, symmetric=True)
    err_rtn = (held_out @ (w_rtn - w).t()).norm()
    err_awq = ((held_out / res.scales) @ w_awq.t() - held_out @ w.t()).norm()
    assert err_awq < err_rtn


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_awq_for_fp4_beats_round_to_nearest_on_salient_channels(kind):
    """The same search with FP4 weights (E2M1 groups; NVFP4's global scale from the scaled
    weight): its α = 0 loss is round to nearest's, and scaling salient channels lowers it."""
    from quant import fp4

    x = salient_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    scaling = fp4.SCALINGS[kind]
    res = awq_search_scales(w, x[:128], num_bits=4, group_size=scaling.group_size, act_mean_abs=x.abs().mean(0),
                            fp4_scaling=scaling)
    rtn = fp4.fake_quantize(w, scaling.of(w))
    assert res.rtn_loss == pytest.approx((x[:128] @ (rtn - w).t()).pow(2).mean().item(), rel=1e-5)
    assert res.alpha > 0 and res.loss < 0.9 * res.rtn_loss


def test_awq_never_worse_than_rtn_on_flat_inputs():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    res = awq_search_scales(torch.randn(16, 64), x, num_bits=4, group_size=None, symmetric=False, n_grid=4)
    assert res.loss <= res.rtn_loss


def test_smoothquant_flattens_activation_outliers():
    x = salient_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    s = smoothquant_scales(x.abs().amax(0), [w], alpha=0.5)
    smoothed = x / s
    spread = lambda t: (t.abs().amax(0).max() / t.abs().amax(0).min()).item()  # noqa: E731
    assert spread(smoothed) < spread(x) / 4
    torch.testing.assert_close((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-4, atol=1e-4)

    def w8a8(inputs, weights):  # per-token int8 activations, per-channel int8 weights
        return fake_quantize_int(inputs, 8, group_size=None, symmetric=True) @ \
            fake_quantize_int(weights, 8, group_size=None, symmetric=True).t()

    exact = x @ w.t()
    assert (w8a8(x / s, w * s) - exact).norm() < (w8a8(x, w) - exact).norm()
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_scales(x.abs().amax(0), [w], alpha=1.5)
