"""The loop's side toward callers: the requests in flight, their tokens and text as passes
commit, their streams, and their end (statistics, stream's final delta, id given back)."""

from __future__ import annotations

import collections
import logging
from typing import Any

from engine import state
from engine.shell.grammar import Grammars, Progress
from engine.shell.inbox import Inbox
from engine.shell.request import Request, TokenLogprob
from engine.shell.textio import TextOutput
from engine.state import FinishReason

log = logging.getLogger(__name__)


class Outputs:
    """Requests by uid and by id; `emit` hands a transition's tokens and finishes to them."""

    def __init__(
        self,
        tokenizer: Any,
        inbox: Inbox,
        stats: collections.Counter,
        spec: Any,
        grammars: Grammars,
    ) -> None:
        self.requests: dict[int, Request] = {}
        self.by_request_id: dict[str, Request] = {}
        self.sampling_uids: set[int] = set()  # requests with temperature > 0
        self.edited_uids: set[int] = set()  # requests with penalties or a logit bias
        self.logprob_uids: set[int] = set()  # requests that asked for logprobs
        self.scored_uids: set[int] = set()  # requests that asked for their prompt's
        self.text = TextOutput(tokenizer)
        self.inbox, self.stats, self.spec, self.grammars = inbox, stats, spec, grammars

    def add(self, request: Request) -> None:
        self.requests[request.uid] = request
        self.by_request_id[request.request_id] = request
        if not request.params.greedy:
            self.sampling_uids.add(request.uid)
        if request.params.penalized:
            self.edited_uids.add(request.uid)
        if request.params.logprobs is not None:
            self.logprob_uids.add(request.uid)
        if request.params.prompt_logprobs is not None:
            self.scored_uids.add(request.uid)
        if request.params.structured_outputs is not None:
            self.grammars.add(request.uid, request.params.structured_outputs)
        self.stats["prompt_tokens"] += len(request.prompt_ids)

    def emit(
        self,
        effects: state.Effects,
        logprobs: dict[int, list[TokenLogprob]] | None,
        emitted: dict[int, list[int]],
    ) -> dict[int, FinishReason]:
        """A transition's tokens (with their `logprobs`, for requests that asked) and
        finishes to its requests and their streams. Returns the requests still running that
        must end, by uid, with their reason: STOP where a stop string ended the text or the
        grammar is complete, ERROR where the grammar refused a token. The caller finishes
        them. `emitted`: the transition's tokens by request (`Effects.emitted`, built once
        by the caller)."""
        finished = effects.finished()
        stopped: dict[int, FinishReason] = {}
        progress: dict[int, Progress] = {}
        if self.grammars:  # some request has a grammar
            constrained = {u: t for u, t in emitted.items() if u in self.grammars}
            progress = self.grammars.advance_all(constrained) if constrained else {}
        if effects.emitted_tokens.shape[0]:
            self.stats["generated_tokens"] += effects.emitted_tokens.shape[0]
        for uid, tokens in emitted.items():
            request = self.requests[uid]
            request.output_ids.extend(tokens)
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.extend(logprobs.get(uid, [])[: len(tokens)])
            ending = self._grammar_end(request, progress[uid]) if uid in progress else None
            stop_token = finished.get(uid) is FinishReason.STOP  # its last token stopped it
            if self.text.update(request, tokens, stop_token) and ending is not FinishReason.ERROR:
                ending = FinishReason.STOP  # the text was cut at a stop string
            if ending is None:
                continue
            if uid in finished:  # that is why it ended
                finished[uid] = ending
            else:
                stopped[uid] = ending
        for uid, reason in finished.items():
            self.finish(self.requests[uid], reason)
        for uid in emitted:  # each finished one published its final delta
            if uid not in finished and uid not in stopped:
                self.publish(self.requests[uid])
        return stopped

    def _grammar_end(self, request: Request, progress: Progress) -> FinishReason | None:
        """The request's grammar past its new tokens (`progress`): STOP once complete, ERROR
        (with the reason) if it refused one."""
        if progress is Progress.REJECTED:
            request.error = "the output left its grammar: " + self.grammars.error(request.uid)
            return FinishReason.ERROR
        return FinishReason.STOP if progress is Progress.COMPLETE else None

    def finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        self.text.finish(request)
        self.stats["finished"] += 1
        if self.spec is not None:
            request.speculation = self.spec.remove(request.uid)
        self.publish(request)
        self.requests.pop(request.uid, None)
        self.by_request_id.pop(request.request_id, None)
        self.sampling_uids.discard(request.uid)
        self.edited_uids.discard(request.uid)
        self.logprob_uids.discard(request.uid)
        self.scored_uids.discard(request.uid)
        self.grammars.remove(request.uid)
        self.inbox.release(request.request_id)

    def publish(self, request: Request) -> None:
        if request.sink is None:
            return
        delta = request.take_delta(self.text.streamable_chars(request))
        if delta is not None:
            request.sink.put(delta)

    def close_all(self, message: str) -> None:
        """Last resort when the loop cannot go on: every open request, queued or running,
        gets its final delta with ERROR; nothing else is touched."""
        for kind, item in self.inbox.drain():
            if kind == "add":
                self.requests[item.uid] = item
        for request in list(self.requests.values()):
            if request.done:
                continue
            request.finish_reason, request.error = FinishReason.ERROR, message
            try:
                self.publish(request)
            except Exception:  # one broken sink must not keep the others open
                log.exception("closing the stream of %s failed", request.request_id)
