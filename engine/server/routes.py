"""The HTTP endpoints: completions and chat completions (JSON or SSE), models, health, metrics."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any, cast

import anyio
import attrs
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import InvalidRequest
from engine.server.errors import OpenAIError, error_body
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    combined_usage,
    usage_body,
)
from engine.server.runs import ServerState, run_request
from engine.server.tool_parser import HermesToolParser, reader_for
from engine.server.tools import ToolCalls, takes_tools, tool_call
from engine.shell.request import Usage
from engine.shell.textio import ChatPrompt
from engine.state import SamplingParams, StructuredOutputs

router = APIRouter()
_SERVER_START_S = int(time.time())
try:
    _VERSION = importlib.metadata.version("engine")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    _VERSION = "not installed"


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    """Every sampling field of the body, in the engine's terms (max_tokens None: up to the
    context limit); `structured`: what the output must match (`_constraint`)."""
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop_strings,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            seed=body.seed,
            n=body.n,
            logprobs=body.logprob_count,
            prompt_logprobs=body.prompt_logprob_count,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=tuple((body.logit_bias or {}).items()),
            structured_outputs=structured,
        )
    except ValueError as exc:
        field = re.match(r"^(\w+)=", str(exc))
        param = field.group(1) if field else None
        raise OpenAIError(400, str(exc), param, "invalid_value") from exc


def _constraint(
    body: CompletionRequest | ChatCompletionRequest, tokenizer: Any
) -> tuple[StructuredOutputs | None, str | None, ToolCalls | HermesToolParser | None]:
    """What the output must match, the request field it came from (one at most of
    response_format, structured_outputs and a tool choice), and the reader of the tool
    choice's calls."""
    sources: list[tuple[str, Any]] = []
    if body.response_format is not None and body.response_format.type != "text":
        sources.append(("response_format", body.response_format.structured))
    if body.structured_outputs is not None:
        sources.append(("structured_outputs", body.structured_outputs.structured))
    if isinstance(body, ChatCompletionRequest) and _tool_calls_asked(body):
        sources.append(("tool_choice", lambda: reader_for(body, tokenizer)))
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        message = f"{names} each constrain the output; give one of them"
        raise OpenAIError(400, message, sources[1][0], "invalid_value")
    if not sources:
        return None, None, None
    field, make = sources[0]
    try:
        made = make()
    except ValueError as exc:
        raise OpenAIError(400, f"{field}: {exc}", field, "invalid_value") from exc
    if isinstance(made, ToolCalls):
        return made.structured, field, made
    if isinstance(made, HermesToolParser):
        return None, field, made
    return made, field, None


def _tool_calls_asked(body: ChatCompletionRequest) -> bool:
    """Whether the request asks for tool calls (tools, and a tool choice other than "none";
    without one, "auto")."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            message = "tool_choice needs tools to choose from"
            raise OpenAIError(400, message, "tool_choice", "invalid_value")
        return False
    return body.tool_choice != "none"


def _check_servable(state: ServerState, model: str) -> None:
    if state.draining:
        raise OpenAIError(
            503,
            "the server is shutting down; retry on another replica",
            None,
            "shutting_down",
            "server_error",
        )
    state.check_model(model)


async def _first_delta(deltas: AsyncIterator[Any], chat: bool, origin: str | None = None) -> Any:
    """Waits for the first delta, turning the engine's validation error into a 400 (for chat,
    the engine's "prompt" is the request's "messages"; its "structured_outputs" is the field
    `origin` the constraint came from)."""
    try:
        first = await anext(deltas, None)
    except InvalidRequest as exc:
        field = "messages" if chat and exc.field == "prompt" else exc.field
        if origin is not None and field.startswith("structured_outputs"):
            field = origin
        raise OpenAIError(400, f"{field}: {exc.message}", field, "invalid_value") from exc
    if first is None:
        raise OpenAIError(
            500, "the engine ended the request without a result", None, None, "server_error"
        )
    return first


def _event(body: dict[str, Any], include_usage: bool, usage: Usage | None = None) -> bytes:
    """A server-sent event of `body`; with `include_usage` every chunk has a `usage` key
    (null but in the last chunk), or `usage`, its choice's so far (continuous_usage_stats)."""
    if usage is not None:
        body["usage"] = usage_body(usage)
    elif include_usage and "usage" not in body:
        body["usage"] = None
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator when it ends, so a stream cut
    short by the client releases (aborts and counts) its request now, not at garbage collection."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # `_sse`'s generator (an async iterable is kept as it is given)
            await cast(AsyncGenerator[bytes, None], self.body_iterator).aclose()


