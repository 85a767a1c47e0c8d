"""SmoothQuant: move activation outliers into the weights before W8A8 quantization.

s_j = max|X_j|^α / max|W_j|^(1−α) flattens per-channel activation ranges so per-token int8
activations lose less; fold s with ``quant.smoothing.fold_smoothing_scales``.
"""

from __future__ import annotations

import torch

_FLOOR = 1e-5


def smoothquant_scales(act_absmax: torch.Tensor, balance_weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """Per-input-channel scales [in] from activation maxima [in] and the Linears reading them ([out_i, in])."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    w_absmax = torch.stack([w.detach().abs().float().amax(0) for w in balance_weights]).amax(0)  # [in]
    a = act_absmax.float().clamp(min=_FLOOR)
    return (a.pow(alpha) / w_absmax.clamp(min=_FLOOR).pow(1 - alpha)).clamp(min=_FLOOR)
