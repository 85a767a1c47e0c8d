"""Statistics gathered over the whole calibration set, one ``update`` per forward call.

Each observer folds every call into its state immediately, so a statistic is over all tokens
of all samples no matter how the pipeline batches them. That is the point of writing our own:
the observers of the reference tools keep the last batch or an EMA for static scales.
"""

from __future__ import annotations

import torch


def _check_finite(stat: torch.Tensor, what: str) -> None:
    if not torch.isfinite(stat).all():
        raise ValueError(f"non-finite values in the {what} seen during calibration")


class AbsMaxObserver:
    """Running max of |x| over every token, kept per channel along ``channel_dim``.

    For Linear inputs ``[..., in_features]`` the channel is the last dim (per input channel);
    for K/V ``[num_tokens, num_kv_heads, head_dim]`` it is dim 1 (per KV head).
    """

    def __init__(self, channel_dim: int = -1):
        self.channel_dim = channel_dim
        self.per_channel: torch.Tensor | None = None  # [num_channels] fp32

    def update(self, x: torch.Tensor) -> None:
        dim = self.channel_dim % x.dim()
        reduce_dims = [d for d in range(x.dim()) if d != dim]
        current = x.detach().abs().amax(dim=reduce_dims).float() if reduce_dims else x.detach().abs().float()
        _check_finite(current, "absmax input")
        self.per_channel = current if self.per_channel is None else torch.maximum(self.per_channel, current)

    @property
    def per_tensor(self) -> torch.Tensor:
        """Scalar fp32 max over every channel."""
        if self.per_channel is None:
            raise RuntimeError("observer saw no data")
        return self.per_channel.max()


class HessianObserver:
    """Accumulates ``H = XᵀX / num_tokens`` over all tokens for GPTQ (``X`` is ``[num_tokens, in_features]``).

    The sum is kept in ``dtype`` (fp32 by default, fp64 when many tokens make fp32 sums drift)
    and divided only when read, so the result does not depend on how calls were split.
    """

    def __init__(self, in_features: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.in_features = in_features
        self._sum = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.num_tokens = 0

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, self.in_features).to(self._sum.dtype)  # [T, in]
        self._sum.addmm_(rows.T, rows)
        self.num_tokens += rows.shape[0]

    def rescale_inputs(self, scales: torch.Tensor) -> None:
        """The Hessian of ``X / scales`` (per input channel), after smoothing divided the input by them."""
        inverse = 1.0 / scales.to(self._sum)
        self._sum.mul_(inverse.unsqueeze(1) * inverse.unsqueeze(0))

    @property
    def hessian(self) -> torch.Tensor:
        """``[in_features, in_features]`` in the accumulation dtype."""
        if self.num_tokens == 0:
            raise RuntimeError("observer saw no data")
        hessian = self._sum / self.num_tokens
        _check_finite(hessian, "Hessian")
        return hessian


class MeanAbsObserver:
    """Mean |x| per input channel over all tokens: AWQ's activation-salience statistic."""

    def __init__(self, in_features: int):
        self.in_features = in_features
        self._sum = torch.zeros(in_features, dtype=torch.float64)
        self.num_tokens = 0

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, self.in_features)
        self._sum += rows.abs().sum(dim=0, dtype=torch.float64).cpu()
        self.num_tokens += rows.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        """``[in_features]`` fp32."""
        if self.num_tokens == 0:
            raise RuntimeError("observer saw no data")
        mean = (self._sum / self.num_tokens).float()
        _check_finite(mean, "activation mean")
        return mean


class TokenSampleObserver:
    """Keeps up to ``max_tokens`` input rows, spread evenly over the samples, for searches that
    need real activations (AWQ's scale grid) without holding every token of the set."""

    def __init__(self, in_features: int, *, max_tokens: int, num_calls: int):
        self.in_features = in_features
        self._per_call = max(1, -(-max_tokens // max(1, num_calls)))  # ceil: every sample contributes
        self.max_tokens = max_tokens
        self._rows: list[torch.Tensor] = []
        self.num_kept = 0

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, self.in_features)
        take = min(self._per_call, self.max_tokens - self.num_kept, rows.shape[0])
        if take <= 0:
            return
        # evenly strided rows, so a sample's late positions (long context) are represented too
        index = torch.linspace(0, rows.shape[0] - 1, take).round().long().to(rows.device)
        self._rows.append(rows[index].float().cpu())
        self.num_kept += take

    @property
    def rows(self) -> torch.Tensor:
        """``[num_kept, in_features]`` fp32."""
        if not self._rows:
            raise RuntimeError("observer saw no data")
        return torch.cat(self._rows)
