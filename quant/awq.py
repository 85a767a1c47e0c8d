"""AWQ scale search: protect the input channels that carry large activations before rounding.

For α on a grid in [0, 1], scale input channels by s = |x|^α (normalised to geometric mean 1),
fake-quantize W·s, and keep the α whose output on sample inputs, (x/s)·Q(W·s)ᵀ, is closest to
x·Wᵀ. α = 0 is plain RTN, so the search never does worse than RTN on the samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant import fp4
from quant.int_quant import fake_quantize_int


@dataclass(frozen=True)
class AWQResult:
    """The chosen per-input-channel scales; fold them with ``quant.smoothing.fold_smoothing_scales``."""

    scales: torch.Tensor  # [in] fp32
    alpha: float
    loss: float  # output MSE with the chosen scales
    rtn_loss: float  # output MSE without scaling (α = 0)


def awq_search_scales(
    weight: torch.Tensor,
    x: torch.Tensor,
    *,
    num_bits: int,
    group_size: int | None,
    symmetric: bool = True,
    act_mean_abs: torch.Tensor | None = None,
    n_grid: int = 20,
    fp4_scaling: type[fp4.Nvfp4] | type[fp4.Mxfp4] | None = None,
) -> AWQResult:
    """Search AWQ scales for the Linears that share input ``x``.

    weight: [out, in] (fused balance layers concatenated along out, e.g. q/k/v); x: [n, in]
    sample inputs; act_mean_abs: [in] mean |activation| per channel over the whole calibration
    set (defaults to the samples'). ``fp4_scaling``: the weights are FP4 in that scaling
    (quant/fp4.py: E2M1 groups; NVFP4's global scale taken from the scaled weight), not integers.
    """
    w = weight.detach().float()
    x2d = x.detach().reshape(-1, w.shape[1]).float()
    mag = (x2d.abs().mean(0) if act_mean_abs is None else act_mean_abs.float()).clamp(min=1e-4)  # [in]
    target = x2d @ w.t()  # [n, out]
    best: tuple[float, float, torch.Tensor] | None = None
    rtn_loss = float("nan")
    for alpha in torch.linspace(0, 1, n_grid + 1).tolist():
        s = mag.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        scaled = w * s
        if fp4_scaling is not None:  # the groups along each row are what fake_quantize rounds activations by, too
            w_q = fp4.fake_quantize(scaled, fp4_scaling.of(scaled))
        else:
            w_q = fake_quantize_int(scaled, num_bits, group_size=group_size, symmetric=symmetric)
        loss = ((x2d / s) @ w_q.t() - target).pow(2).mean().item()
        if alpha == 0:
            rtn_loss = loss
        if best is None or loss < best[0]:
            best = (loss, alpha, s)
    loss, alpha, scales = best
    return AWQResult(scales=scales, alpha=alpha, loss=loss, rtn_loss=rtn_loss)
