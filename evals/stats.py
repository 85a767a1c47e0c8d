"""Paired statistics for comparing a candidate against its baseline on the same items.

Both arms answer identical items, so the gate works on per-item differences: the 2x2
table of (baseline right?, candidate right?) and its discordant cells. Pairing removes the
between-item variance that an unpaired comparison of two accuracies would carry, which is
what lets a few thousand items resolve sub-point drops.

Conventions: delta = candidate - baseline (negative is a drop); accuracies are fractions,
not points; intervals are (low, high) tuples of delta.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()


def two_sided_level(one_sided: float) -> float:
    """The two-sided level whose interval ends are one-sided bounds at `one_sided` (0.95 -> 0.9)."""
    return 1 - 2 * (1 - one_sided)


def z_quantile(probability: float) -> float:
    """Standard normal quantile, e.g. 0.975 -> 1.96."""
    return _NORMAL.inv_cdf(probability)


@dataclass(frozen=True, slots=True)
class PairedTable:
    """The 2x2 table of per-item correctness for baseline and candidate."""

    num_both_right: int
    num_right_to_wrong: int  # baseline right, candidate wrong (the damage)
    num_wrong_to_right: int  # baseline wrong, candidate right
    num_both_wrong: int

    def __post_init__(self) -> None:
        cells = (self.num_both_right, self.num_right_to_wrong, self.num_wrong_to_right, self.num_both_wrong)
        if min(cells) < 0:
            raise ValueError(f"table cells must be non-negative, got {cells}")

    @classmethod
    def from_outcomes(cls, baseline: Sequence[bool], candidate: Sequence[bool]) -> PairedTable:
        """Build the table from per-item correctness of the two arms (same item order)."""
        base = np.asarray(baseline, dtype=bool)
        cand = np.asarray(candidate, dtype=bool)
        if base.shape != cand.shape or base.ndim != 1:
            raise ValueError(f"outcome arrays must be 1-D and equal length, got {base.shape} and {cand.shape}")
        return cls(
            num_both_right=int(np.sum(base & cand)),
            num_right_to_wrong=int(np.sum(base & ~cand)),
            num_wrong_to_right=int(np.sum(~base & cand)),
            num_both_wrong=int(np.sum(~base & ~cand)),
        )

    @property
    def num_items(self) -> int:
        return self.num_both_right + self.num_right_to_wrong + self.num_wrong_to_right + self.num_both_wrong

    @property
    def num_flips(self) -> int:
        return self.num_right_to_wrong + self.num_wrong_to_right

    @property
    def baseline_accuracy(self) -> float:
        return (self.num_both_right + self.num_right_to_wrong) / self.num_items

    @property
    def candidate_accuracy(self) -> float:
        return (self.num_both_right + self.num_wrong_to_right) / self.num_items

    @property
    def delta(self) -> float:
        """Candidate accuracy minus baseline accuracy."""
        return (self.num_wrong_to_right - self.num_right_to_wrong) / self.num_items

    @property
    def flip_rate(self) -> float:
        return self.num_flips / self.num_items


def mcnemar_exact_p(num_right_to_wrong: int, num_wrong_to_right: int) -> float:
    """Two-sided exact McNemar p-value: a binomial(b + c, 1/2) test on the discordant pairs.

    Computed with exact integer arithmetic, so it stays accurate for tiny p-values.
    """
    num_discordant = num_right_to_wrong + num_wrong_to_right
    if num_discordant == 0:
        return 1.0
    smaller = min(num_right_to_wrong, num_wrong_to_right)
    tail = sum(math.comb(num_discordant, k) for k in range(smaller + 1))
    # The binomial(n, 1/2) is symmetric, so the two-sided p doubles one tail (capped at 1
    # when b == c, where both tails overlap in the middle term).
    return min(1.0, 2 * tail / 2**num_discordant)


def mcnemar_one_sided_drop_p(num_right_to_wrong: int, num_wrong_to_right: int) -> float:
    """One-sided exact p-value for "the candidate is worse": P(X >= b), X ~ binomial(b + c, 1/2)."""
    num_discordant = num_right_to_wrong + num_wrong_to_right
    if num_discordant == 0:
        return 1.0
    tail = sum(math.comb(num_discordant, k) for k in range(num_right_to_wrong, num_discordant + 1))
    return tail / 2**num_discordant


def wilson_interval(num_successes: int, num_trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a single binomial proportion."""
    if num_trials <= 0:
        raise ValueError("num_trials must be positive")
    z = z_quantile(0.5 + confidence / 2)
    p = num_successes / num_trials
    denom = 1 + z * z / num_trials
    centre = (p + z * z / (2 * num_trials)) / denom
    half = z * math.sqrt(p * (1 - p) / num_trials + z * z / (4 * num_trials**2)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_paired_interval(table: PairedTable, confidence: float = 0.95) -> tuple[float, float]:
    """Newcombe's score interval (1998, method 10) for the paired delta.

    Why this rather than the CLT: with few or no flips the CLT standard error collapses
    to zero and claims certainty that a small set cannot give; the Wilson-based interval
    keeps a sensible width and never leaves [-1, 1].
    """
    n = table.num_items
    a, b, c, d = (table.num_both_right, table.num_right_to_wrong, table.num_wrong_to_right, table.num_both_wrong)
    p_base, p_cand = (a + b) / n, (a + c) / n
    lo_base, hi_base = wilson_interval(a + b, n, confidence)
    lo_cand, hi_cand = wilson_interval(a + c, n, confidence)
    denom_sq = (a + b) * (c + d) * (a + c) * (b + d)
    # Correlation of the two arms' outcomes; Newcombe shrinks a positive one by n/2
    # (a continuity correction) so the interval does not get too narrow.
    cross = a * d - b * c
    if cross > 0:
        cross = max(0.0, cross - n / 2)
    phi = cross / math.sqrt(denom_sq) if denom_sq > 0 else 0.0
    # Newcombe states the interval for theta = p_base - p_cand; delta is its negative.
    below = math.sqrt(max(0.0, (p_base - lo_base) ** 2 - 2 * phi * (p_base - lo_base) * (hi_cand - p_cand)
                          + (hi_cand - p_cand) ** 2))
    above = math.sqrt(max(0.0, (hi_base - p_base) ** 2 - 2 * phi * (hi_base - p_base) * (p_cand - lo_cand)
                          + (p_cand - lo_cand) ** 2))
    theta = p_base - p_cand
    return -(theta + above), -(theta - below)


def _stratum_ids(strata: Sequence[object] | None, n: int) -> np.ndarray:
    if strata is None:
        return np.zeros(n, dtype=np.int64)
    if len(strata) != n:
        raise ValueError(f"strata has {len(strata)} labels for {n} items")
    _, ids = np.unique(np.asarray([str(s) for s in strata]), return_inverse=True)
    return ids


def paired_bootstrap_interval(
    baseline_scores: Sequence[float],
    candidate_scores: Sequence[float],
    *,
    confidence: float = 0.95,
    num_resamples: int = 2000,
    seed: int = 0,
    strata: Sequence[object] | None = None,
) -> tuple[float, float]:
    """Percentile bootstrap interval for mean(candidate - baseline), resampling items jointly.

    Resampling an item carries both arms' scores together, which is what keeps the pairing.
    With `strata`, items are resampled within each stratum so every task keeps its size.
    """
    base = np.asarray(baseline_scores, dtype=np.float64)
    cand = np.asarray(candidate_scores, dtype=np.float64)
    if base.shape != cand.shape or base.ndim != 1 or base.size < 2:
        raise ValueError("score arrays must be 1-D, equal length, with at least two items")
    diffs = cand - base
    n = diffs.size
    ids = _stratum_ids(strata, n)
    rng = np.random.default_rng(seed)
    totals = np.zeros(num_resamples, dtype=np.float64)
    for s in np.unique(ids):
        part = diffs[ids == s]
        totals += _resampled_sums(part, num_resamples, rng)
    means = totals / n
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def block_bootstrap_interval(
    groups: Sequence[Sequence[np.ndarray]],
    statistic: Callable[..., float],
    *,
    confidence: float = 0.95,
    num_resamples: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(*values)`, resampling each group's blocks.

    Each group is a list of blocks of per-token values (`statistic` gets one concatenated array a
    group). Neighbouring tokens of a text are correlated, so whole blocks, not tokens, are drawn
    with replacement; the groups are resampled independently. The interval says how much the
    figure depends on which text was scored: a threshold inside it is a close call.
    """
    if any(not blocks for blocks in groups):
        raise ValueError("every group needs at least one block")
    rng = np.random.default_rng(seed)
    values = np.empty(num_resamples, dtype=np.float64)
    for r in range(num_resamples):
        values[r] = statistic(*(np.concatenate([blocks[i] for i in rng.integers(0, len(blocks), len(blocks))])
                                for blocks in groups))
    tail = (1 - confidence) / 2
    low, high = np.quantile(values, [tail, 1 - tail], method="nearest")  # no arithmetic on an inf ratio
    return float(low), float(high)


def _resampled_sums(values: np.ndarray, num_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Sums of `num_resamples` with-replacement resamples of `values`.

    Per-item differences usually take a handful of distinct values ({-1, 0, 1} for
    accuracy), and then a multinomial draw over those values is the same distribution as
    resampling indices at a fraction of the cost.
    """
    levels, counts = np.unique(values, return_counts=True)
    if levels.size <= 16:
        draws = rng.multinomial(values.size, counts / values.size, size=num_resamples)  # [R, levels]
        return draws @ levels
    sums = np.empty(num_resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // values.size)
    for start in range(0, num_resamples, chunk):
        stop = min(num_resamples, start + chunk)
        idx = rng.integers(0, values.size, size=(stop - start, values.size))
        sums[start:stop] = values[idx].sum(axis=1)
    return sums


def min_detectable_drop(num_items: int, flip_rate: float, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true drop a paired one-sided test on `num_items` detects with `power`.

    Solves n = (z_alpha + z_power)^2 (f - delta^2) / delta^2 for delta, where f is the
    discordance (flip) rate: delta = z * sqrt(f / (n + z^2)).
    """
    if num_items <= 0:
        raise ValueError("num_items must be positive")
    if not 0.0 <= flip_rate <= 1.0:
        raise ValueError(f"flip_rate must be in [0, 1], got {flip_rate}")
    z = z_quantile(1 - alpha) + z_quantile(power)
    return z * math.sqrt(flip_rate / (num_items + z * z))


def items_needed(drop: float, flip_rate: float, *, margin: float = 0.0, alpha: float = 0.05,
                 power: float = 0.8) -> int:
    """Paired items a one-sided test needs to tell a true `drop` from `margin` with `power`: with
    margin 0, to detect the drop; with a non-inferiority margin above it, to bound it under the
    margin. Each item's difference has variance f - drop^2 (f the flip rate)."""
    if drop == margin:
        raise ValueError("a drop equal to the margin cannot be told from it")
    z = z_quantile(1 - alpha) + z_quantile(power)
    return math.ceil(z * z * (flip_rate - drop * drop) / ((margin - drop) ** 2))


def chance_threshold(num_items: int, chance: float, num_sigma: float = 2.0) -> float:
    """Accuracy a scorer must exceed to be distinguishable from guessing: chance + k sigma.

    A broken scorer (e.g. logprobs missing for the echoed prompt) lands exactly at chance,
    so a task at or below this line cannot be trusted either way.
    """
    if num_items <= 0:
        raise ValueError("num_items must be positive")
    return chance + num_sigma * math.sqrt(chance * (1 - chance) / num_items)


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (same order as given)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
