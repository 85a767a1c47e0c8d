"""Fold per-input-channel smoothing scales into a layer pair without changing what it computes.

AWQ and SmoothQuant both rescale a Linear's input channels: the balance Linears' columns are
multiplied by s and the op that produces their input (an RMSNorm weight or a previous Linear's
output rows) is divided by s, so ``W·x == (W·s)·(x/s)``.
"""

from __future__ import annotations

import torch


def fold_smoothing_scales(
    scales: torch.Tensor,
    *,
    balance_weights: list[torch.Tensor],
    smooth_weight: torch.Tensor,
    smooth_bias: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """Return (balance weights · s, smooth weight / s, smooth bias / s), computed in fp32, dtypes kept.

    scales: [in]. balance_weights: each [out_i, in] (e.g. q/k/v or gate/up). smooth_weight: an
    RMSNorm weight [in] or the previous Linear's weight [in, prev_in] (its output rows are our
    input channels). For ``v_proj → o_proj`` under GQA the caller must pass scales that are equal
    across the query heads sharing one KV head, since they are folded into v_proj's rows.
    """
    s = scales.float()
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError("smoothing scales must be finite and positive")
    for w in balance_weights:
        if w.shape[-1] != s.numel():
            raise ValueError(f"balance weight {tuple(w.shape)} does not have {s.numel()} input columns")
    if smooth_weight.shape[0] != s.numel():
        raise ValueError(f"smooth weight {tuple(smooth_weight.shape)} does not produce {s.numel()} channels")
    balanced = [(w.float() * s).to(w.dtype) for w in balance_weights]
    per_row = s if smooth_weight.dim() == 1 else s.unsqueeze(1)
    smoothed = (smooth_weight.float() / per_row).to(smooth_weight.dtype)
    bias = None if smooth_bias is None else (smooth_bias.float() / s).to(smooth_bias.dtype)
    return balanced, smoothed, bias
