"""A stream cut short (the client left, or the framework cancelled the response) closes every
choice's generator, whose closing aborts its request, and ends without an error of its own;
a whole response whose choice failed ends the others at once."""

from __future__ import annotations

import asyncio

import anyio
import attrs

from engine.server.errors import OpenAIError
from engine.server.respond import Run, collect, sse
from engine.server.shapes import ResponseShape


@attrs.frozen
class _Delta:
    text: str
    token_ids: tuple[int, ...] = (1,)
    finish_reason: str | None = None
    logprobs: object = None
    usage: object = None
    error: str | None = None


def _runs(closed: list[int], count: int) -> list[Run]:
    """`count` choices whose first delta has come and whose next never does; each notes its
    index in `closed` when its generator is closed (as `run_request`'s aborts its request)."""

    async def deltas(index: int):
        try:
            await asyncio.Event().wait()  # the engine has nothing more yet
            yield _Delta("never")
        finally:
            closed.append(index)

    return [Run(index, _Delta("a"), deltas(index)) for index in range(count)]


def _stream(runs: list[Run]):
    return sse(ResponseShape(False, "cmpl-1", "m", str), runs, False, len(runs))


def test_a_stream_the_client_leaves_closes_every_choice():
    """The choices' pumps wait inside their generators (`anext`) when the stream is closed:
    closing a generator another task is running raised RuntimeError ("aclose(): asynchronous
    generator is already running"), an exception in the ASGI application at every disconnect
    mid-stream. The pumps are now waited for first."""
    closed: list[int] = []

    async def scenario() -> None:
        stream = _stream(_runs(closed, 2))
        assert (await anext(stream)).startswith(b"data: ")
        for _ in range(5):  # the pumps put their first deltas and wait for the next
            await asyncio.sleep(0)
        await stream.aclose()

    asyncio.run(scenario())
    assert sorted(closed) == [0, 1]


def test_a_stream_cancelled_by_its_task_group_closes_every_choice():
    """As Starlette ends a streaming response when the client disconnects: the task group's
    scope is cancelled while the stream waits for a delta. Under anyio a cancelled scope
    cancels every wait in it again, so the stream's clean-up (waiting for its pumps, closing
    the generators) runs shielded; it completes, and the cancellation still ends the stream."""
    closed: list[int] = []
    chunks: list[bytes] = []

    async def scenario() -> None:
        stream = _stream(_runs(closed, 3))

        async def consume() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        async with anyio.create_task_group() as group:
            group.start_soon(consume)
            for _ in range(10):
                await asyncio.sleep(0)
            group.cancel_scope.cancel()

    asyncio.run(scenario())
    assert len(chunks) == 3  # each choice's first delta, then the wait that was cancelled
    assert sorted(closed) == [0, 1, 2]


def test_a_response_whose_choice_failed_ends_the_other_choices_at_once():
    """A non-streamed request with n choices: where one ends with an engine error, the 500
    is answered at once and the other choices are closed (their requests aborted); they ran
    to their own end first, using the device for nothing."""
    closed: list[int] = []

    async def failed():
        yield _Delta("", finish_reason="error", error="InjectedFault: forward")

    async def scenario() -> None:
        runs = _runs(closed, 2)
        runs.append(Run(2, _Delta("b"), failed()))
        shape = ResponseShape(False, "cmpl-1", "m", str)
        try:
            await asyncio.wait_for(collect(shape, runs, 3), timeout=60)
        except OpenAIError as error:
            assert error.status_code == 500 and "InjectedFault" in str(error)
        else:
            raise AssertionError("the failed choice did not fail the response")
        assert sorted(closed) == [0, 1]  # when the 500 is answered, not at the loop's end

    asyncio.run(scenario())
