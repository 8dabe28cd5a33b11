"""Acceptance statistics per request and in total, and adaptive draft budgets: a request
whose recent drafts are mostly rejected drafts less (down to the root only), and more again
once a probe draft is accepted.
"""

from __future__ import annotations

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
        histogram = list(self.histogram)
        histogram[accepted] += 1
        return AcceptanceStats(self.steps + 1, self.drafting_steps + int(drafted > 0),
                               self.drafted + drafted, self.accepted + accepted, tuple(histogram))


class _Adaptive:
    __slots__ = ("budget", "idle_steps", "recent", "stats")

    def __init__(self, budget: int, window: int) -> None:
        self.budget = budget
        self.recent: deque[int] = deque(maxlen=window)
        self.idle_steps = 0
        self.stats = AcceptanceStats()


class SpecStats:
    """Per-request acceptance and draft budget; totals include requests already removed."""

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config if config is not None else SpecConfig()
        self._requests: dict[int, _Adaptive] = {}
        self._total = AcceptanceStats()

    def add(self, rid: int) -> None:
        if rid in self._requests:
            raise KeyError(f"request {rid} already has speculation statistics")
        self._requests[rid] = _Adaptive(self.config.draft_budget, self.config.adapt_window)

    def remove(self, rid: int) -> None:
        self._entry(rid)
        del self._requests[rid]

    def budget(self, rid: int) -> int:
        """The draft budget to propose with for this request's next step."""
        return self._entry(rid).budget

    def request(self, rid: int) -> AcceptanceStats:
        return self._entry(rid).stats

    def total(self) -> AcceptanceStats:
        return self._total

    def record(self, rid: int, drafted: int, accepted: int) -> None:
        """One verify step of `rid`: its tree had `drafted` drafts, `accepted` were accepted."""
        if not 0 <= accepted <= drafted < MAX_TREE_NODES:
            raise ValueError(f"accepted={accepted}, drafted={drafted} is not allowed; need "
                             f"0 <= accepted <= drafted < {MAX_TREE_NODES}")
        entry = self._entry(rid)
        entry.stats = entry.stats.add(drafted, accepted)
        self._total = self._total.add(drafted, accepted)
        if self.config.adaptive:
            self._adapt(entry, drafted, accepted)

    def record_batch(self, rids: Sequence[int] | np.ndarray, trees: DraftTrees,
                     accepted_lens: Sequence[int] | np.ndarray) -> None:
        """One verify pass: `rids` in batch order, their trees and accepted lengths."""
        drafted = trees.sizes.lens - 1
        accepted = np.asarray(accepted_lens).reshape(-1)
        if not len(rids) == drafted.shape[0] == accepted.shape[0]:
            raise ValueError(f"{len(rids)} requests, {drafted.shape[0]} trees and "
                             f"{accepted.shape[0]} accepted lengths must match")
        for rid, num_drafted, num_accepted in zip(rids, drafted.tolist(), accepted.tolist(),
                                                  strict=True):
            self.record(int(rid), num_drafted, num_accepted)

    def _adapt(self, entry: _Adaptive, drafted: int, accepted: int) -> None:
        cfg = self.config
        if drafted == 0:
            # Nothing drafted: no evidence, unless the budget is 0 and it is time to probe.
            if entry.budget == 0:
                entry.idle_steps += 1
                if entry.idle_steps >= cfg.probe_interval:
                    entry.budget, entry.idle_steps = 1, 0
            return
        entry.recent.append(accepted)
        if len(entry.recent) < cfg.adapt_window:
            return
        mean = sum(entry.recent) / len(entry.recent)
        # A small budget cannot reach a large mean: its bar to grow is budget / 2.
        grow_at = max(cfg.shrink_below, min(cfg.grow_at_least, entry.budget / 2))
        if mean < cfg.shrink_below:
            entry.budget //= 2
        elif mean >= grow_at and entry.budget < cfg.draft_budget:
            entry.budget = min(cfg.draft_budget, 2 * entry.budget)
        else:
            return
        entry.recent.clear()
        entry.idle_steps = 0

    def _entry(self, rid: int) -> _Adaptive:
        entry = self._requests.get(rid)
        if entry is None:
            raise KeyError(f"request {rid} has no speculation statistics; add() it first")
        return entry
