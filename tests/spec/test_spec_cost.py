"""PassCost: the online model of a pass's time that adaptive drafting weighs drafts with."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.spec import PassCost


def test_fit_recovers_fixed_and_per_row_time() -> None:
    cost = PassCost()
    for rows in [1, 13, 1, 7, 1, 4, 13, 1]:
        cost.observe(rows, 0.014 + 0.0025 * rows)
    fixed, per_row, premium = cost.fit()
    assert fixed == pytest.approx(0.014) and per_row == pytest.approx(0.0025)
    assert premium == 0.0 and cost.verify_premium(1) == 0.0  # decode passes only
    # batch 1: a decode is 16.5 ms, a draft row 2.5 ms
    assert cost.draft_cost(1) == pytest.approx(0.0025 / 0.0165)
    # batch 64: the fixed part is shared, a draft row costs nearly a decoded token
    assert cost.draft_cost(64) == pytest.approx(0.0025 / (0.014 / 64 + 0.0025))
    assert cost.draft_cost(1) < cost.draft_cost(8) < cost.draft_cost(64)


def test_unfitted_until_two_row_counts_then_clamped() -> None:
    cost = PassCost()
    assert cost.fit() is None and cost.draft_cost(1) == 0.0
    for _ in range(5):
        cost.observe(8, 0.02)  # one row count: the per-row part is unknown
    assert cost.fit() is None and cost.draft_cost(8) == 0.0
    cost.observe(9, 0.001)  # noise that makes the slope negative: no negative cost
    fixed, per_row, _ = cost.fit()
    assert per_row == 0.0 and fixed > 0 and cost.draft_cost(8) == 0.0
    only_rows = PassCost()
    only_rows.observe(1, 0.0)
    only_rows.observe(2, 0.0)
    assert only_rows.draft_cost(1) == 0.0  # nothing measurable: free, not a division by zero
    all_rows = PassCost()
    all_rows.observe(1, 0.0)
    all_rows.observe(10, 0.1)  # a negative intercept: no negative fixed part
    fixed, per_row, _ = all_rows.fit()
    assert fixed == 0.0 and per_row == pytest.approx(0.1 / 9)
    assert all_rows.draft_cost(4) == pytest.approx(1.0)  # every row a whole decode, not more
    # not more even by rounding: (per_row * 57) / 57 is 1 ulp under per_row, and a cost over
    # 1 made SpecStats.record raise inside an engine step (a verify pass on the H200)
    assert max(all_rows.draft_cost(batch) for batch in range(1, 129)) == 1.0


def test_a_verify_pass_premium_is_told_apart_from_its_rows() -> None:
    """A GPU at batch 1: a decode pass 1.4 ms, a verify pass 3.5 ms plus 0.02 ms a row (its
    host work and graphs, not its rows). Fitting rows alone would call a draft row 0.17
    decoded tokens and miss the 1.5 that every verify pass costs more than a decode."""
    cost = PassCost()
    for rows in [2, 13, 4, 7, 3, 13, 2, 9]:
        cost.observe(1, 0.0014)
        cost.observe(rows, 0.0014 + 0.0021 + 0.00002 * rows, verify=True)
    fixed, per_row, premium = cost.fit()
    # (a decode pass is fixed + one row: fixed 1.38 ms, and the premium 2.12 ms)
    assert per_row == pytest.approx(0.00002) and premium == pytest.approx(0.00212)
    assert fixed == pytest.approx(0.00138)
    assert cost.draft_cost(1) == pytest.approx(0.00002 / 0.0014)
    assert cost.verify_premium(1) == pytest.approx(0.00212 / 0.0014)
    # verify passes of one size: premium and rows cannot be told apart; rows alone, as before
    same = PassCost()
    for _ in range(6):
        same.observe(1, 0.0014)
        same.observe(13, 0.0036, verify=True)
    fixed, per_row, premium = same.fit()
    assert premium == 0.0 and per_row == pytest.approx(0.0022 / 12)


def test_a_long_run_of_one_kind_keeps_what_the_other_costs() -> None:
    """Copy-heavy text at batch 1 verifies every step for hundreds of steps, and free text
    decodes for thousands: each kind's passes decay only with passes of their own kind, so
    neither run washes the other out (with one decay for both, 400 verify passes in a row
    turned the premium into a fixed part, and 24k decodes drove the verify sums to subnormal
    floats and the premium to hundreds of decoded tokens)."""
    cost = PassCost()
    for rows in [2, 13, 4, 7, 3, 13, 2, 9]:
        cost.observe(1, 0.0014)
        cost.observe(rows, 0.0035 + 0.00002 * rows, verify=True)
    before = cost.fit()
    for step in range(600):
        cost.observe(3 + step % 11, 0.0035 + 0.00002 * (3 + step % 11), verify=True)
    assert cost.fit() == pytest.approx(before)
    for _ in range(30000):
        cost.observe(1, 0.0014)
    assert cost.fit() == pytest.approx(before)
    assert cost.verify_premium(1) == pytest.approx(before.verify_premium / 0.0014)


def test_rows_that_cost_nothing_keep_the_premium_through_noise() -> None:
    """A GPU with a small model: rows are free and the timings noisy. A per-row time that
    comes out below 0 must not take the premium with it."""
    rng = np.random.default_rng(0)
    cost = PassCost()
    premiums = []
    for step in range(400):
        cost.observe(1, 0.0014 + rng.normal(0, 5e-5))
        rows = 2 + step % 12
        cost.observe(rows, 0.0035 + rng.normal(0, 5e-5), verify=True)
        if step >= 40:
            premiums.append(cost.verify_premium(1))
    assert min(premiums) > 1.2 and max(premiums) < 1.8  # 2.1 ms over ~1.4 ms decodes
    assert cost.draft_cost(1) < 0.05


def test_old_passes_are_forgotten() -> None:
    cost = PassCost(decay=0.5)
    for rows in [1, 13] * 5:
        cost.observe(rows, 0.010 * rows)  # all per row
    for rows in [1, 13] * 20:
        cost.observe(rows, 0.010)  # the machine changed: rows are free now
    assert cost.fit()[1] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(("rows", "seconds"), [(0, 0.01), (1, -0.01), (1, math.nan), (1, math.inf)])
def test_bad_pass_is_refused(rows: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="is not a pass"):
        PassCost().observe(rows, seconds)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_bad_decay_is_refused(decay: float) -> None:
    with pytest.raises(ValueError, match=rf"decay={decay!r} is not allowed"):
        PassCost(decay=decay)
