"""The engine's any-thread side: requests validated and queued, aborts queued, and the request
ids in use (taken atomically at submission, given back when a request finishes). The loop
thread drains the queue at each step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from engine.errors import InvalidRequest
from engine.shell.request import DeltaSink, Request
from engine.state import SamplingParams


def validate_token_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    """Raise InvalidRequest naming `field` unless every id is in the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(
            field, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )


def validate_prompt(ids: list[int], vocab_size: int, max_context: int, pool_slots: int) -> None:
    """Raise InvalidRequest unless the engine can run this prompt to one output token."""
    if not ids:
        raise InvalidRequest("prompt", "is empty; give at least one token")
    validate_token_ids(ids, vocab_size)
    if len(ids) >= max_context:
        raise InvalidRequest(
            "prompt",
            f"prompt has {len(ids)} tokens; max_context is {max_context} (room for one "
            "output token is needed)",
        )
    if len(ids) + 1 > pool_slots:
        raise InvalidRequest(
            "prompt", f"prompt has {len(ids)} tokens; the KV pool holds {pool_slots}"
        )


def validate_params(
    params: SamplingParams, num_prompt: int, vocab_size: int, max_context: int
) -> SamplingParams:
    """The parameters for this prompt (max_tokens None: the room the context leaves); raise
    InvalidRequest unless they fit the prompt, the vocabulary and the context."""
    room = max_context - num_prompt
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if params.max_tokens is None:
        params = attrs.evolve(params, max_tokens=max_tokens)
    if params.min_tokens > max_tokens:
        raise InvalidRequest(
            "min_tokens",
            f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens the context leaves",
        )
    if max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            f"max_tokens={max_tokens} does not fit: the prompt has {num_prompt} tokens "
            f"and max_context is {max_context}, which leaves room for {room}",
        )
    for field, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", list(params.stop_token_ids)),
        ("allowed_token_ids", list(params.allowed_token_ids or ())),
        ("bad_word_ids", [t for sequence in params.bad_word_ids for t in sequence]),
    ):
        validate_token_ids(ids, vocab_size, field)
    if params.allowed_token_ids is not None:
        banned = {sequence[0] for sequence in params.bad_word_ids if len(sequence) == 1}
        if banned.issuperset(params.allowed_token_ids):
            raise InvalidRequest(
                "allowed_token_ids",
                f"each of its {len(params.allowed_token_ids)} tokens is a one-token bad "
                "word (bad_words or bad_word_ids), which leaves no token to sample; allow a "
                "token they do not ban",
            )
    return params


def with_bad_word_ids(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with its `bad_words` as token sequences in `bad_word_ids` (as vLLM spells
    them: each word alone, and after a space where that gives a new first token and as many
    tokens); InvalidRequest without a tokenizer."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise InvalidRequest(
            "bad_words",
            "bad_words needs the model's tokenizer and this engine has none (random weights); "
            "give bad_word_ids, the token sequences",
        )
    sequences = list(params.bad_word_ids)
    for word in params.bad_words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    unique = tuple(dict.fromkeys(sequences))
    return attrs.evolve(params, bad_word_ids=unique)


class Inbox:
    """Thread-safe: `add` and `abort` from any thread, `drain` from the loop's."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ids_lock = threading.Lock()
        self._ids_in_use: set[str] = set()  # ids of requests not finished

    @property
    def empty(self) -> bool:
        return self._queue.empty()

    def add(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        sink: DeltaSink | None = None,
    ) -> Request:
        """Queue a request whose prompt and parameters are validated. Its id is taken
        atomically: of two submits with one id, the second is refused."""
        request = Request(request_id or "", ids, params, sink=sink)
        if not request.request_id:
            request.request_id = f"req-{request.uid}"
        with self._ids_lock:
            if request.request_id in self._ids_in_use:
                raise InvalidRequest(
                    "request_id",
                    f"{request.request_id!r} is already in use by a request that has not finished",
                )
            self._ids_in_use.add(request.request_id)
        self._queue.put(("add", request))
        return request

    def abort(self, request_id: str) -> None:
        self._queue.put(("abort", request_id))

    def release(self, request_id: str) -> None:
        """The request finished: its id may be used again."""
        with self._ids_lock:
            self._ids_in_use.discard(request_id)

    def drain(self) -> Iterator[tuple[str, Any]]:
        """("add", Request) and ("abort", request_id) in the order they came."""
        while not self._queue.empty():
            yield self._queue.get()
