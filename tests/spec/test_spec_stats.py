"""Acceptance statistics and adaptive draft budgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import DraftTree, SpecConfig, SpecStats, stack
from engine.spec.stats import AcceptanceStats


def test_histogram_means_and_totals() -> None:
    stats = SpecStats(SpecConfig(adaptive=False))
    stats.add(1)
    stats.add(2)
    stats.record_batch(
        [1, 2], stack([DraftTree((1, 2, 3), (-1, 0, 1)), DraftTree.root_only(4)]), [2, 0]
    )
    stats.record(1, drafted=4, accepted=1)
    one = stats.request(1)
    assert (one.steps, one.drafting_steps, one.drafted, one.accepted) == (2, 2, 6, 3)
    assert one.histogram[:3] == (0, 1, 1) and one.mean_accepted == 1.5
    assert one.acceptance_rate == 0.5
    stats.remove(1)
    total = stats.total()
    assert (total.steps, total.drafting_steps, total.accepted) == (3, 2, 3)
    assert total.histogram[:3] == (1, 1, 1) and total.mean_accepted == 1.0
    assert stats.request(2).acceptance_rate == 0.0 and stats.budget(2) == 12


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=2, max_size=2),
        max_size=30,
    ),
    adaptive=st.booleans(),
)
def test_each_request_counts_as_its_steps_folded_into_values(
    steps: list[list[tuple[int, int]]], adaptive: bool
) -> None:
    """A request's statistics (counted in place) are its recorded steps added one by one to
    an `AcceptanceStats` value, its idle steps after them; the total, every request's."""
    stats = SpecStats(SpecConfig(adaptive=adaptive))
    stats.add(1)
    stats.add(2)
    expected = {1: AcceptanceStats(), 2: AcceptanceStats()}
    idle = {1: 0, 2: 0}
    for pairs in steps:
        drafted = [max(d, a) for d, a in pairs]
        accepted = [min(d, a) for d, a in pairs]
        if not any(drafted):
            stats.record_idle([1, 2])
            idle = {rid: n + 1 for rid, n in idle.items()}
            continue
        trees = stack([DraftTree([0] * (n + 1), [-1, *range(n)]) for n in drafted])
        stats.record_batch([1, 2], trees, accepted)
        for rid, d, a in zip((1, 2), drafted, accepted, strict=True):
            expected[rid] = expected[rid].add(d, a)
    for rid in (1, 2):
        assert stats.request(rid) == expected[rid].add_idle(idle[rid])
    one, two = expected[1], expected[2]
    total = AcceptanceStats(
        one.steps + two.steps,
        one.drafting_steps + two.drafting_steps,
        one.drafted + two.drafted,
        one.accepted + two.accepted,
        tuple(a + b for a, b in zip(one.histogram, two.histogram, strict=True)),
    )
    assert stats.total() == total.add_idle(idle[1] + idle[2])


def test_budget_shrinks_to_root_only_probes_and_grows_back() -> None:
    config = SpecConfig(
        draft_budget=8, adapt_window=4, shrink_below=0.5, grow_at_least=1.5, probe_interval=3
    )
    stats = SpecStats(config)
    stats.add(0)
    budgets = []
    for _ in range(4 * 4):  # nothing is ever accepted
        stats.record(0, drafted=stats.budget(0), accepted=0)
        budgets.append(stats.budget(0))
    assert budgets == [8, 8, 8, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 0]
    for _ in range(2):
        stats.record(0, drafted=0, accepted=0)
    assert stats.budget(0) == 0
    stats.record(0, drafted=0, accepted=0)
    assert stats.budget(0) == 1  # a probe after probe_interval idle steps
    budgets = []
    for _ in range(5):  # every draft is accepted again: the budget was the limit, it doubles
        budget = stats.budget(0)
        stats.record(0, drafted=budget, accepted=budget)
        budgets.append(stats.budget(0))
    assert budgets == [2, 4, 8, 8, 8]


