"""Paired statistics checked against scipy, published worked examples and simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from evals.stats import (
    PairedTable,
    block_bootstrap_interval,
    chance_threshold,
    holm_adjust,
    items_needed,
    mcnemar_exact_p,
    mcnemar_one_sided_drop_p,
    min_detectable_drop,
    newcombe_paired_interval,
    paired_bootstrap_interval,
    wilson_interval,
    z_quantile,
)


def test_table_from_outcomes_counts_each_cell():
    base = [1, 1, 1, 0, 0, 1, 0]
    cand = [1, 0, 1, 1, 0, 0, 0]
    t = PairedTable.from_outcomes(base, cand)
    assert (t.num_both_right, t.num_right_to_wrong, t.num_wrong_to_right, t.num_both_wrong) == (2, 2, 1, 2)
    assert t.num_items == 7
    assert t.delta == pytest.approx(-1 / 7)
    assert t.flip_rate == pytest.approx(3 / 7)
    assert t.candidate_accuracy - t.baseline_accuracy == pytest.approx(t.delta)


def test_table_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="equal length"):
        PairedTable.from_outcomes([1, 0], [1])


@pytest.mark.parametrize(
    ("b", "c", "expected"),
    [
        (0, 0, 1.0),
        (5, 5, 1.0),
        (0, 5, 2 / 32),  # both tails of binomial(5, 1/2) at the extremes: 2 * 1/32
        (1, 9, 2 * (1 + 10) / 1024),  # 2 * P(X <= 1), X ~ binomial(10, 1/2)
        (6, 16, 0.052478790283203125),
    ],
)
def test_mcnemar_exact_hand_computed(b, c, expected):
    assert mcnemar_exact_p(b, c) == pytest.approx(expected, rel=1e-12)


@given(st.integers(0, 300), st.integers(0, 300))
def test_mcnemar_exact_matches_scipy_binomtest(b, c):
    if b + c == 0:
        assert mcnemar_exact_p(b, c) == 1.0
        return
    expected = sps.binomtest(b, b + c, 0.5).pvalue
    assert mcnemar_exact_p(b, c) == pytest.approx(expected, rel=1e-9, abs=1e-300)
    one_sided = sps.binomtest(b, b + c, 0.5, alternative="greater").pvalue
    assert mcnemar_one_sided_drop_p(b, c) == pytest.approx(one_sided, rel=1e-9, abs=1e-300)


def test_mcnemar_stays_exact_for_tiny_p():
    # 0 vs 2000 discordant pairs: p = 2 / 2**2000, far below float underflow of naive products.
    assert mcnemar_exact_p(0, 1074) > 0.0
    assert mcnemar_exact_p(0, 1000) == pytest.approx(2.0 / 2**1000, rel=1e-12)


def test_wilson_matches_scipy():
    lo, hi = wilson_interval(37, 120)
    ref = sps.binomtest(37, 120).proportion_ci(confidence_level=0.95, method="wilson")
    assert (lo, hi) == pytest.approx((ref.low, ref.high), rel=1e-9)


def test_newcombe_published_example():
    # Cavo et al. 2012 paired table as worked in Fagerland, Lydersen & Laake, ch. 8:
    # estimate -0.0621 (95% CI -0.1186 to -0.0046) for row minus column; our delta is
    # column minus row, so the interval is mirrored.
    t = PairedTable(num_both_right=59, num_right_to_wrong=6, num_wrong_to_right=16, num_both_wrong=80)
    lo, hi = newcombe_paired_interval(t)
    assert t.delta == pytest.approx(0.0621, abs=5e-5)
    assert lo == pytest.approx(0.0046, abs=5e-5)
    assert hi == pytest.approx(0.1186, abs=5e-5)


def test_newcombe_keeps_width_with_no_flips():
    # a normal approximation says [0, 0] here; a 50-item set cannot prove that nothing changed
    t = PairedTable(30, 0, 0, 20)
    lo, hi = newcombe_paired_interval(t)
    assert lo < -0.03 and hi > 0.03


def test_bootstrap_is_seeded_and_brackets_delta():
    rng = np.random.default_rng(3)
    base = rng.random(500) < 0.6
    cand = np.where(rng.random(500) < 0.1, ~base, base)
    first = paired_bootstrap_interval(base, cand, seed=7)
    assert first == paired_bootstrap_interval(base, cand, seed=7)
    delta = cand.mean() - base.mean()
    assert first[0] < delta < first[1]


def normal_interval(differences: np.ndarray) -> tuple[float, float]:
    """The textbook 95% interval for a mean, the bootstrap's large-sample limit."""
    half = 1.959964 * differences.std(ddof=1) / math.sqrt(differences.size)
    return differences.mean() - half, differences.mean() + half


def test_bootstrap_agrees_with_clt_on_a_large_sample():
    rng = np.random.default_rng(4)
    base = (rng.random(4000) < 0.55).astype(float)
    cand = np.where(rng.random(4000) < 0.08, 1 - base, base)
    boot = paired_bootstrap_interval(base, cand, num_resamples=4000, seed=0)
    clt = normal_interval(cand - base)
    assert boot == pytest.approx(clt, abs=0.002)


