"""The engine's speculative steps: a decode step with speculation, the verify pass and the
passes launched around it (during a decode pass, during a verify pass, at a commit).
`SpeculativeSteps` is `Engine`'s base class, on `DecodeSteps`, in a file of its own so that
each reads in one sitting; it uses the engine's state and helpers (listed in the classes)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine import state
from engine.model.sampling import greedy_tokens
from engine.shell.ahead import root_ids
from engine.shell.decode_steps import DecodeSteps
from engine.shell.failures import OpenPass
from engine.shell.grammar import Grammars
from engine.shell.logits import Launched, VerifyLaunched
from engine.shell.outputs import Outputs
from engine.shell.runner import Prepared
from engine.shell.walk import DeviceWalk
from engine.spec.tree import reroot, with_roots
from engine.state import Mode, Running


class SpeculativeSteps(DecodeSteps):
    """The speculative half of `Engine`'s decode steps."""

    # the engine's state these steps use besides `DecodeSteps`' (`Engine._build` sets them)
    grammars: Grammars
    outputs: Outputs
    requests: dict
    stats: Any

    def _speculative_step(self) -> str:
        """A decode step with speculation: it takes the verify pass launched for it, or
        verifies the drafts proposed now, or decodes where nothing is drafted or a pass
        launched ahead decodes this step (the drafts then wait a step)."""
        assert self.spec is not None
        started = time.perf_counter()
        running, spec = self.running, self.spec
        verify_ahead = self.ahead.take_verify(running)
        if verify_ahead is not None:  # launched at the last step: its launch is this step's
            started -= verify_ahead.verify_launched().seconds
            return self._verify_step(None, started, verify_ahead)
        # Drafts fit the pool's free slots (a plan's held slots count: a verify pass drops
        # the plan), handed out in batch order. A tree that did not fit would make the step
        # retract a request (or finish one alone in the pool) where a decode pass goes on.
        # Where a pass launched ahead decodes this step, drafts found now wait for the next
        # step, which proposes again: whether any request drafts is all this step needs
        # (a probe), unless the verify pass after this one may be launched on them.
        waits = self.ahead.launched and not self._verifies_ahead()
        trees = spec.propose(running, self.book.num_available + self.ahead.num_held, waits)
        if trees is not None:  # None: nothing drafted (most steps of free text)
            trees = self.grammars.prune(trees, running.rids.tolist())  # drafts grammars allow
            if trees.sizes.total == len(running):
                trees = None  # the grammars cut every draft
        if trees is not None and not self.ahead.launched:
            return self._verify_step(trees, started)
        if trees is not None:  # a pass launched ahead decodes this step; the drafts wait
            self.stats["drafts_deferred"] += 1
        # Nothing drafted: a root-only verify is a decode, and the decode pass is cheaper
        # (it may have been planned during the last pass). The statistics are recorded while
        # it runs: after its launch, so a step that retracts instead records nothing. The
        # next pass is launched ahead only where nothing waits to be verified.
        mode = self._decode_step(
            during=lambda: spec.record_idle(running.rids, drafted=trees is not None),
            launch_next=trees is None,
            drafts=trees,
        )
        if mode == "decode":  # a verify pass launched at its commit is the next step's
            spec.observe(len(running), started + self._verify_launched_seconds())
        return mode

    def _verify_step(
        self, trees: state.DraftTrees | None, started: float, ahead: Prepared | None = None
    ) -> str:
        """Verify `trees`; or, with `ahead`, the verify pass launched at the last step: at its
        commit (`_launch_next`), or during its pass (`_verify_ahead`: its trees' roots are
        known now)."""
        assert self.spec is not None
        running = self.running
        launched = None if ahead is None else ahead.verify_launched()
        if ahead is None:
            assert trees is not None
            self.ahead.drop()  # a pass planned as a decode: its slots go to the verify pass
            if not self._reserve(lambda: trees.sizes.total):
                return "retract"
            running = self.running
            slots = self.book.alloc(trees.sizes.total)
            batch = self.machine.schedule_verify(running, trees, slots)
        elif ahead.batch.running is running:  # planned at the last commit (`_launch_next`)
            batch = ahead.batch
        else:  # planned during the last pass (`_verify_ahead`): its roots are known now
            assert ahead.batch.trees is not None and launched is not None  # a verify pass's
            trees = with_roots(ahead.batch.trees, running.last_tokens)
            self.stats["verify_ahead_guesses"] += int((launched.guesses >= 0).sum())
            self.stats["verify_ahead_guesses_missed"] += int(launched.missed(trees).sum())
            batch = self.machine.schedule_verify(running, trees, ahead.batch.out_slots)
        trees = batch.trees
        assert trees is not None
        with self._open(batch) as open_pass:
            uids = running.rids.tolist()
            params = [self.requests[u].params for u in uids]
            forward = self.passes.forward(batch) if launched is None else launched.logits
            # all greedy with a grammar among them: the argmax along each tree's accepted path
            # is checked against its grammar, no node masked first (`Grammars.verify_paths`)
            greedy = all(p.greedy for p in params)
            checked = greedy and self.grammars.constrains(uids)
            masks = None if checked else self.logits.start_tree(trees, uids)
            logits = self.logits.edit_tree(forward, trees, uids, self.outputs.edited_uids)
            self.passes.hit("verify")
            self._plan_after_verify(open_pass)  # while the device runs it
            walk = self._walk_ahead(open_pass, logits, greedy)
            if walk is not None:  # the walk's argmax, read on the host
                target = walk.target()
                outcome = self.spec.verify(batch, params, target)
            elif checked:  # read on the host here; otherwise the speculator's walk reads it
                argmax = greedy_tokens(logits).cpu().numpy()
                target = self.grammars.verify_paths(trees, uids, argmax, logits)
                outcome = self.spec.verify(batch, params, target)
            else:
                masked = self.logits.constrain_tree(logits, masks)
                outcome = self.spec.verify(batch, params, masked)
            pending = self.logits.tree_logprobs(
                logits,
                trees,
                uids,
                outcome.accepted_lens.lens,
                outcome.accepted_nodes,
                outcome.bonus,
                self.outputs.logprob_uids,
            )
            self.passes.logprobs = None if pending is None else pending.host()
            recorded = trees
            if launched is not None:  # drafts that were for another token: not the proposer's
                recorded = launched.recorded(trees, outcome.accepted_lens.lens)
            self.spec.record(uids, recorded, outcome.accepted_lens.lens)
            if walk is not None:  # (before the transition: its effects are applied next)
                self._confirm_walk(walk, outcome, target)
            result = self.machine.verify(
                batch, outcome.accepted_lens, outcome.accepted_nodes, outcome.bonus
            )
            self._commit_pass(open_pass, result, launch_next=True)
        # a plan made during the pass stays only where it fits: nobody may be left to drop it
        self.ahead.fit(self.running)
        # propose to commit, and to the next pass's launch where made here (a decode pass's:
        # its host time, which the device waits for, was the next decode step's and is
        # charged to this one; a verify pass's is the next step's)
        self.spec.observe(trees.sizes.total, started + self._verify_launched_seconds(), verify=True)
        return "verify"

    def _walk_ahead(self, open_pass: OpenPass, logits: Any, greedy: bool) -> DeviceWalk | None:
        """Where the decode pass after verify pass `open_pass` was planned during it
        (`_plan_after_verify`) to replay a graph, every request is `greedy`, none has a
        grammar, a bias or penalties, and the speculator allows it (`Speculator.may_walk`:
        drafts the next step finds wait for the launched pass, so not within a run of
        copied text), walk the trees' best paths on the device (`DeviceWalk`) and launch
        that pass at once, moved on by the drafts accepted there; its input ids are the
        argmax after them. Returns the walk (None: nothing launched)."""
        prepared, running = self.ahead.prepared, open_pass.batch.running
        assert self.spec is not None
        if (
            not self.config.walk_ahead
            or prepared is None
            or prepared.launched is not None
            or prepared.batch.mode != Mode.DECODE
            or prepared.runner is None  # an eager plan's kv indices are built already
            or not greedy
            or not self._launches_before_outputs(running)
            or not self.spec.may_walk(running.rids.tolist())
        ):
            return None
        # (where the pass fails from here, its requests end and their rows are cleared)
        walk = DeviceWalk.launch(logits, open_pass.batch, self.book.table)
        self.ahead.launch(
            lambda p: self.passes.launch(p.batch, p, walk.ids, ahead=True, shift=walk.shift)
        )
        self.stats["walks_ahead"] += 1
        return walk

    def _confirm_walk(self, walk: DeviceWalk, outcome: Any, target: np.ndarray) -> None:
        """The host's walk `outcome` (of `target`, the argmax it read) against the device's
        (`_walk_ahead`): where they accepted the same drafts, the launched decode pass is
        laid out for them; otherwise it is dropped, and what the device wrote past the
        accepted paths is cleared."""
        accepted = walk.confirmed(outcome, target)
        if accepted is None:
            self.ahead.drop()
            self.book.apply(walk.cleared(outcome.accepted_lens.lens))
            self.stats["walks_ahead_dropped"] += 1
            return
        held = self.ahead.prepared
        assert held is not None and self.spec is not None
        self.spec.walked(walk.batch.running.rids.tolist())
        following = self.machine.assume_decoded(walk.batch, accepted)
        self.ahead.relayout(self.machine.schedule_decode(following, held.batch.out_slots))

    def _verify_launched_seconds(self) -> float:
        """The host time of the launch of the verify pass held for the next step (0 without
        one): the next step's cost, not this one's (`spec.observe`)."""
        launched = None if self.ahead.prepared is None else self.ahead.prepared.launched
        return launched.seconds if isinstance(launched, VerifyLaunched) else 0.0

    def _verify_ahead(
        self, open_pass: OpenPass, launched: Launched, drafts: state.DraftTrees
    ) -> bool:
        """Where drafts wait for decode pass `open_pass` (launched ahead: its tokens stay on
        the device), plan and launch the verify pass after it now: each tree's subtree under
        its root's best child (`tree.reroot`: the drafts the next step would propose if
        this pass samples that child), rooted at the token this pass samples, copied on the
        device. Where the guess was wrong the pass still yields the token after that one.
        The next step takes it (`_run_decode`), as `_decode_step` takes a decode pass
        launched ahead; where requests come or leave first it is dropped (`PlanAhead.fit`).
        Not where a row has a grammar (its tree is pruned after its tokens), a bias or
        penalties (edited by the history), or where no draft is left below the guesses.
        Returns whether it was launched (else the decode pass after this one is planned)."""
        sampled = launched.sampled
        if (
            not self._verifies_ahead()
            or sampled is None
            or not self._launches_before_outputs(open_pass.batch.running)
        ):
            return False
        trees, guesses = reroot(drafts)
        if trees.sizes.total == len(trees.sizes):
            return False  # roots alone: a decode pass
        open_pass.table_written = True  # until the plan says otherwise: undone if it fails
        open_pass.table_written = self.ahead.plan(open_pass.batch, trees)
        if not open_pass.table_written:
            return False

        def launcher(prepared: Prepared) -> VerifyLaunched:
            batch = prepared.batch
            ids = root_ids(batch, sampled.tokens)
            return VerifyLaunched(self.passes.forward(batch, prepared, ids), guesses)

        self.ahead.launch(launcher)
        self.stats["verify_launched_ahead"] += 1
        return True

    def _plan_after_verify(self, open_pass: OpenPass) -> None:
        """Where the device runs apart from the host (`launch_ahead`), plan the decode pass
        after verify pass `open_pass` while the device runs it, for the outcome in which no
        request accepts a draft (`state.assume_decoded`); applies the roots' table writes
        (every outcome makes them) first. The step after a verify pass whose drafts all
        failed (chat's most common verify step) is then a decode pass that launches at once
        rather than planning first; any other outcome drops the plan (`PlanAhead.fit`: the
        committed lengths differ). Where the next step surely decodes it is launched once the
        verify pass is committed (`_launch_next`), its input ids the walk's bonus
        tokens. Not planned where the next step changes the batch anyway."""
        if not (self.launch_ahead and self._batch_stays()):
            return
        open_pass.table_written = True  # until the plan says otherwise: undone if it fails
        open_pass.table_written = self.ahead.plan(open_pass.batch)

    def _launch_next(self, verify: bool) -> None:
        """Where the device runs apart from the host (`launch_ahead`), launch the pass after
        a speculative step's as soon as that step's pass is committed, where nothing was
        launched for it yet and nothing waits to be admitted: with `verify`
        (`verify_at_commit`) and drafts the proposer makes now (the histories are complete:
        `_apply`), the verify pass of them; otherwise, where no request will draft
        (`Speculator.will_draft`) or the proposer drafted nothing, the decode pass (the plan
        made during the pass where it fits, `_plan_after_verify`, `_prepare_next`; else
        planned here, its input ids the committed tokens). The next step takes it as a pass
        launched ahead (`_run_decode`, `_decode_step`); requests that leave before then are
        cut from a decode pass and drop a verify pass (`PlanAhead.fit`). Where the pool has
        no room for it, the next step reserves as usual. The host time of a verify pass's
        launch is charged to the step that takes it (`VerifyLaunched.seconds`)."""
        running, ahead = self.running, self.ahead
        if ahead.launched:  # during the pass (`launch_ahead`, `verify_ahead`)
            return
        if not (self.launch_ahead and len(running) and self._batch_stays()):
            return
        ahead.fit(running)  # a plan made during the pass stays only where it fits
        assert self.spec is not None
        if verify:  # `propose` asks the proposer only where `will_draft` would say so
            started = time.perf_counter()
            trees = self.spec.propose(running, self.book.num_available + ahead.num_held)
            if trees is not None:
                ahead.drop()  # a decode plan: its slots go to the verify pass
                if ahead.plan_committed(running, trees):
                    unguessed = np.full(len(running), -1, dtype=np.int64)
                    ahead.launch(  # the seconds: propose to launch, read after the forward
                        lambda p: VerifyLaunched(
                            self.passes.forward(p.batch, p),
                            unguessed,
                            time.perf_counter() - started,
                        )
                    )
                    self.stats["verify_launched_at_commit"] += 1
                return
        elif self.spec.will_draft(running):
            return  # the next step proposes
        held = ahead.prepared
        if held is None:  # planned here, of the committed tokens
            if not ahead.plan_committed(running):
                return
        else:
            # the committed tokens: a plan made during the pass holds older ones; the pass so
            # scheduled takes the plan's slots, and is the one given up if the launch fails
            ahead.rebatch(self.machine.schedule_decode(running, held.batch.out_slots))
        ahead.launch(lambda p: self.passes.launch(p.batch, p))

    def _verifies_ahead(self) -> bool:
        """Whether a step whose drafts wait may launch the verify pass on them after its
        decode pass (`_verify_ahead`): `verify_ahead`, with passes launched ahead."""
        return self.config.verify_ahead and self.launch_ahead

    def _launches_before_outputs(self, running: Running | None = None) -> bool:
        """Whether the next pass of `running` (default: the running requests) may launch
        before the last pass's outputs reach them: none has a grammar (its state advances
        with them), a bias or penalties (their counts)."""
        if not self.grammars and not self.outputs.edited_uids:  # most steps: nobody has any
            return True
        uids = (self.running if running is None else running).rids.tolist()
        return not self.grammars.constrains(uids) and self.outputs.edited_uids.isdisjoint(uids)
