"""Model-based test of speculative steps: the real NgramProposer drafts, the real verify_greedy
checks the drafts against a synthetic target, and the state core + KVBook commit them; outputs
must equal plain sequential greedy decoding of that target."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from state_builders import VOCAB, Rule, check_totals, finish_rules, ref_finish, rules_strategy

from engine import state
from engine.shell.kv import KVBook
from engine.spec import NgramProposer, SpecConfig, verify_greedy
from engine.spec.tree import parent_flat
from engine.state import FinishReason, Running

MAX_CONTEXT = 40
DRAFT_BUDGET = 6
tokens_st = st.integers(0, VOCAB - 1)


class SpecMachine(RuleBasedStateMachine):
    """Requests that only ever speculate (a prefill, then verify steps), with retraction."""

    @initialize(
        capacity=st.integers(MAX_CONTEXT + 8, 96),
        num_rows=st.integers(1, 4),
        table_seed=st.integers(0, 2**16),
    )
    def setup(self, capacity: int, num_rows: int, table_seed: int) -> None:
        # The synthetic target: its next token is a function of the last two (so text repeats
        # and n-gram drafts get accepted), from a small vocabulary.
        self.table = np.random.default_rng(table_seed).integers(0, VOCAB, (VOCAB, VOCAB))
        self.book = KVBook(capacity, num_rows, MAX_CONTEXT)
        self.running = Running.empty(MAX_CONTEXT)
        self.proposer = NgramProposer(
            SpecConfig(draft_budget=DRAFT_BUDGET, max_trie_depth=8, min_match=1, max_match=3)
        )
        self.prompts: dict[int, list[int]] = {}
        self.rules: dict[int, Rule] = {}
        self.tokens: dict[int, list[int]] = {}  # prompt + outputs, as the effects told
        self.waiting: list[int] = []
        self.finished: dict[int, FinishReason] = {}
        self.accepted = 0

    # --- the target and the sequential reference -------------------------------------------
    def _next(self, context: list[int]) -> int:
        previous = context[-2] if len(context) > 1 else 0
        return int(self.table[previous, context[-1]])

    def _reference(self, rid: int) -> tuple[list[int], FinishReason]:
        """Sequential greedy from the prompt, one token at a time, with the finish check."""
        prompt, rule = self.prompts[rid], self.rules[rid]
        tokens = list(prompt)
        while True:
            token = self._next(tokens)
            _, reason = ref_finish(
                [token], rule, len(tokens) - len(prompt), len(tokens), MAX_CONTEXT
            )
            tokens.append(token)
            if reason != FinishReason.NONE:
                return tokens, reason

    # --- helpers ---------------------------------------------------------------------------
    def _apply(self, result: state.Result) -> None:
        effects = result.effects
        check_totals(result.running)
        check_totals(effects)
        self.book.apply(effects)
        for rid, emitted in effects.emitted().items():
            self.tokens[rid].extend(emitted)
            if rid in self.proposer:
                self.proposer.extend(rid, emitted)
        for rid, reason in effects.finished().items():
            self.finished[rid] = reason
            self.proposer.remove(rid)

    def _prefill(self, rid: int) -> None:
        """Admit `rid` (new or retracted) and compute all its known tokens in one pass."""
        known = self.tokens[rid]
        rules = finish_rules([self.rules[rid]])
        entering = Running.admitted(
            [rid],
            [self.book.table.alloc_row()],
            [len(known)],
            [len(self.prompts[rid])],
            [known[-1]],
            rules,
            MAX_CONTEXT,
        )
        batch = state.schedule_extend(
            entering, [len(known)], np.asarray(known), self.book.slots.alloc(len(known))
        )
        check_totals(batch)
        result = state.extend(batch, [self._next(known)])
        self._apply(result)
        self.running = state.merge(self.running, result.running)

    def _retract_newest(self) -> None:
        index = int(np.argmax(self.running.rids))
        result = state.retract(self.running, [index])
        self.waiting.extend(result.effects.retracted_rids.tolist())
        self.running = result.running
        self._apply(result)

    def _target_argmax(self, trees: state.DraftTrees) -> np.ndarray:
        """The target's choice after each tree node, given its request's tokens and path."""
        parents = parent_flat(trees)
        owners = trees.sizes.segment_ids()
        contexts: list[list[int]] = []
        for node in range(trees.sizes.total):
            if parents[node] < 0:
                contexts.append(list(self.tokens[int(self.running.rids[owners[node]])]))
            else:
                contexts.append([*contexts[parents[node]], int(trees.tokens[node])])
        return np.array([self._next(c) for c in contexts], dtype=np.int64)

    # --- rules -----------------------------------------------------------------------------
    @precondition(lambda self: self.book.table.num_free_rows > 0)
    @rule(prompt=st.lists(tokens_st, min_size=1, max_size=12), finish_rule=rules_strategy)
    def add_request(self, prompt: list[int], finish_rule: Rule) -> None:
        rid = len(self.prompts)
        self.prompts[rid], self.rules[rid] = list(prompt), finish_rule
        self.tokens[rid] = list(prompt)
        self.proposer.add_request(rid, prompt)
        if self.book.slots.num_free < len(prompt):
            self.waiting.append(rid)
            return
        self._prefill(rid)

    @precondition(lambda self: self.waiting and self.book.table.num_free_rows > 0)
    @rule()
    def readmit(self) -> None:
        rid = self.waiting[0]
        if self.book.slots.num_free >= len(self.tokens[rid]):
            self.waiting.pop(0)
            self._prefill(rid)

    @precondition(lambda self: len(self.running) > 0)
    @rule(budget=st.integers(0, DRAFT_BUDGET))
    def speculate(self, budget: int) -> None:
        run = self.running
        room = run.max_context - run.kv_lens.lens - 1
        budgets = np.clip(np.minimum(budget, room), 0, None).tolist()
        trees = self.proposer.propose_batch(run.rids.tolist(), budgets)
        assert (trees.sizes.lens <= np.asarray(budgets) + 1).all(), "budget exceeded"
        if trees.sizes.total > self.book.slots.num_free:
            self._retract_newest()
            return
        batch = state.schedule_verify(run, trees, self.book.slots.alloc(trees.sizes.total))
        check_totals(batch)
        outcome = verify_greedy(trees, self._target_argmax(trees))
        self.accepted += outcome.accepted_lens.total
        result = state.verify(batch, outcome.accepted_lens, outcome.accepted_nodes, outcome.bonus)
        self.running = result.running
        self._apply(result)

    @precondition(lambda self: len(self.running) > 0)
    @rule(data=st.data())
    def retract_or_abort(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.running) - 1))
        if data.draw(st.booleans()):
            result = state.retract(self.running, [index])
            self.waiting.extend(result.effects.retracted_rids.tolist())
        else:
            result = state.abort(self.running, [index])
        self.running = result.running
        self._apply(result)

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def slots_conserved(self) -> None:
        if hasattr(self, "book"):
            self.book.check(self.running)
            assert (self.running.pending_lens == 1).all()

    @invariant()
    def outputs_follow_sequential_greedy(self) -> None:
        for rid, tokens in getattr(self, "tokens", {}).items():
            if self.finished.get(rid) == FinishReason.ABORT:
                continue
            expected, reason = self._reference(rid)
            if rid in self.finished:
                assert tokens == expected and self.finished[rid] == reason
            else:
                assert tokens == expected[: len(tokens)]
            if rid in self.proposer:
                assert self.proposer.history(rid) == tokens

    def teardown(self) -> None:
        if not hasattr(self, "book"):
            return
        if len(self.running):
            self.running = self._finish_all()
        assert self.book.slots.num_free == self.book.slots.capacity
        assert self.book.table.num_free_rows == self.book.table.host.shape[0]

    def _finish_all(self) -> Running:
        result = state.abort(self.running, np.arange(len(self.running)))
        self._apply(result)
        return result.running


SpecMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSpecMachine = SpecMachine.TestCase


def test_the_machine_accepts_drafts() -> None:
    """The synthetic target repeats, so a plain run of the machine accepts drafts (otherwise
    the rule above would only ever test root-only trees)."""
    machine = SpecMachine()
    machine.setup(capacity=80, num_rows=2, table_seed=3)
    machine.add_request([1, 2, 3], Rule(max_new=30, min_new=0, eos=-1, stops=()))
    machine.add_request([4, 5], Rule(max_new=25, min_new=0, eos=-1, stops=()))
    for _ in range(12):
        if len(machine.running):
            machine.speculate(DRAFT_BUDGET)
        machine.slots_conserved()
        machine.outputs_follow_sequential_greedy()
    assert machine.accepted > 0
    machine.teardown()