def test_budget_levels_start_below_the_widest_trees_and_step_between_levels() -> None:
    config = SpecConfig(
        draft_budget=12,
        budget_levels=(3, 7, 12),
        start_budget=7,
        adapt_window=2,
        probe_interval=2,
        draft_cost=0.0,
    )
    stats = SpecStats(config)
    stats.add(0)
    assert stats.budget(0) == 7  # the widest trees are earned
    stats.record(0, drafted=7, accepted=7)  # the whole tree: the budget was the limit
    assert stats.budget(0) == 12
    budgets = []
    for _ in range(6):  # nothing accepted: a level down each full window
        stats.record(0, drafted=stats.budget(0), accepted=0)
        budgets.append(stats.budget(0))
    assert budgets == [12, 7, 7, 3, 3, 0]
    for _ in range(2):
        stats.record(0, drafted=0, accepted=0)
    probe = stats.budget(0)
    assert probe == 1  # free drafts: one pays for its pass
    stats.record(0, drafted=1, accepted=1)
    assert stats.budget(0) == 3  # up to the next level, not to double


def test_a_rejected_probe_returns_to_root_only_at_once() -> None:
    stats = SpecStats(SpecConfig(draft_budget=1, adapt_window=8, probe_interval=2))
    stats.add(0)
    for _ in range(8):
        stats.record(0, drafted=1, accepted=0)
    assert stats.budget(0) == 0
    for _ in range(2):
        stats.record(0, drafted=0, accepted=0)
    assert stats.budget(0) == 1
    stats.record(0, drafted=1, accepted=0)  # one rejected probe, not a window of them
    assert stats.budget(0) == 0


def test_a_window_of_half_accepted_drafts_grows_the_budget() -> None:
    stats = SpecStats(
        SpecConfig(draft_budget=8, adapt_window=2, shrink_below=0.5, grow_at_least=1.5)
    )
    stats.add(0)
    stats.record(0, drafted=8, accepted=0)
    stats.record(0, drafted=8, accepted=1)  # mean 0.5 >= shrink_below: stays
    assert stats.budget(0) == 8
    for _ in range(4):
        stats.record(0, drafted=8, accepted=0)
    assert stats.budget(0) == 2
    stats.record(0, drafted=1, accepted=1)  # the tree had less than the budget: no doubling
    assert stats.budget(0) == 2
    stats.record(0, drafted=2, accepted=1)  # window mean 1.0 >= min(1.5, 2 / 2)
    assert stats.budget(0) == 4


def test_costly_rejected_drafts_shrink_before_the_window_fills() -> None:
    # A draft row at 0.15 decoded tokens (a 13-row CPU verify pass ~ 2.8 decodes): twelve
    # rejected drafts lose 1.8 tokens' time, two such steps pass shrink_after_loss=2 (the
    # run's limit, which would end this sooner, is tested apart).
    config = SpecConfig(
        draft_budget=12, adapt_window=8, shrink_after_loss=2.0, max_run_loss=float("inf")
    )
    stats = SpecStats(config)
    stats.add(0)
    budgets = []
    for _ in range(12):
        budget = stats.budget(0)
        stats.record(0, drafted=budget, accepted=0, draft_cost=0.15)
        budgets.append(stats.budget(0))
    assert budgets == [12, 6, 6, 6, 3, 3, 3, 3, 3, 1, 1, 1]
    # the same misses at no cost wait for the acceptance window
    free = SpecStats(config)
    free.add(0)
    for _ in range(7):
        free.record(0, drafted=12, accepted=0, draft_cost=0.0)
    assert free.budget(0) == 12
    # accepted runs pay for the misses around them (a request that copies keeps its budget)
    copying = SpecStats(config)
    copying.add(0)
    for accepted in [0, 9, 0, 0, 12, 0, 0, 0, 7, 0, 0]:
        copying.record(0, drafted=12, accepted=accepted, draft_cost=0.15)
    assert copying.budget(0) == 12


