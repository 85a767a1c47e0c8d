"""The router's output-length prediction: an upper bound learned from finished requests."""

from __future__ import annotations

import pytest

from engine.cluster.index import InFlight
from engine.cluster.lengths import OutputLengths


def test_budgets_are_planned_in_full_until_their_class_has_enough_finishes():
    lengths = OutputLengths(window=16, min_samples=4)
    for _ in range(3):
        lengths.observe(2048, 300)
    assert lengths.predict(2048) == 2048
    lengths.observe(2048, 450)
    assert lengths.predict(2048) == 450  # a generous fixed budget: planned at the longest recent output
    assert lengths.predict(64) == 64  # another size class has learned nothing


def test_requests_that_run_to_their_budget_stay_planned_at_it():
    lengths = OutputLengths(window=16, min_samples=4)
    for budget in (300, 400, 500, 260):  # ignore_eos benchmarks: every output is its max_tokens
        lengths.observe(budget, budget)
    assert [lengths.predict(b) for b in (256, 311, 511)] == [256, 311, 511]


def test_budgets_that_vary_within_a_class_are_planned_at_no_less_than_the_longest_output():
    lengths = OutputLengths(window=16, min_samples=2)
    lengths.observe(7000, 700)  # share 0.1
    lengths.observe(4200, 630)  # share 0.15: the largest
    assert lengths.predict(4100) == 700  # longest output beats 0.15 × 4100 = 615
    assert lengths.predict(8000) == 1200  # the share beats the longest output: 0.15 × 8000
    assert lengths.predict(4096) == 700


def test_the_window_forgets_old_records_and_outputs_never_exceed_the_budget():
    lengths = OutputLengths(window=3, min_samples=1)
    lengths.observe(100, 500)  # reported past its budget (n > 1 completions): counted at the budget
    assert lengths.predict(100) == 100
    for _ in range(3):
        lengths.observe(100, 10)
    assert lengths.predict(100) == 10  # the 100-token record has left the window


def test_a_request_that_outlives_its_plan_falls_back_to_its_budget():
    entry = InFlight(prefix=[], num_tail_tokens=16, max_tokens=1000, num_prefill_tokens=16, num_predicted_tokens=200)
    entry.num_output_tokens = 150
    assert entry.remaining == 50
    entry.num_output_tokens = 200
    assert entry.remaining == 0  # expected to stop now
    entry.num_output_tokens = 201
    assert entry.remaining == 799


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_samples"):
        OutputLengths(window=4, min_samples=5)
