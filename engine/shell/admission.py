"""Admission and its converse: which waiting requests enter the running batch now (rows,
slots and cached prefixes permitting, in FCFS or longest-prefix order), and which running
requests are retracted where a step's pass needs more slots than are free. `Admission` is
`Engine`'s base class, in a file of its own as `SpeculativeSteps` is; it uses the engine's
state (listed in the class)."""

from __future__ import annotations

import collections
import itertools
from typing import Any

import numpy as np

from engine.shell import scheduler
from engine.shell.ahead import PlanAhead
from engine.shell.config import EngineConfig
from engine.shell.kv import KVBook
from engine.shell.radix import Peek
from engine.shell.request import Request
from engine.shell.runtime import Runtime
from engine.shell.speculator import Speculator
from engine.state import FinishReason, FinishRules, Running

ADMIT_WINDOW = 128  # waiting requests one admission considers (and LPM orders), from the front


class Admission:
    """Admission and retraction, `Engine`'s."""

    # the engine's state these use (`Engine._build` sets them)
    config: EngineConfig
    runtime: Runtime
    spec: Speculator | None
    running: Running
    waiting: collections.deque[Request]
    book: KVBook
    ahead: PlanAhead
    requests: dict
    stats: Any
    machine: Any
    max_context: int
    _commit: Any

    def _candidates(self) -> tuple[list[Request], list[Peek] | None]:
        """The first ADMIT_WINDOW waiting requests in the order admission tries them, each
        with its cached prefix (`KVBook.peek`: its length, the evictable slots in it; None
        without the cache) within `Request.cacheable_prefix`. FCFS; or with
        `schedule_policy` 'lpm', longest cached prefix first, those passed over
        `max_waited_out` times before all others."""
        head = list(itertools.islice(self.waiting, ADMIT_WINDOW))
        if self.book.cache is None:
            return head, None
        cache = self.book.cache
        peeks = [cache.peek(r.cacheable_prefix()) for r in head]
        if self.config.schedule_policy == "lpm" and len(head) > 1:
            aged = [r.waited_out >= self.config.max_waited_out for r in head]
            order = scheduler.admission_order([p.length for p in peeks], aged)
            head, peeks = [head[i] for i in order], [peeks[i] for i in order]
        return head, peeks

    def _admissible(self, candidates: Any = None) -> int:
        """How many waiting requests `_admit` takes now (in `_candidates` order). The slots
        of a pass planned ahead count as free: admitting drops that plan."""
        if not self.waiting or not self.book.table.num_free_rows:
            return 0
        order, peeks = candidates if candidates is not None else self._candidates()
        step_slots = 1 + (self.config.draft_budget if self.spec else 0)
        # each running request's pending tokens and its next step after them, as a newcomer
        # counts its own: a prompt still prefilling needs the rest of it
        running = self.running
        reserved = int(running.pending_lens.sum()) + len(running) * (step_slots - 1)
        if peeks is None:
            pending: Any = (r.num_tokens for r in order)
        else:
            pending = (r.num_tokens - p.length for r, p in zip(order, peeks, strict=True))
        return scheduler.count_admissible(
            pending,
            self.book.table.num_free_rows,
            self.book.num_available + self.ahead.num_held,
            reserved,
            self.config.chunk_size,
            step_slots,
            None if peeks is None else (p.num_unlocked for p in peeks),
        )

    def _admit(self) -> None:
        """Admit waiting requests while rows and slots last: each starts with its longest
        cached prefix, locked for it (the one `_candidates` peeked: nothing is cached or
        evicted in between)."""
        candidates = self._candidates()
        count = self._admissible(candidates)
        if count == 0:
            return
        self.ahead.drop()
        order, peeks = candidates
        entering = order[:count]
        if peeks is None:  # no prefix cache
            prefixes = [self.book.acquire(r.uid, r.cacheable_prefix()) for r in entering]
        else:
            prefixes = [
                self.book.acquire(r.uid, p) for r, p in zip(entering, peeks[:count], strict=True)
            ]
        self._note_admitted(entering, prefixes)
        rows = [self.book.table.alloc_row() for _ in entering]
        rules = FinishRules.of(
            [r.params for r in entering], self.runtime.eos_id, self.runtime.more_eos_ids
        )
        admitted = Running.admitted(
            [r.uid for r in entering],
            rows,
            [r.num_tokens for r in entering],
            [len(r.prompt_ids) for r in entering],
            [r.last_token for r in entering],
            rules,
            self.max_context,
            kv_lens=[p.size for p in prefixes],
        )
        self._commit(self.machine.admit(self.running, admitted, np.concatenate(prefixes)))
        if self.spec is not None:
            for r in entering:  # a seeded sampling request's trees must not follow timings
                self.spec.add_request(
                    r.uid, r.all_ids, r.params.seed is not None and not r.params.greedy
                )

    def _note_admitted(self, entering: list[Request], prefixes: list[np.ndarray]) -> None:
        """Take the admitted requests off the queue; count their cache hits, and for each
        request left waiting, the admissions behind it in the queue that went first."""
        admitted = {r.uid for r in entering}
        behind = len(entering)
        for request in self.waiting:
            if request.uid in admitted:
                behind -= 1
            elif behind:
                request.waited_out += behind
        self.waiting = collections.deque(r for r in self.waiting if r.uid not in admitted)
        for request, prefix in zip(entering, prefixes, strict=True):
            if request.cached_tokens is None:
                request.cached_tokens = int(prefix.size)
            self.stats["matched_prompt_tokens_queried"] += request.num_tokens
            self.stats["cached_prompt_tokens"] += int(prefix.size)

    def _reserve(self, tokens_needed: Any) -> bool:
        """Make `tokens_needed()` slots free by retracting the newest requests.

        Returns False when the step's own batch changed (the caller re-plans)."""
        while tokens_needed() > self.book.num_available:
            index = scheduler.newest(self.running.rids)
            request = self.requests[int(self.running.rids[index])]
            if len(self.running) == 1:
                # Alone and still too big for the pool: it can never finish.
                self._commit(self.machine.finish(self.running, [index], FinishReason.LENGTH))
            else:
                self.stats["retractions"] += 1
                self._commit(self.machine.retract(self.running, [index]))
                self.waiting.appendleft(request)
            return False
        return True