@attrs.frozen(eq=False)
class _Run:
    """One choice in flight: its index, first delta, the rest, and the text it starts with
    (the prompt, with echo)."""

    index: int
    first: Any
    deltas: AsyncGenerator[Any, None]
    echo: str = ""
    echo_logprobs: list[Any] | None = None  # the echo's tokens' logprobs (echo and logprobs)
    prompt_logprobs: list[Any] | None = None  # vLLM's prompt_logprobs body, where asked


async def _sse(
    shape: ResponseShape,
    runs: list[_Run],
    include_usage: bool,
    n: int,
    tools: ToolCalls | HermesToolParser | None = None,
    continuous: bool = False,
) -> AsyncGenerator[bytes, None]:
    """The chunks of every choice as they come (tool-call deltas where `tools`), then the
    usage (when asked) and [DONE]. `continuous`: each chunk carries its choice's usage so
    far (the prompt's and cached counts from its first delta, the tokens sent since)."""
    # (choice index, item): its next delta, the OpenAIError that ended it, or None (pump done)
    events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(run: _Run) -> None:
        try:
            delta = run.first
            while delta is not None:
                await events.put((run.index, delta))
                if delta.finish_reason is not None:
                    break
                delta = await anext(run.deltas, None)
        except OpenAIError as error:  # its deadline passed: the request was aborted
            await events.put((run.index, error))
        finally:
            await events.put((run.index, None))

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    usages: list[Any] = [None] * len(runs)
    produced = [0] * len(runs)  # each choice's tokens so far

    def so_far(index: int) -> Usage | None:
        if not continuous:
            return None
        first = runs[index].first.usage
        return Usage(first.prompt_tokens, produced[index], first.cached_tokens)

    # each choice's text so far; with the echo's logprobs, as the whole response counts it
    # (its tokens' texts: `ResponseShape.logprobs_body`)
    offsets = [
        len(run.echo)
        if run.echo_logprobs is None
        else sum(
            len(shape.token_text(e if isinstance(e, int) else e.token_id))
            for e in run.echo_logprobs
        )
        for run in runs
    ]
    calls = [tools.stream() for _ in runs] if tools is not None else None
    try:
        for run in runs:
            usage = so_far(run.index)
            if shape.chat:
                yield _event(shape.chunk(run.index, "", role=True), include_usage, usage)
            if run.echo:
                chunk = shape.chunk(run.index, run.echo, logprobs=run.echo_logprobs)
                yield _event(chunk, include_usage, usage)
        remaining = len(runs)
        while remaining:
            index, item = await events.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, OpenAIError):
                yield _event(
                    error_body(item.message, item.error_type, item.param, item.code), False
                )
                break
            delta = item
            produced[index] += len(delta.token_ids)
            usage = so_far(index)
            if calls is not None:
                read = calls[index].add(delta.text) if delta.text else ("", [])
                if delta.finish_reason is not None:
                    ending = calls[index].finish(delta.finish_reason == "stop")
                    read = (read[0] + ending[0], read[1] + ending[1])
                for chunk in _tool_read_chunks(shape, index, *read, delta.logprobs):
                    yield _event(chunk, include_usage, usage)
            elif delta.text or delta.logprobs:
                chunk = shape.chunk(
                    index, delta.text, logprobs=delta.logprobs, text_offset=offsets[index]
                )
                offsets[index] += len(delta.text)
                yield _event(chunk, include_usage, usage)
            if delta.finish_reason == "error":  # what OpenAI's and vLLM's streams send
                failure = _engine_failure(delta)
                yield _event(error_body(failure.message, failure.error_type, None, None), False)
                break
            if delta.finish_reason is not None:
                usages[index] = delta.usage
                reason = delta.finish_reason
                if calls is not None and reason == "stop" and calls[index].called:
                    reason = "tool_calls"
                yield _event(shape.chunk(index, None, reason), include_usage, usage)
        else:
            if include_usage:
                yield _event(shape.usage_chunk(combined_usage(usages, n)), include_usage)
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        # A pump may be inside its generator (`anext`): closing it then raises ("already
        # running"), so the pumps are waited for first. Shielded: a stream cut short ends in
        # a cancelled anyio scope (Starlette's, at a disconnect), which cancels every wait in
        # it again.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for run in runs:
                await run.deltas.aclose()  # a choice cut short is aborted: its slots are freed