def test_a_verify_pass_premium_is_shared_by_the_requests_that_drafted() -> None:
    """On a GPU a verify pass costs ~1.5 decodes beyond its rows: a request accepting one
    draft of two a step gains 1 token and pays 0.02 * 2 + 1.5, so it shrinks; split over
    two drafting requests (a third drafted nothing) the premium is 0.75 each, and they keep
    their budgets."""
    config = SpecConfig(draft_budget=2, adapt_window=8, shrink_after_loss=2.0)
    alone = SpecStats(config)
    alone.add(0)
    tree = stack([DraftTree((5, 6, 7), (-1, 0, 1))])
    budgets = []
    for _ in range(6):
        alone.record_batch([0], tree, [1], 0.02, verify_premium=1.5)
        budgets.append(alone.budget(0))
    assert budgets[-1] < 2
    shared = SpecStats(config)
    for rid in range(3):
        shared.add(rid)
    trees = stack(
        [DraftTree((5, 6, 7), (-1, 0, 1)), DraftTree((5, 6, 7), (-1, 0, 1)), DraftTree.root_only(5)]
    )
    for _ in range(6):
        shared.record_batch([0, 1, 2], trees, [1, 1, 0], 0.02, verify_premium=1.5)
    assert [shared.budget(r) for r in range(3)] == [2, 2, 2]
    # shared by the two that drafted, not by all three: at a premium of 2.7 each pays 1.35
    # and loses 0.39 a step (budgets halve); split three ways (0.9) they would keep them
    costly = SpecStats(config)
    for rid in range(3):
        costly.add(rid)
    for _ in range(6):
        costly.record_batch([0, 1, 2], trees, [1, 1, 0], 0.02, verify_premium=2.7)
    assert [costly.budget(r) for r in range(3)] == [1, 1, 2]


def test_configured_draft_cost_overrides_the_measured_one() -> None:
    stats = SpecStats(SpecConfig(draft_cost=0.5, shrink_after_loss=2.0))
    stats.add(0)
    stats.record(0, drafted=6, accepted=0, draft_cost=0.0)  # 3.0 > 2.0 at the config's cost
    assert stats.budget(0) == 6
    with pytest.raises(ValueError, match=r"draft_cost=1.5 is not allowed"):
        SpecStats().record(0, drafted=1, accepted=0, draft_cost=1.5)


def test_no_match_is_no_evidence_and_adaptive_off_keeps_budget() -> None:
    stats = SpecStats(SpecConfig(adapt_window=2))
    stats.add(0)
    for _ in range(10):
        stats.record(0, drafted=0, accepted=0)  # root-only trees: nothing to judge
    assert stats.budget(0) == 12
    fixed = SpecStats(SpecConfig(adaptive=False, adapt_window=1))
    fixed.add(0)
    fixed.record(0, drafted=12, accepted=0)
    assert fixed.budget(0) == 12


def test_errors() -> None:
    stats = SpecStats()
    with pytest.raises(KeyError, match="request 3 has no speculation statistics"):
        stats.budget(3)
    stats.add(3)
    with pytest.raises(KeyError, match="already has"):
        stats.add(3)
    with pytest.raises(ValueError, match=r"accepted=3, drafted=2 is not allowed"):
        stats.record(3, drafted=2, accepted=3)
    with pytest.raises(ValueError, match=r"step_cost=-1.0 is not allowed"):
        stats.record(3, drafted=1, accepted=0, step_cost=-1.0)
    with pytest.raises(ValueError, match="1 requests, 2 trees and 2 accepted lengths must"):
        stats.record_batch([3], stack([DraftTree.root_only(1)] * 2), [0, 0])
    with pytest.raises(ValueError, match="1 requests, 1 trees and 2 accepted lengths must"):
        stats.record_batch([3], stack([DraftTree.root_only(1)]), [0, 0])


@pytest.mark.parametrize("bad", ["accepted", "unknown request", "premium share"])
def test_a_batch_with_a_bad_row_changes_nothing(bad) -> None:
    """Every row is checked before any is recorded: a bad last row leaves the first row's
    statistics, budget and the totals as they were."""
    stats = SpecStats(SpecConfig(adapt_window=1))
    for rid in (1, 2):
        stats.add(rid)
    trees = stack([DraftTree((1, 2, 3), (-1, 0, 1)), DraftTree((1, 2), (-1, 0))])
    rids, accepted, premium = [1, 2], [0, 0], 0.0
    if bad == "accepted":
        accepted = [0, 2]  # more than its one draft
    elif bad == "unknown request":
        rids = [1, 9]
    else:  # only the rows that drafted share it: the first drafts nothing, the second -1.0
        trees = stack([DraftTree.root_only(1), DraftTree((1, 2), (-1, 0))])
        premium = -1.0
    with pytest.raises((ValueError, KeyError)):
        stats.record_batch(rids, trees, accepted, 0.5, premium)
    assert stats.request(1) == AcceptanceStats() == stats.total()
    assert stats.budget(1) == 12
    trees = stack([DraftTree((1, 2, 3), (-1, 0, 1)), DraftTree((1, 2), (-1, 0))])
    stats.record_batch([1, 2], trees, [0, 0], 0.5)  # a good batch: the first row's loss halves
    assert stats.budget(1) == 6 and stats.total().steps == 2


