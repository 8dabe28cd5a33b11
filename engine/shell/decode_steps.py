"""The engine's decode steps: one decode pass, and the next one planned (and, where the
device runs apart from the host, launched) while it runs. `DecodeSteps` is the base of
`SpeculativeSteps` and so of `Engine`, in a file of its own as they are; it uses the engine's
state and helpers (listed in the class)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs

from engine import state
from engine.shell.ahead import PlanAhead
from engine.shell.config import EngineConfig
from engine.shell.failures import OpenPass
from engine.shell.inbox import Inbox
from engine.shell.kv import KVBook
from engine.shell.logits import Launched, LogitsWork
from engine.shell.passes import Passes
from engine.shell.speculator import Speculator
from engine.state import Running


class DecodeSteps:
    """A decode step of `Engine`, with or without speculation."""

    # the engine's state and helpers these steps use (`Engine._build` sets them)
    config: EngineConfig
    spec: Speculator | None
    running: Running
    book: KVBook
    ahead: PlanAhead
    passes: Passes
    logits: LogitsWork
    inbox: Inbox
    machine: Any
    launch_ahead: bool
    _open: Callable[[state.Batch], AbstractContextManager[OpenPass]]
    _commit_pass: Callable[..., None]
    _reserve: Callable[[Any], bool]
    _admissible: Callable[..., int]
    _verify_ahead: Callable[[OpenPass, Launched, state.DraftTrees], bool]

    def _decode_step(
        self,
        during: Any = None,
        launch_next: bool = True,
        drafts: state.DraftTrees | None = None,
    ) -> str:
        """One decode pass; `during()`, if given, runs on the host while the device runs it
        (with the planning of the next pass), once nothing can retract the step any more.
        A pass planned during the last one may have been launched already (`launch_ahead`);
        `launch_next` False: the next one is planned, not launched, or where `drafts` (trees
        that wait for this pass) may be, the verify pass after it launched (`_verify_ahead`)."""
        prepared = self.ahead.take(self.running)
        if prepared is not None:  # planned during the last pass: only the tokens are new
            batch = self.machine.schedule_decode(self.running, prepared.batch.out_slots)
        else:
            if not self._reserve(lambda: len(self.running)):
                return "retract"
            batch = self.machine.schedule_decode(self.running, self.book.alloc(len(self.running)))
        with self._open(batch) as open_pass:
            if prepared is not None and prepared.launched is not None:
                launched = prepared.launched  # its input ids were the last pass's tokens
                assert isinstance(launched, Launched)  # a decode plan's launch
            else:
                launched = self.passes.launch(batch, prepared)
            if during is not None:
                during()
            # host work while the device runs this pass (and a pool thread fills its masks);
            # a pass with masks is sampled after it
            launched = self._prepare_next(open_pass, launched, launch_next, drafts)
            sampled = self.passes.tokens(launched)
            result = self.machine.decode(batch, sampled)
            # with speculation, the next pass where none was launched during this one
            launch_next = self.spec is not None and not self.ahead.launched
            self._commit_pass(open_pass, result, launch_next=launch_next)
        self.ahead.fit(self.running)  # requests that finished leave the plan
        return "decode"

    # --- planning the next decode pass while this one runs ----------------------------------
    def _prepare_next(
        self,
        open_pass: OpenPass,
        launched: Launched,
        launch: bool,
        drafts: state.DraftTrees | None = None,
    ) -> Launched:
        """Plan the decode pass after `open_pass`'s while it runs (`PlanAhead`), unless the
        next step will change the batch anyway; its table writes are then applied early. With
        speculation, the pass is a step where nothing was drafted; the next one is most often
        the same (the plan is used), and a verify pass instead drops the plan.

        With `launch_ahead`, `launch` (with speculation: nothing waits to be verified) and
        `launched` sampled on the device, the planned pass is launched at once, before this
        pass's tokens are read, its input ids copied on the device. Its sampling needs only
        step counts the host knows (seeded draws); its penalties count the tokens of this pass
        on the device (`LogitsEdit.of`); its logprobs come from its own logits on the device;
        a grammar's rows are all greedy then, drawn unmasked and checked after (a refused
        token drops the launched pass, `Passes.tokens`). A request that leaves with this pass
        (a stop token, its length) is cut from the launched pass before it is taken
        (`PlanAhead.fit`). With speculation the next step then decodes: drafts proposed at
        it wait one step (`_run_decode`). Returns `launched`, with its checked rows' logits
        copied where a pass was launched ahead (it may write over them before they are
        checked: a CUDA graph's output buffer is every replay's)."""
        if not self._batch_stays():
            return launched  # the next step changes the batch: a plan would be dropped
        if drafts is not None and self._verify_ahead(open_pass, launched, drafts):
            return launched
        open_pass.table_written = True  # until the plan says otherwise: undone if it fails
        open_pass.table_written = self.ahead.plan(open_pass.batch)
        sampled = launched.sampled  # None: masks to wait for
        if open_pass.table_written and sampled is not None and launch and self.launch_ahead:
            kept = self.logits.keep_checked(launched.logits, launched.checked)
            launched = attrs.evolve(launched, checked_logits=kept)
            # its rows sample one token further on (the seeds' step counts)
            self.ahead.launch(lambda p: self.passes.launch(p.batch, p, sampled.tokens, ahead=True))
        return launched

    def _batch_stays(self) -> bool:
        """Whether planning the next pass ahead may pay: it is on (`plan_ahead`), and the
        next step keeps the batch as far as arrivals go (nothing in the inbox, nobody
        admissible; a plan would be dropped otherwise)."""
        return self.config.plan_ahead and self.inbox.empty and not self._admissible()
