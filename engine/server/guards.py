"""ASGI middleware in front of the routes: the API key (`--api-key`) and the request body size
limit (`--max-body-bytes`). Both answer with OpenAI error bodies."""

from __future__ import annotations

import hmac
from typing import Any

from engine.server.errors import OpenAIError
from engine.server.metrics import ServerMetrics

OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers probe it)
# A body past the limit is still read (and dropped) up to this many times the limit, so the
# client, still sending, reads the 413 instead of a reset connection; past it, the connection
# is closed after the 413.
DRAIN_FACTOR = 2

Scope = dict[str, Any]
Receive = Any
Send = Any


async def _reject(error: OpenAIError, metrics: ServerMetrics, scope: Scope, send: Send) -> None:
    metrics.requests_rejected.labels(str(error.status_code)).inc()
    await error.response()(scope, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


class RequireAPIKey:
    """Every HTTP request but those to OPEN_PATHS needs `Authorization: Bearer <key>`; the key
    is compared in constant time. Others get 401."""

    def __init__(self, app: Any, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self._key = api_key.encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            401,
            "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
            None,
            "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await _reject(error, self._metrics, scope, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    credentials.strip(), self._key
                )
        return False


class BodyLimit:
    """Reads the request body before the app does; a body of more than `max_bytes` (declared
    by Content-Length or sent chunked) gets 413 and never reaches the app."""

    def __init__(self, app: Any, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes * DRAIN_FACTOR:
            await self._too_large(scope, send)
            return
        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request: nothing to answer
            size += len(message.get("body", b""))
            more_body = message.get("more_body", False)
            if size > self.max_bytes * DRAIN_FACTOR:
                break
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
        if size > self.max_bytes:
            await self._too_large(scope, send)
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        error = OpenAIError(
            413,
            f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
            None,
            "request_too_large",
        )
        await _reject(error, self._metrics, scope, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then the client's own messages (so a
    handler still sees the client disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
