"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the rows of an extend pass that score
prompt tokens, and the log-probabilities their logits give.

The logits at a prompt's position p score its token p + 1, so a chunk of new tokens
[start, start + n) scores prompt tokens start + 1 .. start + n while they are prompt tokens
(the last prompt token's row samples the first output token instead). The pass returns those
rows' logits after its sampled rows' (`Batch.score_rows`); the log-probabilities are
computed on the device with the pass and read back with its tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np
import torch

from engine.model.sampling import Logprobs, host_to_device
from engine.shell.logits import PendingLogprobs
from engine.shell.request import Request
from engine.state import Running

SCORE_SLICE = 256  # scoring rows whose log-probabilities are computed at once


@attrs.frozen(eq=False)
class PromptScoring:
    """An extend pass's scoring rows: each row's flat index among the pass's new tokens
    (increasing), the prompt token it scores, its request and the alternatives it asked
    for; `firsts`: by request, the prompt index of the first token its rows score."""

    rows: np.ndarray
    targets: np.ndarray
    uids: list[int]
    tops: list[int]
    firsts: dict[int, int]

    @classmethod
    def of(
        cls,
        requests: Mapping[int, Request],
        running: Running,
        chunk_lens: np.ndarray,
        asked: set[int],
    ) -> PromptScoring | None:
        """The scoring rows of an extend pass of `chunk_lens` new tokens for each request of
        `running` (from its committed length on), for the requests in flight that ask for
        their prompt's logprobs (`asked`: their uids); None where none of the pass's asks or
        none of their new tokens is followed by a prompt token."""
        if not asked:  # most passes: nobody asks
            return None
        rows: list[np.ndarray] = []
        targets: list[list[int]] = []
        uids: list[int] = []
        tops: list[int] = []
        firsts: dict[int, int] = {}
        offsets = np.concatenate([[0], np.cumsum(chunk_lens)])
        starts = running.kv_lens.lens
        for i in np.flatnonzero(np.isin(running.rids, list(asked))).tolist():
            uid = int(running.rids[i])
            request = requests[uid]
            top = request.params.prompt_logprobs
            assert top is not None  # `asked` holds only such requests
            start = int(starts[i])
            count = min(int(chunk_lens[i]), len(request.prompt_ids) - 1 - start)
            if count <= 0:
                continue
            rows.append(offsets[i] + np.arange(count))
            targets.append(request.prompt_ids[start + 1 : start + 1 + count])
            uids.extend([uid] * count)
            tops.extend([top] * count)
            firsts[uid] = start + 1
        if not rows:
            return None
        return cls(
            np.concatenate(rows).astype(np.int64),
            np.array([t for chunk in targets for t in chunk], dtype=np.int64),
            uids,
            tops,
            firsts,
        )

    def launch(self, logits: torch.Tensor) -> PendingScores:
        """The scored tokens' log-probabilities from the scoring rows' `logits` (in row
        order), computed on the device."""
        if logits.shape[0] != self.rows.size:
            raise ValueError(
                f"{logits.shape[0]} logits rows for {self.rows.size} scoring rows: the runner "
                "must return the logits of Batch.output_rows"
            )
        targets = host_to_device(self.targets, logits.device)
        top = max(self.tops)
        # a slice of rows at a time: the log-softmax's temporaries stay a slice's, whatever
        # the chunk (the logits themselves are the pass's)
        parts = [
            Logprobs.of(logits[at : at + SCORE_SLICE], targets[at : at + SCORE_SLICE], top)
            for at in range(0, self.rows.size, SCORE_SLICE)
        ]
        columns = zip(*(part.tensors() for part in parts), strict=True)
        values = Logprobs(*(torch.cat(column) for column in columns))
        return PendingScores(PendingLogprobs(values, self.uids, self.tops, targets), self.firsts)


@attrs.frozen(eq=False)
class PendingScores:
    """A pass's prompt log-probabilities on the device, and where they go in each prompt."""

    logprobs: PendingLogprobs
    firsts: dict[int, int]

    def write(self, requests: Mapping[int, Request]) -> None:
        """Read them back and put them in their requests' `prompt_logprobs` (a prompt
        computed again, after a retraction, writes the same places again)."""
        for uid, entries in self.logprobs.host().items():
            request = requests.get(uid)
            if request is not None and request.prompt_logprobs is not None:
                request.score_prompt(self.firsts[uid], entries)