async def _collect(
    shape: ResponseShape,
    runs: list[_Run],
    n: int,
    tools: ToolCalls | HermesToolParser | None = None,
) -> dict[str, Any]:
    """The whole response: every choice's text (or its tool calls, where `tools`), finish
    reason and logprobs."""

    async def one(run: _Run) -> tuple[dict[str, Any], Any]:
        pieces, last, logprobs = (
            [run.echo, run.first.text],
            run.first,
            [*(run.echo_logprobs or ()), *(run.first.logprobs or ())],
        )
        async with aclosing(run.deltas):
            async for delta in run.deltas:
                pieces.append(delta.text)
                logprobs.extend(delta.logprobs or ())
                last = delta
        if last.finish_reason == "error":
            raise _engine_failure(last)
        entries = logprobs if last.logprobs is not None or run.first.logprobs is not None else None
        if run.echo_logprobs is not None:
            entries = logprobs
        text, reason, calls = "".join(pieces), last.finish_reason, None
        content: str | None = text  # None: a chat message of tool calls alone
        if tools is not None:
            read, found = tools.read(text, reason == "stop")
            if found:
                content = read
                calls = [tool_call(name, arguments) for name, arguments in found]
                reason = "tool_calls" if reason == "stop" else reason
        choice = shape.choice(run.index, content, reason, entries, calls)
        if run.prompt_logprobs is not None and not shape.chat:
            choice["prompt_logprobs"] = run.prompt_logprobs
        return choice, last.usage

    tasks = [asyncio.ensure_future(one(run)) for run in runs]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:  # a choice failed (or the client left): the others end now too
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):  # each closes its generator: aborted, freed
            await asyncio.gather(*tasks, return_exceptions=True)
        raise
    body = shape.full([choice for choice, _ in done], combined_usage([u for _, u in done], n))
    if shape.chat and runs and runs[0].prompt_logprobs is not None:  # one prompt: vLLM's place
        body["prompt_logprobs"] = runs[0].prompt_logprobs
    return body


