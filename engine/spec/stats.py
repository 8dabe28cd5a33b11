"""Acceptance statistics per request and in total, and adaptive draft budgets: a request
whose recent drafts are mostly rejected, or cost more time than they saved, halves its budget
(down to the root only); one that accepts its whole budget, or a high mean over a full window,
doubles it (with `SpecConfig.budget_levels`, a level down or up instead).

At the root only it probes now and then with the fewest drafts that would pay for their
verify pass were all accepted (one where a pass costs no more than its rows). A probe that
does not pay returns it to the root at once, as does drafting that has lost more than
`max_run_loss` decoded tokens' time since the last probe (or since the request began): on a
device where a verify pass costs several decodes, one or two accepted drafts a step never
pay, and the halving and doubling above would go on drafting at a loss. Where the drafting
a probe led to lost time, the wait before the next probe doubles (up to
`max_probe_interval`); drafting that pays resets it.

The draft cost a request is judged with is decided here: `SpecConfig.draft_cost` when one is
configured; else 0 for a request added as `timing_free` (a seeded sampling request, whose
tokens depend on its trees and so must not depend on timings); else the measured cost the
caller records.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np

from engine.spec.config import SpecConfig
from engine.state.batch import MAX_TREE_NODES, DraftTrees


@attrs.frozen
class AcceptanceStats:
    """Counts over verify steps. `histogram[k]`: steps that accepted k drafts."""

    steps: int = 0
    drafting_steps: int = 0  # steps whose tree had at least one draft
    drafted: int = 0
    accepted: int = 0
    histogram: tuple[int, ...] = (0,) * MAX_TREE_NODES

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verify step (each step also emits one bonus token)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, drafted: int, accepted: int) -> AcceptanceStats:
        """One more verify step: `drafted` drafts, `accepted` of them accepted."""
        return self.add_many([drafted], [accepted])

    def add_idle(self, steps: int) -> AcceptanceStats:
        """`steps` more verify steps that drafted nothing."""
        if not steps:
            return self
        histogram = (self.histogram[0] + steps, *self.histogram[1:])
        return attrs.evolve(self, steps=self.steps + steps, histogram=histogram)

    def add_many(self, drafted: Sequence[int], accepted: Sequence[int]) -> AcceptanceStats:
        """One more verify step per (drafted, accepted) pair."""
        histogram = list(self.histogram)
        for taken in accepted:
            histogram[taken] += 1
        return AcceptanceStats(
            self.steps + len(drafted),
            self.drafting_steps + sum(d > 0 for d in drafted),
            self.drafted + sum(drafted),
            self.accepted + sum(accepted),
            tuple(histogram),
        )


class _Adaptive:
    __slots__ = (
        "accepted",
        "budget",
        "drafted",
        "drafting_steps",
        "fixed_cost",
        "histogram",
        "idle",
        "idle_steps",
        "probe_wait",
        "probe_budget",
        "probed",
        "probing",
        "recent",
        "run_loss",
        "steps",
    )

    def __init__(self, budget: int, window: int, fixed_cost: float | None, probe_wait: int) -> None:
        self.budget = budget
        self.fixed_cost = fixed_cost  # the cost this request is judged with, if not measured
        # (accepted, what the step's drafts cost in decoded tokens) per drafting step
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)
        self.idle_steps = 0  # steps at budget 0 since the last probe
        self.probe_wait = probe_wait  # idle steps at budget 0 before the next probe
        self.probing = False  # the next drafting step is a probe
        # drafts a probe makes: the fewest that pay for a verify pass at the costs last seen
        self.probe_budget = 1
        self.probed = False  # the drafting since budget 0 was last left began with a probe
        # decoded tokens' time lost by the drafting since budget 0 was last left (negative:
        # gained)
        self.run_loss = 0.0
        # `AcceptanceStats`' counts, added to in place as each step is recorded (a value of
        # them is made when read: `stats`), with `idle` more steps that drafted nothing
        self.steps = self.drafting_steps = self.drafted = self.accepted = 0
        self.histogram = [0] * MAX_TREE_NODES
        self.idle = 0

    def add(self, drafted: int, accepted: int) -> None:
        """One more verify step (as `AcceptanceStats.add`)."""
        self.steps += 1
        self.drafting_steps += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        self.histogram[accepted] += 1

    def stats(self) -> AcceptanceStats:
        recorded = AcceptanceStats(
            self.steps, self.drafting_steps, self.drafted, self.accepted, tuple(self.histogram)
        )
        return recorded.add_idle(self.idle)


class SpecStats:
    """Per-request acceptance and draft budget; totals include requests already removed."""

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config if config is not None else SpecConfig()
        self._requests: dict[int, _Adaptive] = {}
        self._total = AcceptanceStats()  # with `_idle` more steps that drafted nothing
        self._idle = 0

    def add(self, rid: int, timing_free: bool = False) -> None:
        """A new request; `timing_free`: judge it as if drafts were free (unless a cost is
        configured), whatever is measured, so that its trees do not depend on timings."""
        if rid in self._requests:
            raise KeyError(f"request {rid} already has speculation statistics")
        fixed = self.config.draft_cost
        self._requests[rid] = _Adaptive(
            self.config.first_budget,
            self.config.adapt_window,
            0.0 if fixed is None and timing_free else fixed,
            self.config.probe_interval,
        )

    def remove(self, rid: int) -> None:
        self._entry(rid)
        del self._requests[rid]

    def budget(self, rid: int) -> int:
        """The draft budget to propose with for this request's next step."""
        return self._entry(rid).budget

    def request(self, rid: int) -> AcceptanceStats:
        return self._entry(rid).stats()

    def total(self) -> AcceptanceStats:
        return self._total.add_idle(self._idle)

    def record(
        self, rid: int, drafted: int, accepted: int, draft_cost: float = 0.0, step_cost: float = 0.0
    ) -> None:
        """One verify step of `rid`: its tree had `drafted` drafts, `accepted` were accepted;
        a draft row was measured to cost `draft_cost` decoded tokens' time, and drafting at
        all this step `step_cost` more (its share of what a verify pass costs beyond its rows).
        A request with a fixed cost is judged by that alone (see the module docstring)."""
        self._record_rows([rid], [drafted], [accepted], draft_cost, [step_cost])

    def record_batch(
        self,
        rids: Sequence[int] | np.ndarray,
        trees: DraftTrees,
        accepted_lens: Sequence[int] | np.ndarray,
        draft_cost: float = 0.0,
        verify_premium: float = 0.0,
    ) -> None:
        """One verify pass: `rids` in batch order, their trees and accepted lengths, the
        measured draft cost, and what the pass cost beyond its rows in decoded tokens
        (`PassCost.verify_premium`), shared by the requests that drafted in it."""
        drafted = trees.sizes.lens - 1
        accepted = np.asarray(accepted_lens).reshape(-1)
        if not len(rids) == drafted.shape[0] == accepted.shape[0]:
            raise ValueError(
                f"{len(rids)} requests, {drafted.shape[0]} trees and "
                f"{accepted.shape[0]} accepted lengths must match"
            )
        if not drafted.any() and not accepted.any():  # most steps of free text
            self._record_idle(rids, draft_cost)
            return
        drafted_list = drafted.tolist()
        share = verify_premium / max(sum(d > 0 for d in drafted_list), 1)
        self._record_rows(
            rids,
            drafted_list,
            accepted.tolist(),
            draft_cost,
            [share if d else 0.0 for d in drafted_list],
        )

    def _record_rows(
        self,
        rids: Sequence[int] | np.ndarray,
        drafted: list[int],
        accepted: list[int],
        draft_cost: float,
        step_costs: list[float],
    ) -> None:
        """Every row is checked, and every request found, before any is recorded."""
        _check_counts(drafted, accepted)
        for step_cost in step_costs:
            _check_costs(draft_cost, step_cost)
        entries = [self._entry(int(rid)) for rid in rids]
        self._total = self._total.add_many(drafted, accepted)
        for entry, num_drafted, num_accepted, step_cost in zip(
            entries, drafted, accepted, step_costs, strict=True
        ):
            entry.add(num_drafted, num_accepted)
            if self.config.adaptive:
                fixed = entry.fixed_cost
                if num_drafted:
                    per_draft, premium = (draft_cost, step_cost) if fixed is None else (fixed, 0.0)
                    entry.probe_budget = self._paying_budget(per_draft, premium)
                cost = (
                    draft_cost * num_drafted + step_cost if fixed is None else fixed * num_drafted
                )
                self._adapt(entry, num_drafted, num_accepted, cost)

    def _paying_budget(self, per_draft: float, premium: float) -> int:
        """The fewest drafts that pay for a verify pass if every one is accepted: each saves
        a decoded token and costs `per_draft`, and the pass costs `premium` more (decoded
        tokens' time); at most the configured budget."""
        if per_draft >= 1.0:
            return self.config.draft_budget
        return min(self.config.draft_budget, math.floor(premium / (1.0 - per_draft)) + 1)

    def record_idle(self, rids: Sequence[int] | np.ndarray) -> None:
        """A step where no request of `rids` drafted (it ran as a decode pass):
        `record_batch` with root-only trees, nothing accepted, nothing to add up."""
        self._record_idle(rids, 0.0)

    def _record_idle(self, rids: Sequence[int] | np.ndarray, draft_cost: float) -> None:
        """A step where no request of `rids` drafted: counted, not added to the statistics'
        values one by one (`request` and `total` add them when read)."""
        _check_costs(draft_cost, 0.0)
        entries = [self._entry(int(rid)) for rid in rids]
        self._idle += len(entries)
        for entry in entries:
            entry.idle += 1
            if self.config.adaptive:
                self._idle_step(entry)

    def _idle_step(self, entry: _Adaptive) -> None:
        """Nothing drafted: no evidence, unless the budget is 0 and it is time to probe."""
        if entry.budget == 0:
            entry.idle_steps += 1
            if entry.idle_steps >= entry.probe_wait:
                entry.budget, entry.idle_steps, entry.probing = entry.probe_budget, 0, True
                entry.probed, entry.run_loss = True, 0.0

    def _adapt(self, entry: _Adaptive, drafted: int, accepted: int, cost: float) -> None:
        """`cost`: what this step's drafting cost, in decoded tokens' time."""
        cfg = self.config
        if drafted == 0:
            self._idle_step(entry)
            return
        probing, entry.probing = entry.probing, False
        entry.recent.append((accepted, cost))
        entry.run_loss += cost - accepted
        # Time lost in the recent steps, in decoded tokens: what the drafts cost minus what the
        # accepted ones saved. A verify pass that costs several decodes shrinks fast.
        loss = sum(cost - taken for taken, cost in entry.recent)
        mean = sum(taken for taken, _ in entry.recent) / len(entry.recent)
        full = len(entry.recent) >= cfg.adapt_window
        # A small budget cannot reach a large mean: its bar to grow is budget / 2.
        grow_at = max(cfg.shrink_below, min(cfg.grow_at_least, entry.budget / 2))
        failed = probing and (accepted == 0 or cost > accepted)  # it did not pay
        if failed or entry.run_loss > cfg.max_run_loss:
            entry.budget = 0  # the probe failed, or the drafting since the last one lost
        elif loss > cfg.shrink_after_loss or (full and mean < cfg.shrink_below):
            entry.budget = cfg.lower_budget(entry.budget)
        elif entry.budget < cfg.draft_budget and (
            accepted == drafted == entry.budget or (full and mean >= grow_at)
        ):
            entry.budget = cfg.higher_budget(entry.budget)
        else:
            return
        entry.recent.clear()
        entry.idle_steps = 0
        if entry.budget == 0:
            self._back_to_root(entry)

    def _back_to_root(self, entry: _Adaptive) -> None:
        """The budget reached 0: the wait before the next probe doubles where the drafting
        since the last probe lost time, and starts over where it paid."""
        if entry.run_loss <= 0:
            entry.probe_wait = self.config.probe_interval
        elif entry.probed:
            entry.probe_wait = min(2 * entry.probe_wait, self.config.max_probe_interval)

    def _entry(self, rid: int) -> _Adaptive:
        entry = self._requests.get(rid)
        if entry is None:
            raise KeyError(f"request {rid} has no speculation statistics; add() it first")
        return entry


def _check_counts(drafted: Sequence[int], accepted: Sequence[int]) -> None:
    for num_drafted, num_accepted in zip(drafted, accepted, strict=True):
        if not 0 <= num_accepted <= num_drafted < MAX_TREE_NODES:
            raise ValueError(
                f"accepted={num_accepted}, drafted={num_drafted} is not "
                f"allowed; need 0 <= accepted <= drafted < {MAX_TREE_NODES}"
            )


def _check_costs(draft_cost: float, step_cost: float) -> None:
    if not 0.0 <= draft_cost <= 1.0:
        raise ValueError(f"draft_cost={draft_cost!r} is not allowed; need a number in [0, 1]")
    if not (math.isfinite(step_cost) and step_cost >= 0.0):
        raise ValueError(f"step_cost={step_cost!r} is not allowed; need a finite number >= 0")
