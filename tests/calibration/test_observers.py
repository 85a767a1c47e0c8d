"""Observers: statistics over the whole set, independent of how the tokens were split into calls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.observers import AbsMaxObserver, HessianObserver, MeanAbsObserver, TokenSampleObserver


def _split(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    cuts = [min(x.shape[0], s) for s in torch.tensor(sizes).cumsum(0).tolist()]
    bounds = [0, *cuts, x.shape[0]]
    return [x[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), sizes=st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_statistics_equal_those_of_the_concatenated_set(seed, sizes):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes) + 3, 8, generator=g) * torch.rand(8, generator=g) * 10
    absmax, hessian, mean_abs = AbsMaxObserver(), HessianObserver(8, dtype=torch.float64), MeanAbsObserver(8)
    for chunk in _split(x, sizes):
        for observer in (absmax, hessian, mean_abs):
            observer.update(chunk)
    torch.testing.assert_close(absmax.per_channel, x.abs().amax(0))
    assert absmax.per_tensor.item() == x.abs().max().item()
    x64 = x.double()
    torch.testing.assert_close(hessian.hessian, x64.T @ x64 / x.shape[0])
    assert hessian.num_tokens == x.shape[0]
    torch.testing.assert_close(mean_abs.mean, x.abs().mean(0))


def test_running_max_keeps_an_early_outlier():
    """The per-batch trap: an outlier in the first call must survive later, calmer calls."""
    observer = AbsMaxObserver()
    observer.update(torch.tensor([[0.1, -50.0], [0.2, 0.3]]))
    for _ in range(5):
        observer.update(torch.full((4, 2), 0.5))
    assert observer.per_channel.tolist() == [0.5, 50.0]
    assert observer.per_tensor.item() == 50.0


def test_kv_absmax_per_head():
    observer = AbsMaxObserver(channel_dim=1)
    k = torch.zeros(3, 2, 4)  # [T, KV, D]
    k[2, 1, 3] = -7.0
    k[0, 0, 1] = 2.0
    observer.update(k)
    observer.update(torch.ones(5, 2, 4))
    assert observer.per_channel.tolist() == [2.0, 7.0]


def test_hessian_is_over_leading_dims_of_any_rank():
    x = torch.randn(2, 5, 4)
    observer = HessianObserver(4)
    observer.update(x)
    flat = x.reshape(-1, 4)
    torch.testing.assert_close(observer.hessian, flat.T @ flat / 10)


def test_non_finite_activations_are_an_error():
    with pytest.raises(ValueError, match="non-finite"):
        AbsMaxObserver().update(torch.tensor([[1.0, float("nan")]]))
    mean_abs = MeanAbsObserver(2)
    mean_abs.update(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="non-finite"):
        _ = mean_abs.mean


def test_token_sample_spreads_over_calls_and_caps():
    observer = TokenSampleObserver(3, max_tokens=10, num_calls=4)
    for i in range(4):
        observer.update(torch.full((20, 3), float(i)))
    rows = observer.rows
    assert rows.shape == (10, 3)
    assert set(rows[:, 0].tolist()) == {0.0, 1.0, 2.0, 3.0}  # every call represented


def test_empty_observer_refuses_to_report():
    with pytest.raises(RuntimeError, match="no data"):
        _ = HessianObserver(2).hessian


def test_hessian_rescaled_for_a_smoothed_input():
    """After smoothing divides the input by s per channel, the solve needs the Hessian of X / s."""
    x = torch.randn(50, 6)
    scales = torch.rand(6) + 0.5
    observer, smoothed = HessianObserver(6), HessianObserver(6)
    observer.update(x)
    smoothed.update(x / scales)
    observer.rescale_inputs(scales)
    torch.testing.assert_close(observer.hessian, smoothed.hessian, rtol=1e-5, atol=1e-6)
