"""Speculation's per-request state for the engine's step: `propose` draft trees, `verify`
them against a verify pass's logits, `record` what was accepted. The engine runs the pass
and commits it through the state core's verify transition."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from engine import state
from engine.model.sampling import (
    filter_tensors,
    greedy_tokens,
    needs_filter,
    probs_for_verify,
    uses_min_p,
)
from engine.shell.config import EngineConfig
from engine.shell.runtime import Runtime
from engine.spec import (
    AcceptanceStats,
    NgramProposer,
    PassCost,
    SpecStats,
    VerifyOutcome,
    request_rng,
    verify_greedy,
    verify_sampling,
)
from engine.state import DraftTrees, Running


class Speculator:
    """Per-request proposer state, acceptance statistics and verify generators."""

    def __init__(self, runtime: Runtime, config: EngineConfig) -> None:
        self.vocab_size = runtime.vocab_size
        self.config = config.spec_config()
        self.proposer = NgramProposer(self.config)
        self.stats = SpecStats(self.config)
        self.cost = PassCost()  # what a draft row costs here, from the passes below
        self.last_draft_cost = 0.0  # measured (or configured) at the last verify pass's batch
        self._premium = 0.0  # the last verify pass's premium over a decode (`PassCost`)
        self._rngs: dict[int, np.random.Generator] = {}
        # where a verify pass may be walked on the device (`may_walk`; kept with walk_ahead
        # only): requests whose last step was a verify step that accepted drafts; whose last
        # walk was followed by drafts that had to wait for the pass launched on it (until a
        # step drafts nothing); walked at their last step
        self._walks = config.walk_ahead
        self._accepting: set[int] = set()
        self._no_walk: set[int] = set()
        self._walked: set[int] = set()

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
        for kept in (self._accepting, self._no_walk, self._walked):
            kept.discard(uid)
        return stats

    # --- one verify step -----------------------------------------------------------------------
    def budgets(self, running: Running, adaptive: list[int]) -> np.ndarray:
        """The requests' adaptive budgets (`adaptive`, in batch order), cut so each tree fits
        the context and the tokens still allowed."""
        room_context = running.max_context - running.kv_lens.lens - 1
        room_output = running.rules.max_new - running.num_output - 1
        cut = np.minimum(np.array(adaptive, dtype=np.int64), np.minimum(room_context, room_output))
        return np.maximum(cut, 0)

    def draft_cost(self, batch: int) -> float:
        """A draft row's time in decoded tokens' time at this batch size (config, or measured)."""
        fixed = self.config.draft_cost
        return self.cost.draft_cost(batch) if fixed is None else fixed

    def propose(self, running: Running, free_slots: int, probe: bool = False) -> DraftTrees | None:
        """A draft tree per request (a root alone where nothing matches); its drafts, all
        trees together, fit in `free_slots` beside one token per request. None where no
        request drafts (most steps of free text): no trees are built then, and where every
        budget is 0 (requests that gain nothing from drafting) or no request's last tokens
        occurred before (`NgramProposer.may_draft`) the proposer is not asked for trees.
        `probe`: only whether some request drafts, so each tree holds its best draft alone
        (a step whose drafts wait for the next one, which proposes again)."""
        rids = running.rids.tolist()
        adaptive = [self.stats.budget(u) for u in rids]
        if not self._drafting(rids, adaptive):
            return None  # no budget, or no request's last tokens occurred before
        budgets = self.budgets(running, adaptive)
        if probe:
            budgets = np.minimum(budgets, 1)
        return self.proposer.draft_batch(
            rids, budgets.tolist(), total_drafts=max(free_slots - len(running), 0)
        )

    def will_draft(self, running: Running) -> bool:
        """Whether `propose` asks the proposer for trees at `running` (it may still draft
        nothing); where not, the step decodes."""
        rids = running.rids.tolist()
        return self._drafting(rids, [self.stats.budget(u) for u in rids])

    def _drafting(self, rids: list[int], adaptive: list[int]) -> bool:
        """Some request has a budget and last tokens that occurred before."""
        may_draft = self.proposer.may_draft
        return any(b and may_draft(u) for u, b in zip(rids, adaptive, strict=True))

    def verify(
        self, batch: state.Batch, params: list, logits: torch.Tensor | np.ndarray
    ) -> VerifyOutcome:
        """Each tree's accepted path and bonus token, from the verify pass's logits (all
        greedy: or its argmax per node, on the host)."""
        # The costs depend on earlier passes only: fitted here, before the walk waits for the
        # device (0 premium with a configured cost: nothing is timed or fitted then)
        self.last_draft_cost = self.draft_cost(len(batch.running))
        self._premium = self.cost.verify_premium(len(batch.running))
        uids = batch.running.rids.tolist()
        return self._verify(batch, uids, params, logits)

    def record(self, uids: list[int], trees: DraftTrees, accepted: np.ndarray) -> None:
        """A verify step's drafts and accepted counts, weighed at the costs `verify` used."""
        self.stats.record_batch(uids, trees, accepted, self.last_draft_cost, self._premium)
        if self._walks:
            self._walked.difference_update(uids)
            self._accepting.difference_update(uids)
            self._accepting.update(np.asarray(uids)[np.asarray(accepted) > 0].tolist())

    def may_walk(self, uids: list[int]) -> bool:
        """Whether a verify step of these requests may be walked on the device, the decode
        pass after it launched at once (drafts the next step finds wait for that pass): not
        where a request's last step was a verify step that accepted drafts (in a run of
        copied text the next step most often verifies again), nor where drafts waited for
        the pass launched on its last walk (until a step drafts nothing: `record_idle`)."""
        return self._accepting.isdisjoint(uids) and self._no_walk.isdisjoint(uids)

    def walked(self, uids: list[int]) -> None:
        """A verify step of these requests was walked on the device, and the decode pass
        launched on it serves their next step."""
        self._walked.update(uids)

    def record_idle(self, uids: np.ndarray, drafted: bool = False) -> None:
        """A step where nothing was verified (it ran as a decode pass); `drafted`: drafts
        were proposed and wait for the next step (a pass launched ahead decodes this one)."""
        rids = uids.tolist()
        self.stats.record_idle(rids)
        if not self._walks:
            return
        self._accepting.difference_update(rids)
        if drafted:
            self._no_walk.update(self._walked.intersection(rids))
        else:
            self._no_walk.difference_update(rids)
        self._walked.difference_update(rids)

    def observe(self, rows: int, started: float, verify: bool = False) -> None:
        """Fit the pass's time, unless the cost is fixed (configured, or not adapting)."""
        if self.config.draft_cost is None and self.config.adaptive:
            self.cost.observe_step(rows, time.perf_counter() - started, verify)

    def _verify(
        self,
        batch: state.Batch,
        uids: list[int],
        params: list,
        logits: torch.Tensor | np.ndarray,
    ) -> Any:
        """`logits`: the pass's, or (all greedy) its argmax per node on the host."""
        trees = batch.trees
        assert trees is not None  # a verify pass's
        if all(p.greedy for p in params):
            argmax = logits if isinstance(logits, np.ndarray) else greedy_tokens(logits)
            return verify_greedy(trees, argmax)
        assert isinstance(logits, torch.Tensor)  # an argmax on the host is all greedy's
        # One row of filters per request, repeated over its tree's nodes on the device.
        sizes = trees.sizes.lens_to(logits.device)
        filters = [
            t.repeat_interleave(sizes, output_size=trees.sizes.total)
            for t in filter_tensors(params, self.vocab_size, logits.device)
        ]
        temperature, top_k, top_p, min_p = filters
        probs = probs_for_verify(
            logits,
            temperature,
            top_k,
            top_p,
            min_p if uses_min_p(params) else None,
            filtered=needs_filter(params, self.vocab_size),
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
