"""What the server tests share: prompts, the Engine.generate references, the served handle, and
small servers around a tiny random-weight engine whose loop a test can hold."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import attrs
import openai

from engine import Engine, SamplingParams
from engine.server import BackgroundServer, create_app
from engine.server.options import ServerOptions
from engine.server.runs import ServerState

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12
MAX_CONTEXT = 1024
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
SETTLE_POLLS = 1200  # 60 s at most: a bound on waiting, not an assertion on time


@attrs.frozen
class Served:
    url: str
    engine: Engine
    model: str
    references: dict[str, Any]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120
        )


def references_of(engine: Engine) -> dict[str, Any]:
    """Engine.generate results, one request at a time (the server tests send them one at a time)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, **SAMPLED)
    return {
        "completion/greedy": engine.generate(COMPLETION_PROMPT, greedy)[0],
        "completion/sampled": engine.generate(COMPLETION_PROMPT, sampled)[0],
        "chat/greedy": engine.generate([CHAT_MESSAGES], greedy)[0],
        "chat/sampled": engine.generate([CHAT_MESSAGES], sampled)[0],
    }


class Pacer:
    """Wraps `engine.step` to hold the engine loop where a test needs it: `pause()` stops it
    (nothing is drained or admitted), `crawl()` runs one step per queued submission or abort
    (so running requests gain one token each time and never finish on their own), `run()`
    lets it go."""

    def __init__(self, engine: Engine) -> None:
        self.mode = "run"
        self._engine = engine
        self._step = engine.step
        engine.step = self.step

    def pause(self) -> None:
        self.mode = "pause"

    def crawl(self) -> None:
        self.mode = "crawl"

    def run(self) -> None:
        self.mode = "run"

    def step(self) -> None:
        while self.mode == "pause" or (self.mode == "crawl" and self._engine.inbox.empty):
            time.sleep(0.005)
        self._step()


@attrs.frozen
class TinyServer:
    """A server around a tiny random-weight engine (token-id prompts only), paced by a Pacer."""

    url: str
    engine: Engine
    state: ServerState
    pacer: Pacer
    model: str = "random-tiny"

    def body(self, max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": [11, 12, 13],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            **fields,
        }

    def wait_idle(self) -> None:
        """Waits (bounded) until no request is anywhere and every KV slot is back (the step
        that ends the last request frees its planned-ahead slots after answering it)."""
        for _ in range(SETTLE_POLLS):
            if self._idle():
                break
            time.sleep(0.05)
        assert self._idle(), self.engine.metrics()
        self.engine.check()

    def _idle(self) -> bool:
        book = self.engine.book
        return (
            not self.engine.has_work
            and not self.state.in_flight
            and book.num_available == book.slots.capacity
        )


def tiny_engine(**overrides: Any) -> Engine:
    settings = dict(random_weights="tiny", device="cpu", dtype="float32", max_context=256)
    return Engine(**(settings | overrides))


@contextlib.contextmanager
def serving(engine: Engine, options: ServerOptions | None = None) -> Iterator[TinyServer]:
    pacer = Pacer(engine)
    app = create_app(engine, options=options)
    server = BackgroundServer(app).start()
    try:
        yield TinyServer(server.url, engine, app.state.server, pacer)
    finally:
        pacer.run()
        server.stop()
