"""Scheduling policy: which requests run next and how many tokens each computes.

Pure functions over the `Running` snapshot and the waiting queue's sizes; the Engine applies
the decisions. Prefill first (FCFS, chunked under a token budget), then decode or verify.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from engine.state import Running


@attrs.frozen
class ExtendPlan:
    """Requests (indices into running) that compute the next chunk of their pending tokens."""

    indices: np.ndarray
    chunk_lens: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.chunk_lens.sum())


def plan_extend(
    running: Running,
    token_budget: int,
    mixed: bool = True,
    mixed_budget: int | None = None,
    first_in_extend: bool = True,
) -> ExtendPlan | None:
    """Chunks for the requests still prefilling their prompt, in batch order, under the token
    budget; None when there are none (the step decodes or verifies). A request prefills while
    it has more than one pending token, or, with `first_in_extend`, has not sampled yet: one
    whose prompt was cached but for its last token then samples its first token in an extend
    pass, as it would without the cache (with speculation a verify pass would draw it
    differently). Without it, that request joins the decode pass: one pending token is a
    decode row whether or not it has sampled, the same logits and the same draw, and a
    decode pass replays a CUDA graph where an extend pass runs eagerly. `mixed`: the pass
    also carries every other request's pending token (its decode), so running requests keep
    emitting while prompts prefill; otherwise they wait. The decodes count inside the
    budget, as in vLLM and SGLang: a full pass has `token_budget` tokens however many
    requests decode, so its matrix products keep one shape from pass to pass. When the
    decodes take more than half the budget, the pass still prefills half of it: a prompt
    never waits for the running requests to finish. A pass that carries decodes prefills at
    most `mixed_budget` tokens per prefilling request (when given): the decodes wait for the
    whole pass, so its length is their gap between two tokens. One long prompt among running
    requests is chunked finely; a burst of new requests, each waiting for its first token,
    still prefills at up to the whole budget.
    """
    pending = running.pending_lens
    prefilling = pending > 1
    first = None  # requests that have not sampled yet (asked only with first_in_extend)
    if first_in_extend:
        first = running.token_lens.lens == running.prompt_lens
        prefilling |= first
    candidates = np.flatnonzero(prefilling)
    if candidates.size == 0:
        return None
    decoding = pending == 1 if first is None else (pending == 1) & ~first
    decodes = np.flatnonzero(decoding) if mixed else candidates[:0]
    if decodes.size:
        token_budget = max(token_budget - int(decodes.size), (token_budget + 1) // 2)
        if mixed_budget is not None:
            token_budget = min(token_budget, mixed_budget * int(candidates.size))
    wanted = pending[candidates]
    before = np.concatenate([[0], np.cumsum(wanted)[:-1]])
    chunk = np.clip(token_budget - before, 0, wanted)
    take = chunk > 0
    indices, chunk_lens = candidates[take], chunk[take]
    if decodes.size:
        indices = np.concatenate([indices, decodes])
        chunk_lens = np.concatenate([chunk_lens, np.ones(decodes.size, dtype=chunk_lens.dtype)])
        order = np.argsort(indices, kind="stable")  # batch order
        indices, chunk_lens = indices[order], chunk_lens[order]
    return ExtendPlan(indices, chunk_lens)


def most_extend_tokens(token_budget: int, max_requests: int) -> int:
    """The most tokens `plan_extend` puts in one pass of at most `max_requests` requests:
    the budget, or, where decodes take more than half of it, half the budget (rounded up)
    for the prompts beside up to `max_requests - 1` decodes. Extend graphs larger than this
    would never replay."""
    return max(token_budget, (token_budget + 1) // 2 + max_requests - 1)


def admission_order(cached: Sequence[int], aged: Sequence[bool]) -> list[int]:
    """Longest cached prefix first (SGLang's LPM): indices into the waiting queue. `cached`:
    each request's cached prefix length; `aged`: requests passed over too often, which go
    first, in queue order. Ties keep queue order."""
    first = [i for i in range(len(cached)) if aged[i]]
    rest = sorted((i for i in range(len(cached)) if not aged[i]), key=lambda i: -cached[i])
    return first + rest


def count_admissible(
    pending_tokens: Iterable[int],
    free_rows: int,
    free_slots: int,
    reserved_slots: int,
    token_budget: int,
    step_slots: int = 1,
    locked_slots: Iterable[int] | None = None,
) -> int:
    """How many waiting requests (a prefix of the queue, in admission order) to admit now.

    A request is admitted while a row is free and its pending tokens plus its own next step
    (`step_slots`: 1, or 1 + the draft budget) fit in the free slots left after reserving
    `reserved_slots` for the running requests (the engine counts theirs the same way: a
    prompt still prefilling needs the rest of it). Counting the next steps keeps a request
    from being admitted only to be retracted again by the pass that follows. The
    first request is admitted even when it exceeds the token budget (it is chunked); later
    ones must fit within it. With nothing running, the first request needs room for its
    tokens and one more only: a request the pool can hold must never wait for room that
    will not come (with speculation its drafts are cut to the slots there are).

    With the prefix cache, `pending_tokens` leave out each request's cached prefix, and
    `locked_slots` are the evictable slots of that prefix (counted in `free_slots`), which
    locking it takes out of the room. Two requests matching the same evictable prefix count
    it twice: the estimate errs toward admitting fewer, never toward a retraction.
    """
    admitted = 0
    room = free_slots - reserved_slots
    budget = token_budget
    locked = iter(locked_slots) if locked_slots is not None else None
    for tokens in pending_tokens:
        step = 1 if admitted == 0 and reserved_slots == 0 else step_slots
        cost = tokens + step + (next(locked) if locked is not None else 0)
        if admitted >= free_rows or cost > room or (admitted and tokens > budget):
            break
        admitted += 1
        room -= cost
        budget -= tokens
    return admitted


def newest(uids: np.ndarray) -> int:
    """Index of the most recently submitted request: the first to retract."""
    return int(np.argmax(uids))
