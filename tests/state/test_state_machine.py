"""Model-based test: KVBook + the pure transitions, driven by random events, against a
plain-Python reference (dicts and lists) under a tiny KV pool."""

from __future__ import annotations

import attrs
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from state_builders import (
    VOCAB,
    Rule,
    SnapshotRecorder,
    check_totals,
    finish_rules,
    path_to,
    ref_finish,
    rules_strategy,
    tree_lists,
)

from engine import state
from engine.shell.kv import KVBook
from engine.shell.slots import OutOfSlots
from engine.state import DraftTrees, FinishReason, Running

MAX_CONTEXT = 40
tokens_st = st.integers(0, VOCAB - 1)


@attrs.define
class RefRequest:
    tokens: list[int]  # prompt + outputs
    prompt_len: int
    rule: Rule
    slots: list[int] = attrs.Factory(list)  # slots[p] holds the KV of position p


class StateCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book: KVBook | None = None

    @initialize(capacity=st.integers(24, 48), num_rows=st.integers(2, 6))
    def setup(self, capacity: int, num_rows: int) -> None:
        self.book = KVBook(capacity, num_rows, MAX_CONTEXT)
        self.running = Running.empty(MAX_CONTEXT)
        self.ref: dict[int, RefRequest] = {}
        self.ref_free = set(range(1, capacity + 1))
        self.ref_finished: dict[int, FinishReason] = {}
        self.waiting: list[int] = []
        self.history: dict[int, list[int]] = {}  # what the effects told the shell
        self.finished: dict[int, FinishReason] = {}
        self.recorder = SnapshotRecorder()
        self.recorder.record(self.running)
        self.plan: state.Batch | None = None  # a decode pass planned ahead (decode_ahead)

    # --- helpers ----------------------------------------------------------------------------
    def _ready(self, pending: int) -> np.ndarray:
        lens = self.running.pending_lens
        return np.flatnonzero(lens == 1) if pending == 1 else np.flatnonzero(lens > 1)

    def _split(self, indices: np.ndarray) -> tuple[Running, Running]:
        rest = np.setdiff1d(np.arange(len(self.running)), indices)
        return self.running.select(indices), self.running.select(rest)

    def _alloc(self, count: int) -> np.ndarray | None:
        """Slots from the allocator; under pressure, retract the newest request instead."""
        try:
            slots = self.book.slots.alloc(count)
        except OutOfSlots:
            newest = int(np.argmax(self.running.rids))
            alone = len(self.running) == 1  # too big for the pool: it can never finish
            self._leave([newest], FinishReason.LENGTH if alone else None)
            return None
        return self._take(slots)

    def _take(self, slots: np.ndarray) -> np.ndarray:
        """Slots the allocator handed out: the reference must have had them free."""
        assert set(slots.tolist()) <= self.ref_free, "allocator handed out a used slot"
        self.ref_free -= set(slots.tolist())
        return slots

    def _drop_plan(self) -> None:
        """The engine drops a plan made ahead once the batch changes: its slots go back."""
        if self.plan is not None:
            self.book.apply(state.abandon(self.plan))
            self.ref_free |= set(self.plan.out_slots.tolist())
            self.plan = None

    def _apply(self, effects: state.Effects, table_written: bool = False) -> None:
        self.book.apply(effects, table_written)
        for rid, tokens in effects.emitted().items():
            self.history[rid].extend(tokens)
        self.finished.update(effects.finished())
        self.recorder.record(effects, self.running)

    def _leave(self, indices: list[int], reason: FinishReason | None) -> None:
        """Retract (reason None) / finish / abort: the reference frees the leavers' slots."""
        rids = self.running.rids[indices].tolist()
        if reason is None:
            result = state.retract(self.running, indices)
            assert result.effects.retracted_rids.tolist() == rids
            self.waiting.extend(rids)
        else:
            result = state.finish(self.running, indices, reason)
            self.ref_finished.update(dict.fromkeys(rids, reason))
        for rid in rids:
            self._ref_release(rid)
        self.running = result.running
        self._apply(result.effects)

    def _ref_release(self, rid: int) -> None:
        request = self.ref[rid]
        self.ref_free |= set(request.slots)
        request.slots = []

    def _ref_emit(self, rid: int, tokens: list[int]) -> None:
        request = self.ref[rid]
        kept, reason = ref_finish(
            tokens,
            request.rule,
            len(request.tokens) - request.prompt_len,
            len(request.tokens),
            MAX_CONTEXT,
        )
        request.tokens.extend(tokens[:kept])
        if reason != FinishReason.NONE:
            self.ref_finished[rid] = reason
            self._ref_release(rid)

    def _commit(self, result: state.Result, rest: Running) -> None:
        self.recorder.record(result.running)  # before merge, which recomputes totals
        self.running = state.merge(rest, result.running)
        self._apply(result.effects)

    # --- rules ------------------------------------------------------------------------------
    @precondition(lambda self: self.book is not None and self.book.table.num_free_rows > 0)
    @rule(prompt=st.lists(tokens_st, min_size=1, max_size=12), finish_rule=rules_strategy)
    def add_request(self, prompt: list[int], finish_rule: Rule) -> None:
        self._drop_plan()
        rid = len(self.ref)
        self.ref[rid] = RefRequest(list(prompt), len(prompt), finish_rule)
        self.history[rid] = list(prompt)
        self._admit(rid)

    @precondition(
        lambda self: self.book is not None and self.waiting and self.book.table.num_free_rows > 0
    )
    @rule()
    def readmit(self) -> None:
        """A retracted request comes back with every known token pending and no KV."""
        self._drop_plan()
        self._admit(self.waiting.pop(0))

    def _admit(self, rid: int) -> None:
        request = self.ref[rid]
        row = self.book.table.alloc_row()
        entering = Running.admitted(
            [rid],
            [row],
            [len(request.tokens)],
            [request.prompt_len],
            [request.tokens[-1]],
            finish_rules([request.rule]),
            MAX_CONTEXT,
        )
        self.running = state.merge(self.running, entering)
        self.recorder.record(entering, self.running)

    @precondition(lambda self: self.book is not None and len(self.running) > 0)
    @rule(chunk_size=st.integers(1, 16), data=st.data())
    def step(self, chunk_size: int, data: st.DataObject) -> None:
        """Extend chunks for requests with more than one pending token, else decode all."""
        self._drop_plan()
        todo = self._ready(pending=2)
        if todo.size == 0:
            self.decode(data)
            return
        sub, rest = self._split(todo)
        chunks = np.minimum(sub.pending_lens, chunk_size)
        slots = self._alloc(int(chunks.sum()))
        if slots is None:
            return
        rids = sub.rids.tolist()
        ids = [
            self.ref[r].tokens[kv : kv + n]
            for r, kv, n in zip(rids, sub.kv_lens.tolist(), chunks.tolist(), strict=True)
        ]
        batch = state.schedule_extend(sub, chunks, np.concatenate(ids), slots)
        self.recorder.record(batch)
        sampled = data.draw(
            st.lists(
                tokens_st, min_size=int(batch.samples.sum()), max_size=int(batch.samples.sum())
            )
        )
        result = state.extend(batch, sampled)
        draws = iter(sampled)
        for rid, own, samples in zip(
            rids, np.split(slots, np.cumsum(chunks)[:-1]), batch.samples.tolist(), strict=True
        ):
            self.ref[rid].slots.extend(own.tolist())
            if samples:
                self._ref_emit(rid, [next(draws)])
        self._commit(result, rest)

    @precondition(lambda self: self.book is not None and len(self.running) > 0)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        self._drop_plan()
        todo = self._ready(pending=1)
        if todo.size == 0:
            return
        sub, rest = self._split(todo)
        slots = self._alloc(len(sub))
        if slots is None:
            return
        batch = state.schedule_decode(sub, slots)
        self.recorder.record(batch)
        self._commit(self._decoded(batch, data), rest)

    def _decoded(self, batch: state.Batch, data: st.DataObject) -> state.Result:
        """Draw the pass's tokens, run the decode transition, and update the reference."""
        count = len(batch.running)
        sampled = data.draw(st.lists(tokens_st, min_size=count, max_size=count))
        result = state.decode(batch, sampled)
        for rid, slot, token in zip(
            batch.running.rids.tolist(), batch.out_slots.tolist(), sampled, strict=True
        ):
            self.ref[rid].slots.append(slot)
            self._ref_emit(rid, [token])
        return result

    @precondition(lambda self: self.book is not None and len(self.running) > 0)
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        self._drop_plan()
        todo = self._ready(pending=1)
        if todo.size == 0:
            return
        sub, rest = self._split(todo)
        trees = [data.draw(tree_lists(int(root), max_size=6)) for root in sub.last_tokens]
        draft = DraftTrees.from_lists([t for t, _ in trees], [p for _, p in trees])
        slots = self._alloc(draft.sizes.total)
        if slots is None:
            return
        batch = state.schedule_verify(sub, draft, slots)
        self.recorder.record(batch)
        paths = [path_to(p, data.draw(st.integers(0, len(p) - 1))) for _, p in trees]
        bonus = data.draw(st.lists(tokens_st, min_size=len(sub), max_size=len(sub)))
        nodes = np.array([n for path in paths for n in path], dtype=np.int64)
        result = state.verify(batch, [len(p) for p in paths], nodes, bonus)
        own_slots = np.split(slots, draft.sizes.indptr()[1:-1])
        for rid, (tokens, _), path, own, extra in zip(
            sub.rids.tolist(), trees, paths, own_slots, bonus, strict=True
        ):
            accepted = set([0, *path])
            self.ref[rid].slots.extend(own[[0, *path]].tolist())
            self.ref_free |= {s for n, s in enumerate(own.tolist()) if n not in accepted}
            self._ref_emit(rid, [tokens[n] for n in path] + [extra])
        self._commit(result, rest)

    @precondition(lambda self: self.book is not None and len(self.running) > 0)
    @rule(rounds=st.integers(1, 4), data=st.data())
    def decode_ahead(self, rounds: int, data: st.DataObject) -> None:
        """The engine's plan_ahead: decodes of every request, during each of which the next
        decode is planned (its table entries written early, the next slots taken as if
        nobody finished). The plan is held across rules and used only if the committed
        Running has the same layout; any other rule drops it."""
        for _ in range(rounds):
            if len(self.running):
                self._decode_ahead_once(data)

    def _decode_ahead_once(self, data: st.DataObject) -> None:
        if self._ready(pending=2).size:  # someone is still prefilling: the engine extends
            self._drop_plan()
            return
        plan, self.plan = self.plan, None
        if plan is not None and state.same_layout(plan.running, self.running):
            batch = state.schedule_decode(self.running, plan.out_slots)
        else:
            self.plan = plan
            self._drop_plan()
            slots = self._alloc(len(self.running))
            if slots is None:
                return
            batch = state.schedule_decode(self.running, slots)
        self.recorder.record(batch)
        following = state.assume_decoded(batch)
        written = self.book.slots.num_free >= len(following)
        if written:
            self.book.apply(state.decode_writes(batch))
            slots = self._take(self.book.slots.alloc(len(following)))
            self.plan = state.schedule_decode(following, slots)
            self.recorder.record(self.plan)
        result = self._decoded(batch, data)
        self.recorder.record(result.running)
        self.running = result.running
        self._apply(result.effects, table_written=written)
        if self.plan is not None and not state.same_layout(self.plan.running, self.running):
            self._drop_plan()

    @precondition(lambda self: self.book is not None and len(self.running) > 0)
    @rule(data=st.data())
    def retract(self, data: st.DataObject) -> None:
        self._drop_plan()
        self._leave([data.draw(st.integers(0, len(self.running) - 1))], None)

    @precondition(lambda self: self.book is not None and len(self.running) > 0)
    @rule(
        data=st.data(),
        reason=st.sampled_from([FinishReason.ABORT, FinishReason.LENGTH, FinishReason.STOP]),
    )
    def finish(self, data: st.DataObject, reason: FinishReason) -> None:
        """Abort, finish by length, or a stop string matched by the shell."""
        self._drop_plan()
        indices = data.draw(
            st.lists(st.integers(0, len(self.running) - 1), min_size=1, max_size=3, unique=True)
        )
        self._leave(indices, reason)

    # --- invariants -------------------------------------------------------------------------
    @invariant()
    def snapshots_and_totals(self) -> None:
        if self.book is None:
            return
        self.recorder.check()
        check_totals(self.running)

    @invariant()
    def slots_conserved_and_rows_exact(self) -> None:
        if self.book is None:
            return
        self.book.check(self.running, None if self.plan is None else self.plan.out_slots)
        assert set(self.book.slots.free_slots().tolist()) == self.ref_free
        run = self.running
        assert sorted(run.rids.tolist()) == sorted(
            r for r in self.ref if r not in self.ref_finished and r not in self.waiting
        )
        for rid, row, kv, token_len, prompt_len, last in zip(
            run.rids.tolist(),
            run.rows.tolist(),
            run.kv_lens.tolist(),
            run.token_lens.tolist(),
            run.prompt_lens.tolist(),
            run.last_tokens.tolist(),
            strict=True,
        ):
            request = self.ref[rid]
            assert (kv, token_len, prompt_len, last) == (
                len(request.slots),
                len(request.tokens),
                request.prompt_len,
                request.tokens[-1],
            )
            assert self.book.table.host[row, :kv].tolist() == request.slots
            assert not self.book.table.host[row, kv:].any(), "stale slots past the row's length"

    @invariant()
    def committed_tokens_match(self) -> None:
        if self.book is None:
            return
        assert self.history == {rid: r.tokens for rid, r in self.ref.items()}
        assert self.finished == self.ref_finished

    def teardown(self) -> None:
        if self.book is None:
            return
        self._drop_plan()
        self._leave(list(range(len(self.running))), FinishReason.ABORT)
        assert len(self.running) == 0
        assert self.book.slots.num_free == self.book.slots.capacity
        assert self.book.table.num_free_rows == self.book.table.host.shape[0]
        assert not self.book.table.host.any()
        assert self.ref_free == set(range(1, self.book.slots.capacity + 1))


StateCoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStateCore = StateCoreMachine.TestCase