def test_bootstrap_continuous_scores_use_index_resampling():
    rng = np.random.default_rng(5)
    base = rng.normal(size=300)
    cand = base + rng.normal(0.1, 0.2, size=300)
    lo, hi = paired_bootstrap_interval(base, cand, num_resamples=1000, seed=0)
    clt = normal_interval(cand - base)
    assert lo == pytest.approx(clt[0], abs=0.01) and hi == pytest.approx(clt[1], abs=0.01)


def test_bootstrap_and_newcombe_coverage_on_simulated_pairs():
    """Over many simulated paired runs with a known true delta, 95% intervals cover it ~95% of the time."""
    rng = np.random.default_rng(2024)
    # Cell probabilities (both right, right->wrong, wrong->right, both wrong): true delta = -0.02.
    probs = np.array([0.55, 0.05, 0.03, 0.37])
    true_delta = probs[2] - probs[1]
    num_trials, n = 400, 600
    covered_boot = covered_newcombe = 0
    for trial in range(num_trials):
        cells = rng.choice(4, size=n, p=probs)
        base = (cells == 0) | (cells == 1)
        cand = (cells == 0) | (cells == 2)
        lo, hi = paired_bootstrap_interval(base, cand, num_resamples=500, seed=trial)
        covered_boot += lo <= true_delta <= hi
        lo, hi = newcombe_paired_interval(PairedTable.from_outcomes(base, cand))
        covered_newcombe += lo <= true_delta <= hi
    # Binomial sd of the coverage estimate at 0.95 over 400 trials is ~0.011.
    assert 0.92 <= covered_boot / num_trials <= 0.98
    assert 0.92 <= covered_newcombe / num_trials <= 0.985


def test_min_detectable_drop_reproduces_reference_table():
    # Reference table (gating-evals.md section 3): GSM8K n=1319 -> 1.2 / 1.9 pts at 3% / 8% flips,
    # HellaSwag n=10042 -> 0.43 / 0.7 pts.
    assert min_detectable_drop(1319, 0.03) == pytest.approx(0.012, abs=5e-4)
    assert min_detectable_drop(1319, 0.08) == pytest.approx(0.019, abs=5e-4)
    assert min_detectable_drop(10042, 0.03) == pytest.approx(0.0043, abs=5e-5)
    assert items_needed(0.01, 0.05) == pytest.approx(3085, abs=1)
    assert items_needed(0.02, 0.10) == pytest.approx(1539, abs=1)


def test_items_needed_for_non_inferiority_gives_the_stated_power():
    """With the planned items, a one-sided 95% bound on the drop falls under the margin in 80% of
    paired runs whose true drop is `drop` (Monte Carlo over multinomial flip tables)."""
    drop, flips, margin = 0.01, 0.08, 0.03
    n = items_needed(drop, flips, margin=margin)
    assert n == items_needed(drop, flips, margin=margin, alpha=0.05, power=0.8) > items_needed(drop, flips, margin=0.04)
    rng = np.random.default_rng(0)
    r2w, w2r, _ = rng.multinomial(n, [(flips + drop) / 2, (flips - drop) / 2, 1 - flips], size=4000).T
    observed, flip_rate = (r2w - w2r) / n, (r2w + w2r) / n
    upper = observed + z_quantile(0.95) * np.sqrt((flip_rate - observed**2) / n)
    assert np.mean(upper < margin) == pytest.approx(0.8, abs=0.03)
    with pytest.raises(ValueError, match="cannot be told"):
        items_needed(0.03, 0.1, margin=0.03)


def test_min_detectable_drop_inverts_items_needed():
    drop = min_detectable_drop(2376, 0.05)
    assert items_needed(drop, 0.05) == pytest.approx(2376, abs=1)


def test_chance_threshold():
    assert chance_threshold(100, 0.25) == pytest.approx(0.25 + 2 * math.sqrt(0.25 * 0.75 / 100))
    assert chance_threshold(10000, 0.5) == pytest.approx(0.51)


def test_holm_adjust_known_values():
    assert holm_adjust([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjust([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_block_bootstrap_resamples_whole_blocks_and_brackets_the_statistic():
    rng = np.random.default_rng(6)
    blocks = [rng.normal(loc, 0.1, size=64) for loc in rng.normal(0, 1, size=40)]  # correlated within a block
    whole = np.concatenate(blocks)
    low, high = block_bootstrap_interval([blocks], np.mean, seed=1)
    assert (low, high) == block_bootstrap_interval([blocks], np.mean, seed=1)
    assert low < whole.mean() < high
    # resampling tokens as if independent would understate the spread 8x (sd ratio ~ sqrt(64 * 1 / 1.01))
    by_token = block_bootstrap_interval([[np.array([v]) for v in whole]], np.mean, seed=1)
    assert high - low > 5 * (by_token[1] - by_token[0])
    assert block_bootstrap_interval([[np.full(64, 0.25)] * 3], np.mean) == (0.25, 0.25)


def test_block_bootstrap_resamples_groups_independently_for_a_two_group_statistic():
    rng = np.random.default_rng(7)
    first = [rng.exponential(1.0, 64) for _ in range(30)]
    last = [rng.exponential(2.0, 64) for _ in range(30)]
    low, high = block_bootstrap_interval([first, last], lambda a, b: b.mean() / a.mean())
    assert low < np.concatenate(last).mean() / np.concatenate(first).mean() < high
    assert 1.5 < low and high < 2.6
    with pytest.raises(ValueError, match="at least one block"):
        block_bootstrap_interval([first, []], lambda a, b: 0.0)