def test_a_batch_that_drafted_nothing_counts_as_each_row_recorded_alone() -> None:
    """A batch of root-only trees is counted, not added row by row (the step of free text);
    statistics, totals, budgets and probes read as if each row were recorded alone, beside
    batches that drafted; an unknown request in such a batch changes nothing."""
    config = SpecConfig(draft_budget=4, adapt_window=2, probe_interval=3)
    batched, alone = SpecStats(config), SpecStats(config)
    for stats in (batched, alone):
        for rid in (1, 2, 3):
            stats.add(rid)
    budgets_of_1 = []
    for step in range(48):
        rids = [1, 2, 3] if step % 5 else [2, 3]
        drafts = [0] * len(rids) if step % 3 else [batched.budget(rid) for rid in rids]
        accepted = [min(d, 1) if rid == 3 else 0 for rid, d in zip(rids, drafts, strict=True)]
        trees = stack(
            [
                DraftTree(tuple(range(1, d + 2)), tuple(range(-1, d)))
                if d
                else DraftTree.root_only(1)
                for d in drafts
            ]
        )
        batched.record_batch(rids, trees, accepted)
        for rid, d, a in zip(rids, drafts, accepted, strict=True):
            alone.record(rid, drafted=d, accepted=a)
        for rid in (1, 2, 3):
            assert batched.request(rid) == alone.request(rid)
            assert batched.budget(rid) == alone.budget(rid)
        assert batched.total() == alone.total()
        budgets_of_1.append(batched.budget(1))
    seen = "".join(str(b) for b in budgets_of_1)
    assert "01" in seen, f"request 1 never probed from root only: budgets {seen}"
    before = batched.total()
    with pytest.raises(KeyError, match="request 9 has no speculation statistics"):
        batched.record_batch([1, 9], stack([DraftTree.root_only(1)] * 2), [0, 0])
    assert batched.total() == before and batched.request(1) == alone.request(1)
    batched.remove(2)
    alone.remove(2)
    assert batched.total() == alone.total()


def test_record_idle_is_a_batch_of_root_only_trees() -> None:
    """`record_idle` (a decode step with speculation on) records what `record_batch` does
    for root-only trees with nothing accepted."""
    config = SpecConfig(draft_budget=4, adapt_window=2, probe_interval=3)
    idle, batched = SpecStats(config), SpecStats(config)
    for stats in (idle, batched):
        for rid in (1, 2):
            stats.add(rid)
        stats.record_batch([1], stack([DraftTree((1, 2), (-1, 0))]), [0])  # one drafted first
    for _ in range(7):
        idle.record_idle([1, 2])
        batched.record_batch([1, 2], stack([DraftTree.root_only(1)] * 2), [0, 0])
        for rid in (1, 2):
            assert idle.request(rid) == batched.request(rid)
            assert idle.budget(rid) == batched.budget(rid)
        assert idle.total() == batched.total()
    with pytest.raises(KeyError, match="request 9 has no speculation statistics"):
        idle.record_idle([1, 9])


def _waits_before_probes(stats: SpecStats, rid: int, probes: int, accepted: int, cost: float):
    """Idle steps `rid` waits at budget 0 before each of `probes` probes, each probe's one
    draft accepted `accepted` times and costing `cost` decoded tokens' time (where the budget
    grew, it is brought back to 0 by rejected drafts that cost nothing)."""
    waits = []
    for _ in range(probes):
        idle = 0
        while stats.budget(rid) == 0:
            stats.record(rid, drafted=0, accepted=0)
            idle += 1
        waits.append(idle)
        stats.record(rid, drafted=1, accepted=accepted, step_cost=cost)
        while stats.budget(rid):
            stats.record(rid, drafted=stats.budget(rid), accepted=0)
    return waits