def _tool_read_chunks(
    shape: ResponseShape,
    index: int,
    content: str,
    calls: list[dict[str, Any]],
    logprobs: Any,
) -> list[dict[str, Any]]:
    """The chunks of what a tool-call reader made of new text: content (with the new
    tokens' logprobs, where asked), then call deltas."""
    chunks = [shape.chunk(index, content, logprobs=logprobs)] if content or logprobs else []
    return chunks + ([shape.tool_chunk(index, calls)] if calls else [])


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
    prompts: Sequence[str | list[int] | ChatPrompt],
    max_tokens: int | None,
    chat: bool,
) -> Response:
    """Every prompt's n choices (index: prompt by prompt, then sample), as one response."""
    state = _state(request)
    _check_servable(state, body.model)
    engine = state.aengine.engine
    structured, origin, tools = _constraint(body, engine.tokenizer)
    params = _sampling_params(body, max_tokens, structured)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.return_tokens_as_token_ids and params.logprobs is None:
        raise OpenAIError(
            400,
            "return_tokens_as_token_ids spells the tokens of logprobs; it needs logprobs",
            "return_tokens_as_token_ids",
            "invalid_value",
        )
    shape = ResponseShape(
        chat,
        request_id,
        state.model_name,
        _speller(engine.tokenizer),
        body.return_tokens_as_token_ids,
    )
    endpoint = "chat" if chat else "completions"
    echo = [
        _echo_text(engine.tokenizer, prompt) if getattr(body, "echo", False) else ""
        for prompt in prompts
    ]
    total = len(prompts) * params.n

    async def start(index: int) -> _Run:
        prompt, sample = divmod(index, params.n)
        one_id = request_id if total == 1 else f"{request_id}-{index}"
        deltas = run_request(
            state, request, endpoint, prompts[prompt], params.sample(sample), one_id
        )
        try:
            first = await _first_delta(deltas, chat, origin)
            return _Run(index, first, deltas, echo[prompt], *_prompt_scores(body, shape, first))
        except BaseException:
            await deltas.aclose()
            raise

    # Each prompt's first sample, then (its prompt's KV cached by then) the other samples.
    first_samples = [p * params.n for p in range(len(prompts))]
    others = [i for i in range(total) if i % params.n]
    runs: list[_Run] = []
    for group in (first_samples, others):
        started = await asyncio.gather(*(start(i) for i in group), return_exceptions=True)
        runs.extend(r for r in started if isinstance(r, _Run))
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:  # one invalid prompt refuses the whole request: the others end too
            for run in runs:
                await run.deltas.aclose()
            raise failed[0]
    runs.sort(key=lambda run: run.index)
    if body.stream:
        return SSEResponse(
            _sse(shape, runs, body.include_usage, params.n, tools, body.continuous_usage),
            headers={"Cache-Control": "no-cache"},
        )
    return JSONResponse(await _collect(shape, runs, params.n, tools))


def _prompt_scores(
    body: CompletionRequest | ChatCompletionRequest, shape: ResponseShape, first: Any
) -> tuple[list[Any] | None, list[Any] | None]:
    """From a choice's first delta: its echo's logprobs (the prompt's first token bare, the
    others with `logprobs` alternatives), where echo and logprobs are asked, and vLLM's
    prompt_logprobs body, where prompt_logprobs is."""
    scores, ids = first.prompt_logprobs, first.prompt_token_ids
    if scores is None or ids is None:
        return None, None
    echoed = None
    if body.echo_logprobs:
        top = body.logprob_count or 0
        echoed = [
            token if entry is None else attrs.evolve(entry, top=entry.top[:top])
            for token, entry in zip(ids, scores, strict=True)
        ]
    asked = body.prompt_logprobs
    return echoed, None if asked is None else shape.prompt_logprobs_body(scores, asked)


def _speller(tokenizer: Any) -> Any:
    """A token id's text for logprobs ("token_id:N" without a tokenizer, as vLLM spells it)."""
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token])


def _echo_text(tokenizer: Any, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "" if tokenizer is None else tokenizer.decode(prompt)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    # CompletionRequest's validator made `prompt` a list of prompts, whatever it was sent as
    prompts = cast(list[str | list[int]], body.prompt)
    return await _generate(request, body, prompts, body.max_tokens, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    messages = [message.as_dict() for message in body.messages]
    tokenizer = _state(request).aengine.engine.tokenizer
    tools = None
    if body.tools and body.tool_choice != "none" and takes_tools(tokenizer):
        tools = tuple(tool.model_dump(exclude_none=True) for tool in body.tools)
    prompt = ChatPrompt(tuple(messages), tools, body.rendering)
    return await _generate(request, body, [prompt], body.max_new_tokens, chat=True)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": _SERVER_START_S,
        "owned_by": "engine",
        "max_model_len": state.max_context,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(model, status=404)
    return _model_card(state)


@router.get("/version")
async def version() -> dict[str, str]:
    """The engine package's version (vLLM's /version)."""
    return {"version": _VERSION}


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
