"""Asyncio front: the engine loop runs in one background thread; coroutines only submit,
stream and abort. Submissions not yet admitted can be bounded (`QueueFull` beyond the bound)."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import AsyncGenerator, Callable

from engine.shell.distributed import WorkerFailed
from engine.shell.engine import Engine, Prompt
from engine.shell.request import Completion, Delta
from engine.state import FinishReason, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """A submission found `max_waiting` requests already waiting to be admitted."""

    def __init__(self, max_waiting: int) -> None:
        super().__init__(f"{max_waiting} requests are already waiting to be admitted")
        self.max_waiting = max_waiting


class _LoopPost:
    """Deltas on their way from the engine thread to one event loop's queues. The first of a
    burst (a step emits one delta per request) wakes the loop; the others join it before the
    loop runs the hand-over, so a step with many streams costs one wake-up, not one each (each
    is a write to the loop's socket). Each queue gets its deltas in the order they were put."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # not kept alive by its entry in `_posts`
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Delta], Delta]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[Delta], delta: Delta) -> None:
        with self._lock:
            self._pending.append((queue, delta))
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the consumer's event loop is closed: nobody is left to read
            if loop is not None and not loop.is_closed():
                raise
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _hand_over(self) -> None:  # on the event loop
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, delta in pending:
            queue.put_nowait(delta)


_posts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPost] = (
    weakref.WeakKeyDictionary()
)
_posts_lock = threading.Lock()


def _post_for(loop: asyncio.AbstractEventLoop) -> _LoopPost:
    with _posts_lock:
        post = _posts.get(loop)
        if post is None:
            post = _posts[loop] = _LoopPost(loop)
        return post


class _AsyncSink:
    """A sink the engine thread puts deltas into; they arrive on the event loop's queue
    (through its `_LoopPost`). `on_final(sink)` is called (in the engine thread) when the
    final delta is put."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_final: Callable[[_AsyncSink], None]
    ) -> None:
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._post = _post_for(loop)
        self._on_final = on_final

    def put(self, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self._on_final(self)
        self._post.put(self.queue, delta)


class AsyncEngine:
    """Owns the thread that calls `engine.step()`; everything else goes through the inbox.

    With `max_waiting`, a submission is refused (`QueueFull`) while that many of the requests
    submitted here are not yet admitted: queued in the inbox or waiting in the engine. A request
    stops counting once admitted (a retracted one, sent back to waiting, does not count again)
    or finished."""

    def __init__(self, engine: Engine, max_waiting: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting}; use an integer >= 1, or None (no bound)")
        self.engine = engine
        self.max_waiting = max_waiting
        self._unadmitted: set[_AsyncSink] = set()  # one per request not yet admitted
        self._unadmitted_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop_error: BaseException | None = None

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_unadmitted(self) -> int:
        """Requests submitted here and not yet admitted (what `max_waiting` bounds)."""
        return len(self._unadmitted)

    @property
    def healthy(self) -> bool:
        """The loop runs and the engine's passes are not failing in a row."""
        return self.running and self.engine.healthy

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_work:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()  # a failed pass ends its own requests with "error"
            except Exception as error:  # outside any pass: end every request, go on
                log.exception("an engine step failed; every request ends with 'error'")
                self.loop_error = error
                self.engine.health.failed(error)
                if not self._end_all(FinishReason.ERROR, error):
                    return
                if isinstance(error, WorkerFailed):  # a rank is gone: no pass can run
                    return
            self._release_admitted()
        self._end_all(FinishReason.ABORT)

    def _release_admitted(self) -> None:
        """After a step (in the loop thread, which owns the engine's queues): requests the
        engine has taken from its inbox and no longer holds waiting stop counting."""
        with self._unadmitted_lock:
            if not self._unadmitted:
                return
            tracked = set(self._unadmitted)
        waiting = {request.sink for request in self.engine.waiting}
        admitted = {
            request.sink
            for request in self.engine.requests.values()
            if request.sink in tracked and request.sink not in waiting
        }
        with self._unadmitted_lock:
            self._unadmitted -= admitted

    def _release(self, sink: _AsyncSink) -> None:
        with self._unadmitted_lock:
            self._unadmitted.discard(sink)

    def _end_all(self, reason: FinishReason, error: BaseException | None = None) -> bool:
        """End every request with `reason`. If that fails too, close their streams with
        ERROR without touching the pool, and return False: the loop cannot go on."""
        try:
            self.engine.abort_all(reason, error)
            return True
        except Exception as error:
            log.exception("ending the requests failed; closing their streams")
            self.loop_error = error
            self.engine.close_streams(error)
            return False

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
    ) -> tuple[str, _AsyncSink]:
        """Validate and queue; raises InvalidRequest, or QueueFull past `max_waiting`, at
        once. Call from the event loop."""
        if self._stopping.is_set():
            raise RuntimeError("the engine is shutting down")
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError(f"the engine loop stopped after a failure: {self.loop_error}")
        sink = _AsyncSink(asyncio.get_running_loop(), self._release)
        with self._unadmitted_lock:  # counted before it is queued: none slips past the bound
            if self.max_waiting is not None and len(self._unadmitted) >= self.max_waiting:
                raise QueueFull(self.max_waiting)
            self._unadmitted.add(sink)
        try:
            rid = self.engine.submit(prompt, params, request_id=request_id, sink=sink)
        except BaseException:
            self._release(sink)
            raise
        self._wake.set()
        return rid, sink

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Deltas of one request. Closing the iterator early aborts the request."""
        rid, sink = self.submit(prompt, params, request_id)
        finished = False
        try:
            while True:
                delta = await sink.queue.get()
                # Set before yielding: a consumer may stop right after the final delta, which
                # closes this generator at the yield; a finished request needs no abort.
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """The request's Completion, as `Engine.generate` gives it."""
        return Completion.of_deltas([d async for d in self.stream(prompt, params, request_id)])

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, abort what is in flight, and join the loop thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