def _at_root(config: SpecConfig, timing_free: bool = False) -> SpecStats:
    """A request whose first drafts lost time: at budget 0, its first wait ahead."""
    stats = SpecStats(config)
    stats.add(0, timing_free)
    while stats.budget(0):
        stats.record(0, drafted=stats.budget(0), accepted=0, step_cost=2.0)
    return stats


def test_probes_that_lose_time_wait_twice_as_long_each_time() -> None:
    """Free text on a device where a verify pass costs two decoded tokens more than a
    decode: a probe that drafts one token loses time even when it is accepted, so the waits
    double up to max_probe_interval."""
    config = SpecConfig(probe_interval=4, max_probe_interval=32)
    for accepted in (0, 1):
        stats = _at_root(config)
        waits = _waits_before_probes(stats, 0, 6, accepted, cost=2.0)
        assert waits == [4, 8, 16, 32, 32, 32], f"accepted={accepted}"


def test_drafting_that_pays_resets_the_wait() -> None:
    config = SpecConfig(probe_interval=4, max_probe_interval=32)
    stats = _at_root(config)
    assert _waits_before_probes(stats, 0, 3, 0, cost=2.0) == [4, 8, 16]
    # a probe whose single draft is accepted where a draft costs little: drafting paid
    assert _waits_before_probes(stats, 0, 2, 1, cost=0.1) == [32, 4]


def test_free_drafts_and_a_fixed_interval_never_back_off() -> None:
    """A timing-free request (drafts judged free) and max_probe_interval == probe_interval
    probe at the same interval however the probes go."""
    free = _at_root(SpecConfig(probe_interval=4, max_probe_interval=32), timing_free=True)
    assert _waits_before_probes(free, 0, 4, 0, cost=2.0) == [4, 4, 4, 4]
    fixed = _at_root(SpecConfig(probe_interval=4, max_probe_interval=4))
    assert _waits_before_probes(fixed, 0, 4, 0, cost=2.0) == [4, 4, 4, 4]


def test_drafting_that_keeps_losing_returns_to_the_root() -> None:
    """One draft accepted a step where a verify pass costs 2.3 decoded tokens more than a
    decode: every step loses 1.3 tokens' time. The window alone halves and doubles the
    budget between 1 and 2 for ever; the run's loss sends it back to 0 once past
    max_run_loss."""
    for limit, reaches_root in ((4.0, True), (float("inf"), False)):
        stats = SpecStats(SpecConfig(max_run_loss=limit))
        stats.add(0)
        budgets = []
        for _ in range(40):
            budget = stats.budget(0)
            stats.record(0, drafted=budget, accepted=min(budget, 1), step_cost=2.3)
            budgets.append(stats.budget(0))
            if not budgets[-1]:
                break
        assert (budgets[-1] == 0) == reaches_root, f"max_run_loss={limit}: budgets {budgets}"
        if reaches_root:  # 1.3 tokens lost a step: the fourth step passes 4.0
            assert len(budgets) == 4, budgets


def test_a_probe_drafts_what_could_pay_for_its_pass_and_must_pay() -> None:
    """A verify pass costing 2.3 decoded tokens more than a decode, a draft 0.05: a probe of
    one draft could never pay, so probes draft floor(2.3 / 0.95) + 1 = 3. One that accepts
    2 of them loses time and returns to the root; one that accepts all 3 pays and grows."""
    config = SpecConfig(probe_interval=2, max_probe_interval=2)
    stats = SpecStats(config)
    stats.add(0)
    while stats.budget(0):
        stats.record(0, drafted=stats.budget(0), accepted=0, draft_cost=0.05, step_cost=2.3)
    for accepted, after in ((2, 0), (3, 6)):
        for _ in range(2):
            stats.record(0, drafted=0, accepted=0)
        assert stats.budget(0) == 3
        stats.record(0, drafted=3, accepted=accepted, draft_cost=0.05, step_cost=2.3)
        assert stats.budget(0) == after, f"accepted={accepted}"
    # where a pass costs only its rows the probe is one draft, as before
    free = SpecStats(config)
    free.add(0)
    while free.budget(0):
        free.record(0, drafted=free.budget(0), accepted=0, draft_cost=0.05)
    for _ in range(2):
        free.record(0, drafted=0, accepted=0)
    assert free.budget(0) == 1
