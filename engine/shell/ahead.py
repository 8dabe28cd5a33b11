"""The next decode pass, planned while the current one runs on the device.

While decode pass k runs, `plan(batch_k)` applies the part of its commit that does not depend
on the sampled tokens (`state.decode_writes`: each request's new slot in the table), hands out
the slots of pass k+1 as if nobody finished (`state.assume_decoded`), and has the runner plan
it (`ModelRunner.prepare`: on CUDA the device work queues behind pass k). After pass k is
committed, `take(running)` returns the plan only if the committed Running has the same
requests, rows and lengths (`state.same_layout`); otherwise the plan's slots go back to the
pool (`state.abandon`). With `launch(...)` the planned pass is also launched before pass k's
tokens are read (its input ids taken on the device). When requests only left (a stop token,
a length limit, an abort), a launched pass is cut to the others (`state.narrow`): its work for
those that left is discarded and their slots go back, once the device has queued the pass
(the slots' next writers queue behind it). Any other change drops a launched pass too (its
device work still runs, to slots given back). A verify pass `batch` is planned from the same
way, for the outcome in which no draft is accepted (its early writes are its roots');
`plan_committed(running)` plans the decode pass of a Running already committed (after a
verify pass whose outcome the plan missed), or with trees its verify pass (launched at the
commit of the step before). `plan(batch, trees)` plans a verify pass after
decode pass `batch` instead (`verify_ahead`: its roots are the tokens `batch` samples,
`root_ids` copies them on the device at its launch); `take_verify` hands it to the next step.
A verify pass launched ahead is never cut (`VerifyLaunched.select`): any change drops it.
Nothing here decides *whether* to plan or launch: that is the engine's policy.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from engine import state
from engine.backends.base import upload
from engine.shell.kv import KVBook
from engine.shell.runner import PassRunner, Prepared
from engine.spec.tree import with_roots
from engine.state import DraftTrees, Mode, Running


def root_ids(batch: state.Batch, tokens: torch.Tensor) -> torch.Tensor:
    """A verify pass's input ids on `tokens`' device: `batch.input_ids`, each tree's root
    replaced by its request's token in `tokens` (sampled by the pass before, still on the
    device)."""
    assert batch.trees is not None
    starts = batch.trees.sizes.starts().astype(np.int64)
    on_device = upload(tokens.device, {"ids": batch.input_ids.astype(np.int64), "at": starts})
    ids = on_device["ids"]
    ids.index_copy_(0, on_device["at"], tokens.to(ids.dtype))
    return ids


class PlanAhead:
    """`machine`: what the transitions are called on (`engine.state`, or a trace recorder)."""

    def __init__(
        self,
        book: KVBook,
        runner: PassRunner,
        stats: collections.Counter,
        machine: Any = state,
    ) -> None:
        self.book, self.runner, self.stats, self.machine = book, runner, stats, machine
        self.prepared: Prepared | None = None

    @property
    def num_held(self) -> int:
        """How many slots the plan holds (0 without a plan)."""
        return 0 if self.prepared is None else self.prepared.batch.out_slots.shape[0]

    @property
    def launched(self) -> bool:
        """Whether the plan's pass was launched already (`launch`)."""
        return self.prepared is not None and self.prepared.launched is not None

    @property
    def held_slots(self) -> np.ndarray | None:
        """The slots the plan holds (in flight: owned by no request yet), or None."""
        return None if self.prepared is None else self.prepared.batch.out_slots

    def plan(self, batch: state.Batch, trees: state.DraftTrees | None = None) -> bool:
        """Plan the pass after decode or verify pass `batch` (which is running; a verify
        pass: as if no draft is accepted): its decode pass, or with `trees` (after a decode
        pass) a verify pass of them, whose roots are the tokens `batch` will sample (their
        tokens here stand in only). Returns whether `batch`'s early table writes were
        applied (False: the pool had no room; nothing done)."""
        following = self.machine.assume_decoded(batch)
        if not self._fits(following, trees):
            return False
        self.book.apply(self.machine.decode_writes(batch))
        self._prepare(
            following, None if trees is None else with_roots(trees, following.last_tokens)
        )
        return True

    def take_verify(self, running: Running) -> Prepared | None:
        """The verify pass launched ahead (`plan` with trees), if one is held and fits `running`
        as committed (`take`); None otherwise (a decode plan stays held)."""
        if self.prepared is None or self.prepared.batch.mode != Mode.VERIFY:
            return None
        return self.take(running)

    def plan_committed(self, running: Running, trees: DraftTrees | None = None) -> bool:
        """Plan the decode pass of `running` as committed (no pass running before it: its
        table is written), or with `trees` (rooted at its last tokens) the verify pass of
        them. False where the pool has no room (nothing done)."""
        if self.prepared is not None:
            raise ValueError("plan_committed() needs no plan held")
        if not self._fits(running, trees):
            return False
        self._prepare(running, trees)
        return True

    def _fits(self, running: Running, trees: DraftTrees | None) -> bool:
        """Whether the pool can hand out the slots of `running`'s decode pass (a slot a
        request), or with `trees` its verify pass (a slot a node)."""
        return self.book.num_available >= (len(running) if trees is None else trees.sizes.total)

    def _prepare(self, running: Running, trees: DraftTrees | None = None) -> None:
        """Hand out the slots of `running`'s decode pass, or with `trees` its verify pass, and
        have the runner plan it; the slots go back if that fails."""
        if trees is None:
            nxt = self.machine.schedule_decode(running, self.book.alloc(len(running)))
        else:
            nxt = self.machine.schedule_verify(running, trees, self.book.alloc(trees.sizes.total))
        try:
            self.prepared = self.runner.prepare(nxt)
        except BaseException:
            self.book.apply(self.machine.abandon(nxt))
            raise

    def rebatch(self, batch: state.Batch) -> None:
        """The plan's pass is `batch` from here: the planned pass scheduled again (its layout
        and its slots, newer tokens). It holds the slots now, so a drop gives up that pass,
        not the plan it took them from."""
        self._rebatched(batch, launched=False, what="rebatch")

    def relayout(self, batch: state.Batch) -> None:
        """The launched plan's pass is `batch` from here: the layout its launch took on the
        device, now known to the host (a decode pass after a verify pass, its requests moved
        on by the drafts a walk on the device accepted: `DeviceWalk`). It holds the plan's
        slots."""
        self._rebatched(batch, launched=True, what="relayout")

    def _rebatched(self, batch: state.Batch, launched: bool, what: str) -> None:
        """The plan's batch replaced by `batch`, which takes its slots; the plan launched
        already or not, as `launched` says (`what`: the caller, for the error)."""
        if self.prepared is None or (self.prepared.launched is not None) != launched:
            raise ValueError(f"{what}() needs a plan that was {'' if launched else 'not '}launched")
        if batch.out_slots is not self.prepared.batch.out_slots:
            raise ValueError(f"{what}() needs the pass that takes the plan's slots")
        self.prepared = attrs.evolve(self.prepared, batch=batch)

    def launch(self, launcher: Callable[[Prepared], Any]) -> None:
        """Launch the plan now: `launcher(prepared)` returns what the launch gives (the
        launched pass, sampled on the device), kept with the plan for the step that takes it."""
        if self.prepared is None or self.prepared.launched is not None:
            raise ValueError("launch() needs a plan that was not launched yet")
        self.prepared = attrs.evolve(self.prepared, launched=launcher(self.prepared))
        self.stats["launches_ahead"] += 1

    def fit(self, running: Running) -> None:
        """Keep the plan only for `running` as committed: as it is when nothing changed, cut
        to the requests left when it was launched and only some left (`_narrow`), otherwise
        dropped (its slots go back)."""
        if self.prepared is None:
            return
        planned = self.prepared.batch.running
        if state.same_layout(planned, running):  # most steps: checked first, cheaply
            return
        if self.prepared.launched is None:  # only a launched pass is cut (`_narrow`)
            self.drop()  # (a plan after a verify pass in which a draft was accepted)
            return
        keep = self.machine.kept_rows(planned, running)
        if keep is None or not keep.size or not self._narrow(keep):
            self.drop()

    def _narrow(self, keep: np.ndarray) -> bool:
        """Cut the launched plan to its rows `keep`; the others' slots go back. False (nothing
        done) where it cannot be: not launched, or its tokens not sampled yet (`select`)."""
        prepared = self.prepared
        assert prepared is not None
        launched = None if prepared.launched is None else prepared.launched.select(keep)
        if launched is None:
            return False
        batch = prepared.batch
        gone = np.setdiff1d(np.arange(len(batch.running)), keep)
        kept = self.machine.narrow(batch, keep)
        self.book.apply(self.machine.abandon(self.machine.narrow(batch, gone)))
        self.prepared = attrs.evolve(prepared, batch=kept, launched=launched)
        self.stats["launches_ahead_narrowed"] += 1
        return True

    def take(self, running: Running) -> Prepared | None:
        """The plan, if it fits `running` as committed (`fit`; it is handed over: None
        after)."""
        self.fit(running)
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            self.stats["plans_ahead_used"] += 1
        return prepared

    def drop_launched(self) -> None:
        """Drop the plan if it was launched (its input ids were tokens that changed)."""
        if self.launched:
            self.drop()

    def drop(self) -> None:
        """Give the plan's slots back (requests came or left, or the engine is stopping)."""
        if self.prepared is not None:
            self.book.apply(self.machine.abandon(self.prepared.batch))
            if self.prepared.launched is not None:
                self.stats["launches_ahead_dropped"] += 1
            self.prepared = None
            self.stats["plans_ahead_dropped"] += 1
