"""AsyncEngine.stream: a finished request is not aborted when its consumer stops at the final
delta (as the server's request runner does), and an abandoned one is, without a closed
event loop of a departed consumer killing the engine thread."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import attrs
import pytest

from engine.api import AsyncEngine
from engine.shell.engine import Engine
from engine.shell.request import Completion
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
    assert engine.book.num_available == engine.book.slots.capacity


def test_async_generate_gives_what_engine_generate_gives():
    import engine as package

    assert package.AsyncEngine is AsyncEngine and package.Completion is Completion
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = _engine().generate([[5, 6, 7]], params)[0]
    aengine = AsyncEngine(_engine()).start()
    try:
        got = asyncio.run(aengine.generate([5, 6, 7], params, request_id=expected.request_id))
    finally:
        aengine.stop()
    assert isinstance(got, Completion)
    assert attrs.evolve(got, speculation=None) == attrs.evolve(expected, speculation=None)


def test_a_step_failing_outside_a_pass_ends_requests_with_error_and_serving_goes_on():
    engine = _engine()
    aengine = AsyncEngine(engine).start()
    real_admit, calls = engine._admit, []

    def admit_failing_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("admission broke")
        real_admit()

    engine._admit = admit_failing_once
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        failed = asyncio.run(aengine.generate([5, 6, 7], params))
        served = asyncio.run(aengine.generate([5, 6, 7], params))
    finally:
        aengine.stop()
    assert failed.finish_reason == "error" and "admission broke" in failed.error
    assert served.finish_reason == "length" and len(served.token_ids) == 3
    assert isinstance(aengine.loop_error, RuntimeError)
    engine.check()


def test_when_ending_the_requests_fails_too_their_streams_still_close():
    """The loop cannot go on (ending the requests raised): every open stream still gets a
    final delta instead of hanging."""
    engine = _engine()
    aengine = AsyncEngine(engine)

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    engine._admit = broken
    engine.abort_all = broken

    async def one() -> Completion:
        aengine.start()
        return await asyncio.wait_for(aengine.generate([5, 6, 7], {"max_tokens": 3}), 60)

    try:
        out = asyncio.run(one())
    finally:
        aengine.stop()
    assert out.finish_reason == "error" and "broken" in out.error
    assert not aengine.running and not aengine.healthy


def test_a_step_of_many_streams_wakes_the_event_loop_once_and_keeps_each_streams_order():
    """Each step puts one delta per stream from the engine thread: they reach the event loop
    in one hand-over (one wake-up of its socket, not one per delta), every stream's deltas
    in order and none lost."""
    engine = _engine()
    aengine = AsyncEngine(engine)  # stepped by hand below, on this thread
    wakeups = []

    async def main() -> list[list]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            wakeups.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counting
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        streams = [aengine.stream([5, 6, 7 + i], params) for i in range(8)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]  # submitted
        await asyncio.sleep(0)
        while engine.has_work:  # each step's deltas are put before the loop runs again
            before = len(wakeups)
            engine.step()
            assert len(wakeups) - before <= 1
        received = [[(await first)] for first in firsts]
        for stream, deltas in zip(streams, received, strict=True):
            async for delta in stream:
                deltas.append(delta)
        return received

    received = asyncio.run(main())
    for deltas in received:
        assert sum(len(d.token_ids) for d in deltas) == 6
        assert deltas[-1].finish_reason == "length"
    assert 0 < len(wakeups) < sum(len(d) for d in received)


class _Tokenizer:
    def encode(self, text):
        return [len(word) for word in text.split()]


def test_prompt_to_ids_takes_token_ids_text_and_refuses_the_rest():
    """Token ids pass as they are (list or tuple); text goes through the tokenizer; without
    one only token ids are allowed; bools and mixed lists are refused, naming the field."""
    from engine.errors import InvalidRequest
    from engine.shell.textio import prompt_to_ids

    assert prompt_to_ids(None, [3, 1, 2]) == [3, 1, 2]
    assert prompt_to_ids(_Tokenizer(), (4, 5)) == [4, 5]
    assert prompt_to_ids(_Tokenizer(), "ab c") == [2, 1]
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        prompt_to_ids(None, "text")
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        prompt_to_ids(None, [1, True])
    with pytest.raises(InvalidRequest, match="a list of token ids or a list of chat"):
        prompt_to_ids(_Tokenizer(), [1, "a"])
    with pytest.raises(InvalidRequest, match="got int"):
        prompt_to_ids(_Tokenizer(), 7)
