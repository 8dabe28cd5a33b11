"""PassCost: the online model of a pass's time that adaptive drafting weighs drafts with."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import PassCost
from engine.spec import cost as cost_module


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


def test_a_verify_step_is_charged_the_slower_decode_step_after_it() -> None:
    """A GPU at batch 1: a decode step 1.4 ms (its pass launched during the step before), a
    verify step 3.5 ms plus 0.02 ms a row, and the decode step after it 2.4 ms (nothing was
    launched during the verify pass). The verify step costs its own premium and that 1.0 ms
    more: 3.12 ms, 2.2 decoded tokens. Observed pass by pass, the slow decodes raise the
    decode's fixed part and the premium reads about half that (1.1 tokens)."""
    steps, passes = PassCost(), PassCost()
    for rows in [2, 13, 4, 7, 3, 13, 2, 9]:
        for cost in (steps, passes):
            observe = cost.observe_step if cost is steps else cost.observe
            for _ in range(3):
                observe(1, 0.0014)
            observe(rows, 0.0035 + 0.00002 * rows, verify=True)
            observe(1, 0.0024)
    fixed, per_row, premium = steps.fit()
    assert fixed + per_row == pytest.approx(0.0014)
    assert per_row == pytest.approx(0.00002) and premium == pytest.approx(0.00312, rel=0.02)
    assert steps.verify_premium(1) == pytest.approx(2.2, rel=0.02)
    assert passes.verify_premium(1) < 1.2
    # a verify step after a verify step is its own; the one before is observed alone
    chained = PassCost()
    for rows in [2, 13, 4, 7]:
        chained.observe_step(1, 0.0014)
        chained.observe_step(rows, 0.0035 + 0.00002 * rows, verify=True)
        chained.observe_step(rows, 0.0035 + 0.00002 * rows, verify=True)
    chained.observe_step(1, 0.0014)
    assert chained.fit().verify_premium == pytest.approx(0.0035 - 0.0014 + 0.00002, rel=0.02)


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


def reference_fit(passes: list[tuple[int, float, bool]], decay: float) -> tuple | None:
    """PassCost's fit as numpy arrays and `np.linalg.cond` compute it: the decayed sums per
    kind, the normal equations, and each solve refused above condition 1e6."""
    sums = [[0.0] * 5, [0.0] * 5]
    for rows, seconds, verify in passes:
        s, r, t = sums[int(verify)], float(rows), float(seconds)
        s[0] = decay * s[0] + 1.0
        s[1] = decay * s[1] + r
        s[2] = decay * s[2] + r * r
        s[3] = decay * s[3] + t
        s[4] = decay * s[4] + r * t

    def normal_of(kind: int) -> tuple[np.ndarray, np.ndarray]:
        n, r, rr, t, rt = sums[kind]
        k = float(kind)
        return np.array([[n, r, k * n], [r, rr, k * r], [k * n, k * r, k * n]]), np.array(
            [t, rt, k * t]
        )

    def solve(normal: np.ndarray, target: np.ndarray) -> np.ndarray | None:
        scale = np.sqrt(np.diag(normal))
        if (scale == 0).any():
            return None
        unit = normal / np.outer(scale, scale)
        if np.linalg.cond(unit) > 1e6:
            return None
        return np.linalg.solve(unit, target / scale) / scale

    (decode, decode_target), (verify, verify_target) = normal_of(0), normal_of(1)
    normal, target = decode + verify, decode_target + verify_target
    if decode[0, 0] > 0 and verify[0, 0] > 0:
        full = solve(normal, target)
        if full is not None and full[1] >= 0 and full[2] >= 0:
            return (max(0.0, full[0]), full[1], full[2])
        if full is not None and full[1] < 0:
            no_rows = solve(normal[np.ix_([0, 2], [0, 2])], target[[0, 2]])
            if no_rows is not None and no_rows[1] >= 0:
                return (max(0.0, no_rows[0]), 0.0, no_rows[1])
    rows_only = solve(normal[:2, :2], target[:2])
    if rows_only is None:
        return None
    per_row = max(0.0, rows_only[1])
    return (max(0.0, (target[0] - per_row * normal[0, 1]) / normal[0, 0]), per_row, 0.0)


@st.composite
def pass_sequences(draw: st.DrawFn) -> list[tuple[int, float, bool]]:
    """Passes as an engine sees them, some nearly degenerate: row counts from a small set,
    verify passes whose rows move with the kind (`shift`), times with a little noise."""
    kinds = draw(st.lists(st.booleans(), min_size=1, max_size=40))
    coupled = draw(st.booleans())
    shift = draw(st.integers(1, 12))
    fixed, per_row, premium = (
        draw(st.floats(1e-4, 1e-2)),
        draw(st.floats(0.0, 1e-3)),
        draw(st.floats(0.0, 3e-3)),
    )
    passes = []
    for verify in kinds:
        rows = 1 + shift * verify if coupled else draw(st.integers(1, 4)) + shift * verify
        noise = draw(st.sampled_from([0.0, 1e-9, 1e-7, -1e-6, 5e-5]))
        seconds = max(0.0, fixed + per_row * rows + premium * verify + noise)
        passes.append((rows, seconds, verify))
    return passes


@settings(max_examples=300, deadline=None)
@given(passes=pass_sequences(), decay=st.sampled_from([0.5, 0.97, 0.999]))
def test_fit_equals_the_numpy_reference_bit_for_bit(
    passes: list[tuple[int, float, bool]], decay: float
) -> None:
    cost = PassCost(decay)
    for rows, seconds, verify in passes:
        cost.observe(rows, seconds, verify)
    expected = reference_fit(passes, decay)
    fit = cost.fit()
    assert (fit is None) == (expected is None)
    if fit is not None:
        assert tuple(float(x) for x in fit) == tuple(float(x) for x in expected)


@st.composite
def unit_normals(draw: st.DrawFn) -> np.ndarray:
    """Normal matrices scaled to 1 on the diagonal, of 2 or 3 features, from nearly
    collinear to independent (and exactly singular)."""
    size = draw(st.sampled_from([2, 3]))
    samples = draw(st.integers(1, 6))
    base = np.array(
        draw(st.lists(st.floats(-4, 4), min_size=samples * size, max_size=samples * size))
    ).reshape(samples, size)
    base[:, -1] = base[:, 0] * draw(st.floats(0.5, 2)) + base[:, -1] * draw(
        st.sampled_from([0.0, 1e-9, 1e-4, 1e-2, 1.0])
    )
    normal = base.T @ base + np.diag(draw(st.sampled_from([0.0, 1e-12, 1e-6])) * np.ones(size))
    scale = np.sqrt(np.diag(normal))
    if (scale == 0).any():
        return np.eye(size)
    return normal / np.outer(scale, scale)


@settings(max_examples=300, deadline=None)
@given(unit=unit_normals())
def test_condition_is_numpys_and_the_quick_bound_never_passes_a_bad_one(unit: np.ndarray) -> None:
    exact = float(np.linalg.cond(unit))
    assert cost_module._condition(unit) == exact
    if cost_module._surely_conditioned(unit.tolist()):
        assert exact <= cost_module.CONDITION_LIMIT / 2 * (1 + 1e-6)
