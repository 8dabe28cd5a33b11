"""A response's assembly from its choices' deltas: server-sent events as the deltas come
(`sse`), or the whole JSON body once every choice has finished (`collect`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

import anyio
import attrs
from fastapi.responses import StreamingResponse

from engine.server.errors import OpenAIError, error_body
from engine.server.shapes import ResponseShape, combined_usage, usage_body
from engine.server.tool_parser import HermesToolParser
from engine.server.tools import ToolCalls, tool_call
from engine.shell.request import Usage


def event(body: dict[str, Any], include_usage: bool, usage: Usage | None = None) -> bytes:
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
        finally:  # `sse`'s generator (an async iterable is kept as it is given)
            await cast(AsyncGenerator[bytes, None], self.body_iterator).aclose()


@attrs.frozen(eq=False)
class Run:
    """One choice in flight: its index, first delta, the rest, and the text it starts with
    (the prompt, with echo)."""

    index: int
    first: Any
    deltas: AsyncGenerator[Any, None]
    echo: str = ""
    echo_logprobs: list[Any] | None = None  # the echo's tokens' logprobs (echo and logprobs)
    prompt_logprobs: list[Any] | None = None  # vLLM's prompt_logprobs body, where asked


async def sse(
    shape: ResponseShape,
    runs: list[Run],
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

    async def pump(run: Run) -> None:
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
                yield event(shape.chunk(run.index, "", role=True), include_usage, usage)
            if run.echo:
                chunk = shape.chunk(run.index, run.echo, logprobs=run.echo_logprobs)
                yield event(chunk, include_usage, usage)
        remaining = len(runs)
        while remaining:
            index, item = await events.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, OpenAIError):
                yield event(error_body(item.message, item.error_type, item.param, item.code), False)
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
                    yield event(chunk, include_usage, usage)
            elif delta.text or delta.logprobs:
                chunk = shape.chunk(
                    index, delta.text, logprobs=delta.logprobs, text_offset=offsets[index]
                )
                offsets[index] += len(delta.text)
                yield event(chunk, include_usage, usage)
            if delta.finish_reason == "error":  # what OpenAI's and vLLM's streams send
                failure = engine_failure(delta)
                yield event(error_body(failure.message, failure.error_type, None, None), False)
                break
            if delta.finish_reason is not None:
                usages[index] = delta.usage
                reason = delta.finish_reason
                if calls is not None and reason == "stop" and calls[index].called:
                    reason = "tool_calls"
                yield event(shape.chunk(index, None, reason), include_usage, usage)
        else:
            if include_usage:
                yield event(shape.usage_chunk(combined_usage(usages, n)), include_usage)
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


async def collect(
    shape: ResponseShape,
    runs: list[Run],
    n: int,
    tools: ToolCalls | HermesToolParser | None = None,
) -> dict[str, Any]:
    """The whole response: every choice's text (or its tool calls, where `tools`), finish
    reason and logprobs."""

    async def one(run: Run) -> tuple[dict[str, Any], Any]:
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
            raise engine_failure(last)
        asked = (run.echo_logprobs, run.first.logprobs, last.logprobs)
        entries = logprobs if any(part is not None for part in asked) else None
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


def engine_failure(delta: Any) -> OpenAIError:
    """The request's pass failed in the engine (the engine serves the others on)."""
    return OpenAIError(
        500,
        f"the engine failed while running this request: {delta.error}",
        None,
        None,
        "server_error",
    )
