"""One generation request in flight: submit to the AsyncEngine, stream its deltas, and abort it
the moment its client goes away (or the server shuts down)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import attrs
from starlette.requests import Request

from engine.errors import InvalidRequest
from engine.server.metrics import ServerMetrics


@attrs.define
class ServerState:
    """What the handlers share: the engine, the served model name, metrics, requests in flight."""

    aengine: Any
    model_name: str
    max_context: int
    metrics: ServerMetrics
    in_flight: set[str] = attrs.field(factory=set)
    draining: bool = False

    def __attrs_post_init__(self) -> None:
        # The gauge reads the set when scraped: no count is kept beside it.
        self.metrics.http_in_flight.set_function(lambda: len(self.in_flight))

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


def _observe(
    metrics: ServerMetrics, endpoint: str, delta: Any, arrival_s: float, last_s: float | None
) -> float | None:
    """Records TTFT or inter-token latency, and the finish; returns the new last-token time."""
    now_s = time.perf_counter()
    if delta.finish_reason is not None:
        metrics.requests_finished.labels(endpoint, delta.finish_reason).inc()
        metrics.request_seconds.observe(now_s - arrival_s)
    if not delta.token_ids:
        return last_s
    if last_s is None:
        metrics.ttft_seconds.observe(now_s - arrival_s)
    else:
        metrics.itl_seconds.observe(now_s - last_s)
    return now_s


async def run_request(
    state: ServerState, request: Request, endpoint: str, prompt: Any, params: Any, request_id: str
) -> AsyncIterator[Any]:
    """The deltas of one request. The engine's InvalidRequest surfaces on the first step.

    The request is aborted if the client disconnects, or if the consumer stops before the final
    delta (a stream cancelled by the server framework), so no KV slot outlives its client.
    """
    arrival_s = time.perf_counter()
    state.in_flight.add(request_id)
    watcher = asyncio.create_task(_abort_on_disconnect(request, state, request_id))
    finished = False
    last_token_s: float | None = None
    try:
        async with aclosing(state.aengine.stream(prompt, params, request_id=request_id)) as deltas:
            try:
                delta = await anext(deltas)
            except InvalidRequest:
                finished = True  # refused at submission: nothing was queued, nothing to abort
                raise
            while True:
                last_token_s = _observe(state.metrics, endpoint, delta, arrival_s, last_token_s)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
                delta = await anext(deltas)
    finally:
        watcher.cancel()
        state.in_flight.discard(request_id)
        if not finished:  # the client left, or the stream was cancelled: closing `deltas`
            # above aborted the request, which frees its slots at the engine's next step
            state.metrics.requests_finished.labels(endpoint, "abort").inc()
