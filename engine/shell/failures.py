"""What a failed pass leaves behind: the pass's own requests, failed; nothing else.

`OpenPass` is a pass whose slots are handed out and not yet committed: the engine opens one
around every forward pass, and every way out of it either commits the pass or gives its
slots back (`state.abandon`). A failure then surfaces as `PassFailed`, naming the requests of
that pass, which the engine finishes with `FinishReason.ERROR` while the others go on.
`Faults` is a test tool that makes the Nth call at a named point raise; `Health` counts
failures in a row.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from engine import state

FAULT_POINTS = ("forward", "sample", "verify", "commit")
UNHEALTHY_AFTER = 3  # passes failed in a row that mark the engine unhealthy


class PassFailed(RuntimeError):
    """A pass failed; its slots are back in the pool. `uids`: the requests it was running."""

    def __init__(self, uids: np.ndarray, cause: BaseException) -> None:
        super().__init__(f"a pass of {len(uids)} requests failed: {describe(cause)}")
        self.uids = uids
        self.cause = cause


class InjectedFault(RuntimeError):
    """Raised by `Faults` where a test asked for a failure."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@attrs.define
class OpenPass:
    """A pass between the hand-out of its slots and its commit. `table_written`: its table
    writes may have been applied early (`PlanAhead`); `committed`: its effects are applied,
    so its slots belong to its requests now."""

    batch: state.Batch
    table_written: bool = False
    committed: bool = False

    def abandon(self, machine: Any = state) -> state.Effects | None:
        """The effects that give the pass's slots back, or None once it is committed.
        `machine`: what the transition is called on (`engine.state`, or a trace recorder)."""
        if self.committed:
            return None
        return machine.abandon(self.batch, written=self.table_written)


@attrs.define
class Faults:
    """Test tool: `Faults.at(forward=[3], verify=[1, 2])` makes the 3rd forward and the 1st
    and 2nd verify walks raise `InjectedFault` (calls counted from 1 at each point)."""

    plan: dict[str, frozenset[int]]
    calls: collections.Counter = attrs.field(factory=collections.Counter)

    @classmethod
    def at(cls, **calls: Iterable[int]) -> Faults:
        unknown = sorted(set(calls) - set(FAULT_POINTS))
        if unknown:
            raise ValueError(f"fault points {unknown} are unknown; choose from {FAULT_POINTS}")
        return cls({point: frozenset(numbers) for point, numbers in calls.items()})

    def hit(self, point: str) -> None:
        self.calls[point] += 1
        if self.calls[point] in self.plan.get(point, ()):
            raise InjectedFault(f"injected fault at {point} call {self.calls[point]}")


@attrs.define
class Health:
    """Passes failed in a row (a pass that succeeds resets it) and the last failure."""

    failed_in_a_row: int = 0
    failures: int = 0
    last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.failed_in_a_row < UNHEALTHY_AFTER

    def failed(self, error: BaseException) -> None:
        self.failed_in_a_row += 1
        self.failures += 1
        self.last_error = describe(error)

    def succeeded(self) -> None:
        self.failed_in_a_row = 0
