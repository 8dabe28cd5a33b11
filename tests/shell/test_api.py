"""AsyncEngine.stream: a finished request is not aborted when its consumer stops at the final
delta (as the server's request runner does), and an abandoned one is, without a closed
event loop of a departed consumer killing the engine thread."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from engine.api import AsyncEngine
from engine.shell.engine import Engine
from engine.state import SamplingParams


def _engine() -> Engine:
    return Engine(
        random_weights="tiny", device="cpu", dtype="float32", max_context=64, kv_cache_slots=128
    )


def _recording_aborts(aengine: AsyncEngine) -> list[str]:
    aborted: list[str] = []
    real = aengine.abort

    def abort(request_id: str) -> None:
        aborted.append(request_id)
        real(request_id)

    aengine.abort = abort
    return aborted


async def _consume(aengine: AsyncEngine, request_id: str, stop_after: int | None) -> list:
    """Take deltas until the final one (returning without resuming the stream, as the
    server does) or until `stop_after` deltas."""
    deltas = []
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    async with aclosing(aengine.stream([5, 6, 7], params, request_id=request_id)) as stream:
        async for delta in stream:
            deltas.append(delta)
            if delta.finish_reason is not None or len(deltas) == stop_after:
                return deltas
    return deltas


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_finished_stream_is_not_aborted_and_an_abandoned_one_is():
    engine = _engine()
    aengine = AsyncEngine(engine).start()
    try:
        aborted = _recording_aborts(aengine)
        deltas = asyncio.run(_consume(aengine, "finishes", stop_after=None))
        assert deltas[-1].finish_reason == "length" and aborted == []
        deltas = asyncio.run(_consume(aengine, "abandoned", stop_after=1))
        assert deltas[-1].finish_reason is None and aborted == ["abandoned"]
    finally:
        aengine.stop()
    # The abandoned stream's loop closed before its abort's final delta was published: the
    # delta is dropped, not raised in the engine thread (which would kill the loop).
    assert aengine.loop_error is None
    engine.check()
    assert engine.book.slots.num_free == engine.book.slots.capacity
