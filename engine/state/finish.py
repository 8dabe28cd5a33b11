"""The finish check, in one place: EOS, stop token ids, max_tokens and the context limit."""

from __future__ import annotations

import enum
import functools

import numpy as np

from engine.state.running import FinishRules
from engine.state.seqlens import SeqLens


class FinishReason(enum.IntEnum):
    """Why a request left. NONE marks requests that keep running; ERROR, requests whose pass
    failed (the engine goes on with the others)."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4

    @property
    def openai(self) -> str | None:
        return {0: None, 1: "stop", 2: "length", 3: "abort", 4: "error"}[int(self)]


@functools.lru_cache(maxsize=64)
def no_finish(size: int) -> np.ndarray:
    """Read-only FinishReason.NONE codes for `size` requests (shared: the common case)."""
    reasons = np.zeros(size, dtype=np.int8)
    reasons.flags.writeable = False
    return reasons


def first_finish(
    tokens: np.ndarray,
    valid: np.ndarray,
    num_output_before: np.ndarray,
    token_lens_before: np.ndarray,
    rules: FinishRules,
    max_context: int,
) -> tuple[np.ndarray, np.ndarray]:
    """For (batch, k) tokens appended in order (`valid`: a prefix of each row), where each
    request stops. Returns (kept, reason): how many tokens each request keeps (all of its
    valid ones when it does not finish) and its FinishReason code."""
    counts = SeqLens(valid.sum(axis=1))
    return first_finish_flat(
        tokens[valid], counts, num_output_before, token_lens_before, rules, max_context
    )


def first_finish_flat(
    tokens: np.ndarray,
    counts: SeqLens,
    num_output_before: np.ndarray,
    token_lens_before: np.ndarray,
    rules: FinishRules,
    max_context: int,
    owner: np.ndarray | None = None,
    step: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The finish check over flat tokens, `counts[i]` of them for request i (CSR).

    A stop token (EOS unless it is -1, or a stop id) counts once min_new outputs are reached;
    max_new outputs or max_context tokens end a request by length; a stop wins over length
    on the same token. `owner` / `step` (each token's request, and its 1-based position in
    it) may be passed when the caller has them. Returns (kept, reason) per request.
    """
    one_each = counts.total == len(counts) and counts.max <= 1  # decode: no gathers needed
    first_stop_step = rules.min_new - num_output_before
    last_step = np.minimum(rules.max_new - num_output_before, max_context - token_lens_before)
    eos, stop_ids = rules.eos, rules.stop_ids
    # Each token's request and 1-based step in it; with one token each, token i is the
    # first of request i (no owner array needed).
    token_owner: np.ndarray | None = None
    token_step: np.ndarray | int = 1
    if not one_each:
        token_owner = counts.segment_ids() if owner is None else owner
        token_step = counts.offsets_within() + 1 if step is None else step
        eos, stop_ids = eos[token_owner], stop_ids[token_owner]
    # Token ids are >= 0 and an ignored EOS is -1 (stop-id padding too), so a plain compare
    # never matches an ignored EOS or padding.
    is_stop = tokens == eos
    if stop_ids.shape[1] > 8:
        is_stop |= (tokens[:, None] == stop_ids).any(axis=1)
    else:  # a few columns: one compare each is cheaper than a 2-D compare and reduce
        for column in range(stop_ids.shape[1]):
            is_stop |= tokens == stop_ids[:, column]
    # Most passes: no stop token, and each request's last step (its count) short of its
    # limit, so no token reaches it: nobody finishes, told per request, not per token.
    if not is_stop.any() and not (counts.lens >= last_step).any():
        return counts.lens, no_finish(len(counts))
    if token_owner is not None:
        first_stop_step, last_step = first_stop_step[token_owner], last_step[token_owner]
    stop_hit = is_stop & (token_step >= first_stop_step)
    hit = stop_hit | (token_step >= last_step)
    if not hit.any():
        return counts.lens, no_finish(len(counts))
    reason = np.zeros(len(counts), dtype=np.int8)
    hits = np.flatnonzero(hit)
    leaving, first = np.unique(
        hits if token_owner is None else token_owner[hits], return_index=True
    )
    first_hit = hits[first]
    kept = counts.lens.copy()
    kept[leaving] = 1 if isinstance(token_step, int) else token_step[first_hit]
    reason[leaving] = np.where(stop_hit[first_hit], FinishReason.STOP, FinishReason.LENGTH)
    return kept, reason
