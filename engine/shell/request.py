"""Shell-side request records and the values handed back to callers."""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import attrs
import numpy as np

from engine.spec.stats import AcceptanceStats
from engine.state import FinishReason, SamplingParams

_next_id = itertools.count(1)
_ID_HEADROOM = 64  # tokens `id_array`'s buffer has room for beyond the prompt at first


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class TokenLogprob:
    """A token's log-probability, the most likely tokens at its position with theirs
    (`SamplingParams.logprobs` of them, or `prompt_logprobs` for a prompt token), and its
    rank among all tokens there (1: the most likely)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # None: not known (made by hand)


@attrs.frozen
class Delta:
    """New output of one request: tokens and text since the last delta."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    # the request's usage: in its first delta so far (the prompt's tokens, those cached), in
    # its last the final; None in between
    usage: Usage | None = None
    speculation: AcceptanceStats | None = None  # in the last delta, as in Completion
    error: str | None = None  # finish_reason "error": what failed
    # in the last delta, and in the first where the prompt's logprobs were asked
    prompt_token_ids: tuple[int, ...] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when asked
    # in the first delta, when asked: one per prompt token (None: the first, which nothing
    # scores, and any the request did not reach)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class DeltaSink(Protocol):
    """Where a request's deltas go as the engine makes them (`Engine.stream`'s queue,
    `AsyncEngine`'s sink); `put` is called on the thread that steps the engine."""

    def put(self, delta: Delta, /) -> None: ...


@attrs.frozen
class Completion:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage
    # this request's verify steps, drafts and accepted drafts (with speculative decoding)
    speculation: AcceptanceStats | None = None
    error: str | None = None  # finish_reason "error": what failed
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # as in `Delta`

    @classmethod
    def of_deltas(cls, deltas: list[Delta]) -> Completion:
        """The completion a request's deltas add up to (the last one is final)."""
        last = deltas[-1]
        if last.finish_reason is None or last.usage is None or last.prompt_token_ids is None:
            raise ValueError("the last delta of a completion must be the final one")
        return cls(
            last.request_id,
            last.prompt_token_ids,
            tuple(t for d in deltas for t in d.token_ids),
            "".join(d.text for d in deltas),
            last.finish_reason,
            last.usage,
            last.speculation,
            last.error,
            None
            if last.logprobs is None
            else tuple(lp for d in deltas for lp in (d.logprobs or ())),
            deltas[0].prompt_logprobs,
        )


