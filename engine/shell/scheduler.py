"""Scheduling policy: which requests run next and how many tokens each computes.

Pure functions over the `Running` snapshot and the waiting queue's sizes; the Engine applies
the decisions. Prefill first (FCFS, chunked under a token budget), then decode or verify.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy as np

from engine.state import Running


@attrs.frozen
class ExtendPlan:
    """Requests (indices into running) that compute the next chunk of their pending tokens."""

    indices: np.ndarray
    chunk_lens: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.chunk_lens.sum())


def plan_extend(running: Running, token_budget: int) -> ExtendPlan | None:
    """Chunks for requests with more than one pending token, in batch order, under budget.

    A chunk that leaves exactly one pending token is completed by the next decode step, so
    the batch never needs a separate "last chunk" path.
    """
    pending = running.pending_lens
    candidates = np.flatnonzero(pending > 1)
    if candidates.size == 0:
        return None
    wanted = pending[candidates]
    before = np.concatenate([[0], np.cumsum(wanted)[:-1]])
    chunk = np.clip(token_budget - before, 0, wanted)
    take = chunk > 0
    return ExtendPlan(candidates[take], chunk[take])


def count_admissible(
    pending_tokens: Iterable[int],
    free_rows: int,
    free_slots: int,
    reserved_slots: int,
    token_budget: int,
    step_slots: int = 1,
) -> int:
    """How many waiting requests (FCFS, a prefix of the queue) to admit now.

    A request is admitted while a row is free and its pending tokens plus its own next step
    (`step_slots`: 1, or 1 + the draft budget) fit in the free slots left after reserving
    `reserved_slots` for the running requests' next steps. Counting its next step keeps a
    request from being admitted only to be retracted again by the decode that follows. The
    first request is admitted even when it exceeds the token budget (it is chunked); later
    ones must fit within it. With nothing running, the first request needs room for its
    tokens and one more only: a request the pool can hold must never wait for room that
    will not come (with speculation its drafts are cut to the slots there are).
    """
    admitted = 0
    room = free_slots - reserved_slots
    budget = token_budget
    for tokens in pending_tokens:
        step = 1 if admitted == 0 and reserved_slots == 0 else step_slots
        if admitted >= free_rows or tokens + step > room or (admitted and tokens > budget):
            break
        admitted += 1
        room -= tokens + step
        budget -= tokens
    return admitted


def newest(uids: np.ndarray) -> int:
    """Index of the most recently submitted request: the first to retract."""
    return int(np.argmax(uids))
