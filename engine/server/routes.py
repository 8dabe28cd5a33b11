"""The HTTP endpoints: completions and chat completions (JSON or SSE), models, health, metrics."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import InvalidRequest
from engine.server.errors import OpenAIError, error_body
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseShape
from engine.server.runs import ServerState, run_request
from engine.state import SamplingParams

router = APIRouter()
_SERVER_START_S = int(time.time())


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=max_tokens,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            seed=body.seed,
        )
    except ValueError as exc:
        field = re.match(r"^(\w+)=", str(exc))
        param = field.group(1) if field else None
        raise OpenAIError(400, str(exc), param, "invalid_value") from exc


def _check_servable(state: ServerState, model: str) -> None:
    if state.draining:
        raise OpenAIError(
            503,
            "the server is shutting down; retry on another replica",
            None,
            "shutting_down",
            "server_error",
        )
    if model != state.model_name:
        raise OpenAIError(
            400,
            f"model {model!r} is not served here; use {state.model_name!r}",
            "model",
            "model_not_found",
        )


async def _first_delta(deltas: AsyncIterator[Any], chat: bool) -> Any:
    """Waits for the first delta, turning the engine's validation error into a 400 (for chat,
    the engine's "prompt" is the request's "messages")."""
    try:
        first = await anext(deltas, None)
    except InvalidRequest as exc:
        field = "messages" if chat and exc.field == "prompt" else exc.field
        raise OpenAIError(400, f"{field}: {exc.message}", field, "invalid_value") from exc
    if first is None:
        raise OpenAIError(
            500, "the engine ended the request without a result", None, None, "server_error"
        )
    return first


def _event(body: dict[str, Any], include_usage: bool) -> bytes:
    if include_usage and "usage" not in body:
        body["usage"] = None
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator when it ends, so a stream cut
    short by the client releases (aborts and counts) its request now, not at garbage collection."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _sse(
    shape: ResponseShape, first: Any, deltas: AsyncIterator[Any], include_usage: bool
) -> AsyncIterator[bytes]:
    async with aclosing(deltas):
        if shape.chat:
            yield _event(shape.chunk("", role=True), include_usage)
        delta = first
        while delta is not None:
            if delta.text:
                yield _event(shape.chunk(delta.text), include_usage)
            if delta.finish_reason == "error":  # what OpenAI's and vLLM's streams send
                failure = _engine_failure(delta)
                yield _event(error_body(failure.message, failure.error_type, None, None), False)
                break
            if delta.finish_reason is not None:
                yield _event(shape.chunk(None, delta.finish_reason), include_usage)
                if include_usage:
                    yield _event(shape.usage_chunk(delta.usage), include_usage)
                break
            delta = await anext(deltas, None)
        yield b"data: [DONE]\n\n"


async def _collect(shape: ResponseShape, first: Any, deltas: AsyncIterator[Any]) -> dict[str, Any]:
    pieces = [first.text]
    last = first
    async with aclosing(deltas):
        async for delta in deltas:
            pieces.append(delta.text)
            last = delta
    if last.finish_reason == "error":
        raise _engine_failure(last)
    return shape.full("".join(pieces), last.finish_reason, last.usage)


def _engine_failure(delta: Any) -> OpenAIError:
    """The request's pass failed in the engine (the engine serves the others on)."""
    return OpenAIError(
        500,
        f"the engine failed while running this request: {delta.error}",
        None,
        None,
        "server_error",
    )


async def _generate(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: Any,
    max_tokens: int | None,
    chat: bool,
) -> Response:
    state = _state(request)
    _check_servable(state, body.model)
    params = _sampling_params(body, max_tokens if max_tokens is not None else state.max_context)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    shape = ResponseShape(chat, request_id, state.model_name)
    endpoint = "chat" if chat else "completions"
    deltas = run_request(state, request, endpoint, prompt, params, request_id)
    first = await _first_delta(deltas, chat)
    if body.stream:
        return SSEResponse(
            _sse(shape, first, deltas, body.include_usage), headers={"Cache-Control": "no-cache"}
        )
    return JSONResponse(await _collect(shape, first, deltas))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _generate(request, body, body.prompt, body.max_tokens, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    messages = [message.as_dict() for message in body.messages]
    return await _generate(request, body, messages, body.max_new_tokens, chat=True)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": _SERVER_START_S,
                "owned_by": "engine",
                "max_model_len": state.max_context,
            }
        ],
    }


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if not state.aengine.running:
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)
    if not state.aengine.healthy:
        health = state.aengine.engine.health
        body = {
            "status": "unhealthy",
            "failed_in_a_row": health.failed_in_a_row,
            "last_error": health.last_error,
        }
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