@attrs.define(eq=False)
class Request:
    """What the shell keeps per request. The state core never reads this object: it reads
    the columnar `Running` snapshot; token histories here only grow (append-only)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    uid: int = attrs.field(factory=lambda: next(_next_id))
    output_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    detok: Any = None
    sink: DeltaSink | None = None  # deltas for stream()/AsyncEngine; None: collect only
    stopped_by_string: bool = False
    speculation: AcceptanceStats | None = None  # set when it finishes, with speculation on
    error: str | None = None  # set when its pass failed (finish reason ERROR)
    cached_tokens: int | None = None  # prompt tokens matched in the prefix cache at admission
    waited_out: int = 0  # admissions that passed it over while it waited (its age, for LPM)
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set
    # per prompt token, when params.prompt_logprobs is set (None: not scored yet; the first
    # never is)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    _ids: Any = attrs.field(default=None, init=False, repr=False)  # id_array()'s buffer
    _view: Any = attrs.field(default=None, init=False, repr=False)  # its last answer
    _prompt_seen: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
        # the prompt's array is built here, where the request is made (the submitting thread),
        # rather than by the loop when it first looks the prompt up in the prefix cache
        self.id_array()

    def seen_and_output(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens it has seen (prompt and output, each once) and its output tokens, for
        the repetition, frequency and presence penalties."""
        if self._prompt_seen is None:
            self._prompt_seen = np.unique(np.array(self.prompt_ids, dtype=np.int64))
        output = np.array(self.output_ids, dtype=np.int64)
        return np.union1d(self._prompt_seen, output), output

    def score_prompt(self, first: int, entries: list[TokenLogprob]) -> None:
        """Prompt tokens first, first + 1, ... scored (`PromptScoring`)."""
        assert self.prompt_logprobs is not None
        self.prompt_logprobs[first : first + len(entries)] = entries

    def cacheable_prefix(self) -> np.ndarray:
        """The tokens admission may take from the prefix cache: all but the last (which it
        always computes), or none while its prompt's logprobs are not all computed (each
        needs the logits at the position before it)."""
        ids = self.id_array()
        scores = self.prompt_logprobs
        if scores is not None and any(entry is None for entry in scores[1:]):
            return ids[:0]
        return ids[:-1]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def id_array(self) -> np.ndarray:
        """all_ids as a read-only array. Tokens are only ever appended, so it is kept in a
        buffer that grows: a new token is copied once, not the whole history again (an array
        handed out earlier keeps its length and contents)."""
        count = self.num_tokens
        known = -1 if self._view is None else self._view.size  # tokens in the buffer
        if count == known:  # nothing new: the last array again
            return self._view
        if known < 0 or known > count:  # the first call (or a history that shrank)
            self._ids = np.empty(count + _ID_HEADROOM, dtype=np.int64)
            self._ids[:count] = self.all_ids
        elif count > known:  # tokens appended since the last call: copy those alone
            if count > self._ids.size:
                grown = np.empty(2 * count, dtype=np.int64)
                grown[:known] = self._ids[:known]
                self._ids = grown
            self._ids[known:count] = self.token_slice(known, count)
        ids = self._ids[:count]
        ids.flags.writeable = False
        self._view = ids
        return ids

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus output (without building the joined list)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop], joining the two lists only where the slice spans both."""
        split = len(self.prompt_ids)
        if stop <= split:
            return self.prompt_ids[start:stop]
        if start >= split:
            return self.output_ids[start - split : stop - split]
        return self.prompt_ids[start:] + self.output_ids[: stop - split]

    @property
    def done(self) -> bool:
        return self.finish_reason != FinishReason.NONE

    def completion(self) -> Completion:
        return Completion(
            self.request_id,
            tuple(self.prompt_ids),
            tuple(self.output_ids),
            self.text,
            self.finish_reason.openai or "abort",
            self.usage(),
            self.speculation,
            self.error,
            None if self.logprobs is None else tuple(self.logprobs),
            None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
        )

    def usage(self) -> Usage:
        cached = min(self.cached_tokens or 0, len(self.prompt_ids))
        return Usage(len(self.prompt_ids), len(self.output_ids), cached)

    def take_delta(self, text_limit: int | None = None) -> Delta | None:
        """The output not yet handed out, text up to `text_limit` characters (None when there
        is nothing new and the request is not finished)."""
        end = len(self.text) if text_limit is None or self.done else text_limit
        new_ids = tuple(self.output_ids[self.sent_tokens :])
        new_text = self.text[self.sent_chars : end]
        if not new_ids and not new_text and not self.done:
            return None
        logprobs = (
            None
            if self.logprobs is None
            else tuple(self.logprobs[self.sent_tokens : len(self.output_ids)])
        )
        first = self.sent_tokens == 0 and self.sent_chars == 0
        self.sent_tokens, self.sent_chars = len(self.output_ids), max(self.sent_chars, end)
        reason = self.finish_reason.openai
        scored = first and self.prompt_logprobs is not None
        return Delta(
            self.request_id,
            new_ids,
            new_text,
            reason,
            self.usage() if self.done or first else None,
            self.speculation,
            self.error,
            tuple(self.prompt_ids) if self.done or scored else None,
            logprobs,
            tuple(self.prompt_logprobs) if scored and self.prompt_logprobs is not None else None,
        )
