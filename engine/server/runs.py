"""One generation request in flight: submit to the AsyncEngine, stream its deltas, and abort it
the moment its client goes away, its deadline passes, or the server shuts down."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import attrs
from starlette.requests import Request

from engine.api import QueueFull
from engine.errors import InvalidRequest
from engine.server.errors import OpenAIError
from engine.server.metrics import ServerMetrics
from engine.server.options import RETRY_AFTER_S, ServerOptions

request_log = logging.getLogger("engine.server.requests")


@attrs.define
class ServerState:
    """What the handlers share: the engine, the served model name, metrics, requests in flight."""

    aengine: Any
    model_name: str
    max_context: int
    metrics: ServerMetrics
    options: ServerOptions = attrs.field(factory=ServerOptions)
    in_flight: set[str] = attrs.field(factory=set)
    draining: bool = False

    def __attrs_post_init__(self) -> None:
        # The gauges read the set and the AsyncEngine when scraped: no count is kept beside.
        self.metrics.http_in_flight.set_function(lambda: len(self.in_flight))
        self.metrics.requests_queued.set_function(lambda: self.aengine.num_unadmitted)

    def check_model(self, model: str, status: int = 400) -> None:
        """OpenAIError (`status`, code model_not_found) unless `model` is the one served."""
        if model != self.model_name:
            raise OpenAIError(
                status,
                f"model {model!r} is not served here; use {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def abort_all(self) -> None:
        """Shutdown: refuse new requests and abort every request in flight."""
        self.draining = True
        for request_id in sorted(self.in_flight):
            self.aengine.abort(request_id)


async def _abort_on_disconnect(request: Request, state: ServerState, request_id: str) -> None:
    """Waits for the client to go away; then aborts the request so its slots are freed."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            state.aengine.abort(request_id)
            return


@attrs.define
class _Progress:
    """One request's timeline and token count, for the latency metrics and its log line."""

    endpoint: str
    arrival_s: float = attrs.field(factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    prompt_tokens: int | None = None

    def observe(self, metrics: ServerMetrics, delta: Any) -> None:
        """Records TTFT or inter-token latency, and the finish."""
        now_s = time.perf_counter()
        if delta.finish_reason is not None:
            metrics.requests_finished.labels(self.endpoint, delta.finish_reason).inc()
            metrics.request_seconds.observe(now_s - self.arrival_s)
            if delta.usage is not None:
                self.prompt_tokens = delta.usage.prompt_tokens
        if not delta.token_ids:
            return
        if self.last_token_s is None:
            self.first_token_s = now_s
            metrics.ttft_seconds.observe(now_s - self.arrival_s)
        else:
            metrics.itl_seconds.observe(now_s - self.last_token_s)
        self.last_token_s = now_s
        self.num_tokens += len(delta.token_ids)


def _log_request(
    options: ServerOptions, request_id: str, progress: _Progress, finish: str, prompt: Any
) -> None:
    """`--log-requests`: one line per request; the prompt only with `--log-prompts`."""
    if not options.logs_requests:
        return
    ttft = progress.first_token_s
    line = (
        f"request {request_id} endpoint={progress.endpoint} "
        f"prompt_tokens={'-' if progress.prompt_tokens is None else progress.prompt_tokens} "
        f"completion_tokens={progress.num_tokens} "
        f"ttft_s={'-' if ttft is None else f'{ttft - progress.arrival_s:.3f}'} "
        f"total_s={time.perf_counter() - progress.arrival_s:.3f} finish={finish}"
    )
    if options.log_prompts:
        line += f" prompt={json.dumps(prompt, ensure_ascii=False, default=_loggable)}"
    request_log.info("%s", line)


def _loggable(value: Any) -> Any:
    """A prompt's part as JSON can take it: a chat prompt's messages and tools as a dict."""
    return attrs.asdict(value) if attrs.has(type(value)) else str(value)


def _queue_full(error: QueueFull) -> OpenAIError:
    return OpenAIError(
        429,
        f"the server is at capacity: {error.max_waiting} requests are waiting to start "
        f"(--max-waiting-requests); retry after {RETRY_AFTER_S} s",
        None,
        "queue_full",
        "rate_limit_error",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _timed_out(timeout_s: float) -> OpenAIError:
    return OpenAIError(
        408,
        f"the request ran past the server's request timeout of {timeout_s:g} s "
        "(--request-timeout) and was aborted",
        None,
        "request_timeout",
        "timeout_error",
    )


async def _next_delta(deltas: AsyncIterator[Any], deadline: float | None) -> Any:
    """The next delta; TimeoutError once the loop's clock passes `deadline` (closing `deltas`,
    which aborts the request)."""
    if deadline is None:
        return await anext(deltas)
    async with asyncio.timeout_at(deadline):
        return await anext(deltas)


async def run_request(
    state: ServerState, request: Request, endpoint: str, prompt: Any, params: Any, request_id: str
) -> AsyncGenerator[Any, None]:
    """The deltas of one request. The engine's InvalidRequest surfaces on the first step; a
    full waiting queue as a 429 OpenAIError, and a passed deadline as a 408 (at any step).

    The request is aborted if the client disconnects, its deadline passes, or the consumer
    stops before the final delta (a stream cancelled by the server framework), so no KV slot
    outlives its client.
    """
    progress = _Progress(endpoint)
    timeout_s = state.options.request_timeout_s
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    state.in_flight.add(request_id)
    watcher = asyncio.create_task(_abort_on_disconnect(request, state, request_id))
    finished = False
    ended_as: str | None = "abort"  # None: refused at submission, nothing was queued
    try:
        async with aclosing(state.aengine.stream(prompt, params, request_id=request_id)) as deltas:
            try:
                delta = await _next_delta(deltas, deadline)
            except InvalidRequest:
                ended_as = None
                raise
            except QueueFull as error:
                ended_as = None
                raise _queue_full(error) from error
            while True:
                progress.observe(state.metrics, delta)
                finished = delta.finish_reason is not None
                if finished:
                    ended_as = delta.finish_reason
                yield delta
                if finished:
                    return
                delta = await _next_delta(deltas, deadline)
    except TimeoutError as error:  # `deltas` is closed: the request was aborted
        ended_as = "timeout"
        raise _timed_out(timeout_s or 0.0) from error
    finally:
        watcher.cancel()
        state.in_flight.discard(request_id)
        if not finished and ended_as is not None:
            # the client left, the deadline passed, or the stream was cancelled: closing
            # `deltas` above aborted the request, which frees its slots at the engine's next step
            state.metrics.requests_finished.labels(endpoint, ended_as).inc()
        if ended_as is not None:
            _log_request(state.options, request_id, progress, ended_as, prompt)
