"""The shell's speculative step: propose draft trees, verify them in one forward pass, and
commit the accepted paths through the state core's verify transition."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import state
from engine.model.sampling import filter_tensors, greedy_tokens, needs_filter, probs_for_verify
from engine.shell.config import EngineConfig
from engine.spec import (
    AcceptanceStats,
    NgramProposer,
    PassCost,
    SpecConfig,
    SpecStats,
    request_rng,
    verify_greedy,
    verify_sampling,
)
from engine.state import Running

if TYPE_CHECKING:
    from engine.shell.engine import Engine
    from engine.shell.runtime import Runtime


class Speculator:
    """Per-request proposer state, acceptance statistics and verify generators."""

    def __init__(self, runtime: Runtime, config: EngineConfig) -> None:
        self.runtime = runtime
        self.config = SpecConfig(draft_budget=config.draft_budget, draft_cost=config.draft_cost)
        self.proposer = NgramProposer(self.config)
        self.stats = SpecStats(self.config)
        self.cost = PassCost()  # what a draft row costs here, from the passes below
        self.last_draft_cost = 0.0  # measured (or configured) at the last verify pass's batch
        self._rngs: dict[int, np.random.Generator] = {}

    # --- request lifetime (history must end with the pending token) ---------------------------
    def add_request(self, uid: int, all_ids: list[int], timing_free: bool = False) -> None:
        """`timing_free`: a seeded sampling request (its budgets must not follow timings:
        `SpecStats`)."""
        if uid in self.proposer:  # re-admitted after a retraction: history is current
            return
        self.proposer.add_request(uid, all_ids)
        self.stats.add(uid, timing_free)

    def extend(self, uid: int, tokens: list[int]) -> None:
        if uid in self.proposer:
            self.proposer.extend(uid, tokens)

    def remove(self, uid: int) -> AcceptanceStats:
        """Forget a finished request; returns its acceptance statistics (none if it never
        ran)."""
        stats = AcceptanceStats()
        if uid in self.proposer:
            stats = self.stats.request(uid)
            self.proposer.remove(uid)
            self.stats.remove(uid)
        self._rngs.pop(uid, None)
        return stats

    # --- one verify step -----------------------------------------------------------------------
    def budgets(self, running: Running) -> np.ndarray:
        """Adaptive budget, cut so the tree fits the context and the tokens still allowed."""
        adaptive = np.array([self.stats.budget(int(u)) for u in running.rids], dtype=np.int64)
        room_context = running.max_context - running.kv_lens.lens - 1
        room_output = running.rules.max_new - running.num_output - 1
        return np.clip(np.minimum(adaptive, np.minimum(room_context, room_output)), 0, None)

    def draft_cost(self, batch: int) -> float:
        """A draft row's time in decoded tokens' time at this batch size (config, or measured)."""
        fixed = self.config.draft_cost
        return self.cost.draft_cost(batch) if fixed is None else fixed

    def run_verify(self, engine: Engine) -> str:
        started = time.perf_counter()
        running = engine.running
        uids = running.rids.tolist()
        # The batch's drafts fit the pool's free slots (a plan's held slots count: a verify
        # pass drops the plan), handed out in batch order: admission order, a request back
        # from retraction last. A tree that did not fit would make the step retract a request
        # (or finish one alone in the pool) where a decode pass lets it go on.
        free = engine.book.slots.num_free + engine.ahead.num_held
        trees = self.proposer.propose_batch(
            uids, self.budgets(running).tolist(), total_drafts=max(free - len(running), 0)
        )
        if trees.sizes.total == len(running):
            # Nothing drafted anywhere: a root-only verify is a decode, and the decode pass
            # is cheaper (its graphs are not sized for draft trees). It may have been planned
            # during the last pass (PlanAhead). The statistics are recorded while the pass
            # runs: after its launch, so a step that retracts instead records nothing.
            mode = engine._decode_step(
                during=lambda: self.stats.record_batch(
                    uids, trees, np.zeros(len(running), np.int64)
                )
            )
            if mode == "decode":
                self._observe(len(running), started)
            return mode
        engine.ahead.drop()  # a pass planned as a decode: its slots go to the verify pass
        if not engine._reserve(lambda: trees.sizes.total):
            return "retract"
        batch = state.schedule_verify(running, trees, engine.book.slots.alloc(trees.sizes.total))
        logits = engine._forward(batch)
        # The costs depend on earlier passes only: fitted while this one runs on a device
        self.last_draft_cost = self.draft_cost(len(running))
        # (0 with a configured cost: the passes are not timed then, and nothing is fitted)
        premium = self.cost.verify_premium(len(running))
        outcome = self._verify(batch, uids, [engine.requests[u].params for u in uids], logits)
        self.stats.record_batch(
            uids, trees, outcome.accepted_lens.lens, self.last_draft_cost, premium
        )
        engine._commit(
            state.verify(batch, outcome.accepted_lens, outcome.accepted_nodes, outcome.bonus)
        )
        # timed as the decode step: propose to commit
        self._observe(trees.sizes.total, started, verify=True)
        return "verify"

    def _observe(self, rows: int, started: float, verify: bool = False) -> None:
        """Fit the pass's time, unless the cost is fixed (configured, or not adapting)."""
        if self.config.draft_cost is None and self.config.adaptive:
            self.cost.observe(rows, time.perf_counter() - started, verify)

    def _verify(
        self, batch: state.Batch, uids: list[int], params: list, logits: torch.Tensor
    ) -> Any:
        trees = batch.trees
        if all(p.greedy for p in params):
            return verify_greedy(trees, greedy_tokens(logits))
        # One row of filters per request, repeated over its tree's nodes on the device.
        sizes = trees.sizes.lens_to(logits.device)
        filters = [
            t.repeat_interleave(sizes, output_size=trees.sizes.total)
            for t in filter_tensors(params, self.runtime.vocab_size, logits.device)
        ]
        probs = probs_for_verify(
            logits, *filters, filtered=needs_filter(params, self.runtime.vocab_size)
        )
        rngs = [self._rng(u, p.seed) for u, p in zip(uids, params, strict=True)]
        return verify_sampling(trees, probs, rngs)

    def _rng(self, uid: int, seed: int | None) -> np.random.Generator:
        if uid not in self._rngs:
            self._rngs[uid] = request_rng(uid, seed)
        return self._rngs[uid]

    def stats_dict(self) -> dict[str, Any]:
        total = self.stats.total()
        return dict(
            spec_steps_total=total.steps,
            spec_draft_tokens_total=total.drafted,
            spec_accepted_tokens_total=total.accepted,
            spec_mean_accepted=total.mean_accepted,
            spec_draft_cost=self.last_draft_cost,
            spec_accepted_histogram=list(total.histogram),
        )
