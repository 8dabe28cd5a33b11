"""One forward pass from its launch to its tokens on the host, for the engine's loop.

`Passes` launches a planned batch on the runner, starts its grammars' masks while the device
runs it, samples on the device (bias and penalties, then masks; logprobs from the logits
before the mask), and reads the tokens back, drawing a refused greedy token again under its
mask. It holds no scheduling state: the engine decides what runs, commits what it returns,
and emits the logprobs it fetched (`take_logprobs`).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from engine import state
from engine.shell.ahead import PlanAhead
from engine.shell.failures import Faults
from engine.shell.logits import Launched, LogitsWork, Sampled
from engine.shell.outputs import Outputs
from engine.shell.prompt_scores import PromptScoring
from engine.shell.runner import PassRunner
from engine.shell.runtime import Runtime


class Passes:
    """Launch, sample, fetch. `runner` (the model's, or rank 0's over the workers) and
    `faults` (a test tool: passes fail where it says) may be replaced between steps."""

    def __init__(
        self,
        runtime: Runtime,
        runner: PassRunner,
        outputs: Outputs,
        logits: LogitsWork,
        ahead: PlanAhead,
    ) -> None:
        self.runtime, self.runner, self.outputs = runtime, runner, outputs
        self.requests = outputs.requests
        self.logits, self.ahead = logits, ahead
        self.faults: Faults | None = None
        self.logprobs: dict | None = None  # the last pass's, until its tokens are emitted

    def hit(self, point: str) -> None:
        """A point where `faults` may fail the pass ("forward", "sample", "verify", "commit")."""
        if self.faults is not None:
            self.faults.hit(point)

    def take_logprobs(self) -> dict | None:
        """The logprobs of the pass whose tokens are being emitted (None: none asked)."""
        logprobs, self.logprobs = self.logprobs, None
        return logprobs

    def forward(
        self, batch: state.Batch, prepared: Any = None, input_ids: Any = None, shift: Any = None
    ) -> torch.Tensor:
        """The pass's logits (on the device): eagerly, or from its prepared plan (a graph's
        replay), `input_ids` on the device in place of `batch.input_ids`, `shift` tokens
        further on (`ModelRunner.launch`)."""
        self.hit("forward")
        if prepared is None:
            return self.runner.forward(batch)
        return self.runner.launch(prepared, batch, input_ids, shift)

    def launch(
        self,
        batch: state.Batch,
        prepared: Any = None,
        input_ids: Any = None,
        ahead: bool = False,
        shift: Any = None,
        scoring: PromptScoring | None = None,
    ) -> Launched:
        """Launch the pass, then start its grammars' masks: the host fills them (with a GPU,
        on a pool thread) while the device runs the forward and the loop does its other host
        work; `sample` applies them. A greedy constrained row without logprobs gets no mask
        here: its token is checked against its grammar once fetched, and drawn again under
        its mask only if refused (`tokens`). A pass without masks is sampled at once.
        Sampling applies each request's bias and penalties first, then its grammar's mask;
        its logprobs after, where asked, from the logits before the mask; the tokens stay on
        the device until `fetch` (their copy to the host starts at once). `input_ids`: on
        the device, in place of `batch.input_ids` (`ModelRunner.launch`); `ahead`: launched
        before the running pass's tokens reach the requests (its penalties count those
        `input_ids`; its seeded draws are numbered by `batch`'s Running, one step on);
        `shift`: its requests further on than `batch` says, by counts on the device (a walk
        of the verify pass before it, `DeviceWalk`). `scoring`: the prompt tokens its
        `score_rows` score; their log-probabilities are computed as it is launched."""
        outputs = self.outputs
        inputs = None  # all greedy: no per-request work
        uids = batch.running.rids[batch.samples].tolist()
        if outputs.sampling_uids:  # built before the launch (see Runtime.sampling_inputs)
            params = [self.requests[u].params for u in uids]
            # each row's draw is its request's output count: the batch's Running says it
            # (planned ahead: one token further on), its outputs may not be emitted yet
            steps = batch.running.num_output[batch.samples].tolist()
            inputs = self.runtime.sampling_inputs(params, np.array(uids), steps)
        forward = self.forward(batch, prepared, input_ids, shift)
        scores = None
        if scoring is not None:
            if batch.score_rows is None or not np.array_equal(batch.score_rows, scoring.rows):
                raise ValueError("the pass's score_rows must be the scoring's rows")
            sampled_rows = batch.logit_rows.shape[0]
            scores = scoring.launch(forward[sampled_rows:])
            forward = forward[:sampled_rows]
        # greedy rows go unmasked, and are masked only if their grammar refuses their token
        checked = self.logits.checked_rows(uids, outputs.logprob_uids)
        masks = self.logits.start(uids, checked)  # after the launch: filled as the device runs
        # launched ahead: each row's input is its token that its request does not hold yet
        pending = input_ids if ahead else None
        logits = self.logits.edit(forward, uids, outputs.edited_uids, pending)
        launched = Launched(logits, uids, inputs, masks, checked=checked, scores=scores)
        if masks is None:
            return attrs.evolve(launched, sampled=self.sample(launched))
        return launched

    def sample(self, launched: Launched) -> Sampled:
        """The launched pass's sampling, its masks applied (waiting for them)."""
        if launched.sampled is not None:
            return launched.sampled
        logits, uids = launched.logits, launched.uids
        masked = self.logits.constrain(logits, uids, launched.masks)
        tokens = self.runtime.sample(masked, launched.inputs)
        return Sampled.copying(
            tokens, self.logits.logprobs(logits, tokens, uids, self.outputs.logprob_uids)
        )

    def tokens(self, launched: Launched) -> np.ndarray:
        """The launched pass's tokens on the host: sampled, fetched, and where a checked
        row's grammar refuses its token, drawn again under its mask (`LogitsWork.recheck`)."""
        fetched = self.fetch(self.sample(launched))
        tokens = self.logits.recheck(
            launched.logits, launched.uids, launched.checked, fetched, launched.checked_logits
        )
        if tokens is not fetched:  # a pass launched ahead took the refused tokens as its ids
            self.ahead.drop_launched()
        return tokens

    def fetch(self, sampled: Sampled) -> np.ndarray:
        """The pass's tokens on the host (where a device error surfaces), and its logprobs."""
        self.hit("sample")
        tokens = sampled.tokens_on_host()
        self.logprobs = None if sampled.logprobs is None else sampled.logprobs.host()
        return tokens
