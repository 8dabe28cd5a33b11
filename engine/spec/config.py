"""Settings of the n-gram proposer and of adaptive drafting: one frozen, validated value."""

from __future__ import annotations

import attrs

from engine.state.batch import MAX_TREE_NODES
from engine.state.params import as_tuple, check_field, is_int, is_number


@attrs.frozen
class SpecConfig:
    """How drafts are proposed and how their size adapts.

    max_trie_depth (16): the longest n-gram a draft reads (a match and the tokens after it,
        as in a trie of every window of this many tokens); a match of length L leaves at
        most max_trie_depth - L tokens of draft depth.
    draft_budget (12): draft tokens per tree, not counting the root (the pending token).
    min_breadth (1) / max_breadth (6): children kept per tree node; the breadth falls linearly
        from max_breadth at a match of min_match tokens to min_breadth at max_match tokens.
    capacity (65536): trie nodes kept in the shared corpus' trie (about capacity /
        max_trie_depth tokens of fresh text); past it, the least recently seen windows are
        evicted down to half the capacity. A request's own history is kept whole (memory
        O(its tokens), bounded by its context; no eviction), and a match reads the newest
        capacity / max_trie_depth occurrences of the suffix's last min(min_match, 2) tokens.
    min_match (2) / max_match (6): suffix lengths tried, longest first.
    adaptive (True): shrink a request's draft budget when its recent acceptance is low, or
        when its rejected drafts cost more time than its accepted ones saved.
    adapt_window (8): drafting steps kept per request, for the mean acceptance (which acts
        on a full window) and for the loss below.
    shrink_below (0.5): mean accepted drafts per step below which the budget halves.
    grow_at_least (1.5): mean accepted drafts per step at or above which the budget doubles.
        A step that accepts its whole budget doubles it at once (the budget was the limit).
    probe_interval (16): steps a request waits at budget 0 before drafting again: a probe,
        with the fewest drafts that would pay for the verify pass were all accepted (1 where
        a pass costs no more than its rows); a probe that does not pay returns the request
        to budget 0 at once.
    max_probe_interval (128): where the drafting that followed a probe lost time (its drafts
        cost more decoded tokens' time than the accepted ones saved) the request's next wait
        at budget 0 doubles, up to this; drafting that pays resets it to probe_interval.
        Equal to probe_interval: every wait is probe_interval.
    max_run_loss (4.0): decoded tokens' time the drafting since the last probe (or since the
        request began) may lose in all; past it the budget returns to 0 at once (inf: no
        limit). It ends drafting whose accepted drafts never pay for the verify passes, where
        the window's halving and doubling would go on.
    draft_cost (None): the time of one draft row in decoded tokens' time (a decode pass's
        time per request); None: measured from the engine's own passes (`spec.cost`), with a
        verify pass's premium over a decode pass. A configured cost has no premium.
    shrink_after_loss (2.0): within the recent drafting steps, when the drafts' cost minus
        the accepted drafts (sum of draft_cost * drafted + the step's share of the verify
        premium - accepted, in decoded tokens) exceeds this, the budget halves without
        waiting for a full window.
    budget_levels (()): the budgets adaptive drafting moves between besides 0, lowest first,
        the last draft_budget; shrinking goes to the next level down (below the lowest: 0),
        growing to the next level up (a probe's budget may lie between levels). Empty: the
        budget halves and doubles. Levels at a GPU's verify graph widths (3, 7, 12) read
        within the spread between runs of the default on an H100 (docs/benchmarks.md), so
        they are off.
    start_budget (None): a new request's budget (None: draft_budget); with budget_levels, a
        level. Below draft_budget, a request reaches the widest trees only by growing to them.
    """

    max_trie_depth: int = 16
    draft_budget: int = 12
    min_breadth: int = 1
    max_breadth: int = 6
    capacity: int = 1 << 16
    min_match: int = 2
    max_match: int = 6
    adaptive: bool = True
    adapt_window: int = 8
    shrink_below: float = 0.5
    grow_at_least: float = 1.5
    probe_interval: int = 16
    max_probe_interval: int = 128
    max_run_loss: float = 4.0
    draft_cost: float | None = None
    shrink_after_loss: float = 2.0
    budget_levels: tuple[int, ...] = attrs.field(default=(), converter=as_tuple)
    start_budget: int | None = None

    def __attrs_post_init__(self) -> None:
        depth = self.max_trie_depth
        check_field(
            "max_trie_depth", depth, is_int(depth) and 2 <= depth <= 64, "an integer in [2, 64]"
        )
        budget = self.draft_budget
        check_field(
            "draft_budget",
            budget,
            is_int(budget) and 0 <= budget < MAX_TREE_NODES,
            f"an integer in [0, {MAX_TREE_NODES - 1}] (a tree holds at most "
            f"{MAX_TREE_NODES} nodes with its root)",
        )
        low, high = self.min_breadth, self.max_breadth
        check_field("min_breadth", low, is_int(low) and low >= 1, "an integer >= 1")
        check_field(
            "max_breadth", high, is_int(high) and high >= low, f"an integer >= min_breadth={low}"
        )
        cap, floor = self.capacity, 4 * depth * depth
        check_field(
            "capacity",
            cap,
            is_int(cap) and cap >= floor,
            f"an integer >= 4 * max_trie_depth**2 = {floor} (the newest windows must fit)",
        )
        first, last = self.min_match, self.max_match
        check_field(
            "min_match",
            first,
            is_int(first) and 1 <= first < depth,
            f"an integer in [1, max_trie_depth - 1 = {depth - 1}]",
        )
        check_field(
            "max_match",
            last,
            is_int(last) and first <= last < depth,
            f"an integer in [min_match={first}, max_trie_depth - 1 = {depth - 1}]",
        )
        self._check_adaptive()

    def _check_adaptive(self) -> None:
        check_field("adaptive", self.adaptive, isinstance(self.adaptive, bool), "a bool")
        window = self.adapt_window
        check_field("adapt_window", window, is_int(window) and window >= 1, "an integer >= 1")
        shrink, grow = self.shrink_below, self.grow_at_least
        check_field("shrink_below", shrink, is_number(shrink) and shrink >= 0, "a number >= 0")
        check_field(
            "grow_at_least",
            grow,
            is_number(grow) and grow > shrink,
            f"a number > shrink_below={shrink}",
        )
        probe = self.probe_interval
        check_field("probe_interval", probe, is_int(probe) and probe >= 1, "an integer >= 1")
        longest = self.max_probe_interval
        check_field(
            "max_probe_interval",
            longest,
            is_int(longest) and longest >= probe,
            f"an integer >= probe_interval={probe}",
        )
        run = self.max_run_loss
        check_field("max_run_loss", run, is_number(run) and run > 0, "a number > 0 (inf: no limit)")
        cost = self.draft_cost
        check_field(
            "draft_cost",
            cost,
            cost is None or (is_number(cost) and 0 <= cost <= 1),
            "None (measured) or a number in [0, 1]",
        )
        loss = self.shrink_after_loss
        check_field("shrink_after_loss", loss, is_number(loss) and loss > 0, "a number > 0")
        budget, levels = self.draft_budget, self.budget_levels
        check_field(
            "budget_levels",
            levels,
            levels == ()
            or (
                isinstance(levels, tuple)
                and all(is_int(level) for level in levels)
                and levels[0] >= 1
                and all(a < b for a, b in zip(levels, levels[1:], strict=False))
                and levels[-1] == budget
            ),
            f"() or increasing integers >= 1 ending at draft_budget={budget}",
        )
        start = self.start_budget
        check_field(
            "start_budget",
            start,
            start is None
            or (is_int(start) and 1 <= start <= budget and (not levels or start in levels)),
            f"None or an integer in [1, draft_budget={budget}]"
            + (f", one of budget_levels={levels}" if levels else ""),
        )

    def lower_budget(self, budget: int) -> int:
        """The budget a request shrinks to from `budget`: the next level down (0 below the
        lowest), or half."""
        if not self.budget_levels:
            return budget // 2
        return max((level for level in self.budget_levels if level < budget), default=0)

    def higher_budget(self, budget: int) -> int:
        """The budget a request grows to from `budget` (< draft_budget): the next level up,
        or double, at most draft_budget."""
        if not self.budget_levels:
            return min(self.draft_budget, 2 * budget)
        return min(level for level in self.budget_levels if level > budget)

    @property
    def first_budget(self) -> int:
        """A new request's budget."""
        return self.draft_budget if self.start_budget is None else self.start_budget

    def breadth(self, match_len: int) -> int:
        """Children kept per node for a match of `match_len` tokens (shorter: more)."""
        span = self.max_match - self.min_match
        if span == 0:
            return self.max_breadth
        clipped = min(max(match_len, self.min_match), self.max_match)
        fraction = (clipped - self.min_match) / span
        return self.max_breadth - round((self.max_breadth - self.min_breadth) * fraction)
