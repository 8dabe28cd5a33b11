"""Load limits: a full waiting queue answers 429 with Retry-After (what was accepted still
completes), a request past its deadline is aborted with 408 (or an error event in its stream)
and its slots come back, a body over the limit gets 413; the server stays healthy after each."""

from __future__ import annotations

import asyncio
import json

import attrs
import httpx
import openai
import pytest
from serverkit import SETTLE_POLLS, TinyServer, serving, tiny_engine

from engine.server.options import ServerOptions

BOUND_WAIT_S = 60  # a bound on waiting for answers, not an assertion on time


def _client(server: TinyServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


async def _complete(client: openai.AsyncOpenAI, server: TinyServer, max_tokens: int) -> str:
    """The finish reason of one request, or the error it got."""
    body = server.body(max_tokens)
    try:
        reply = await client.completions.create(
            model=body.pop("model"),
            prompt=body.pop("prompt"),
            max_tokens=body.pop("max_tokens"),
            extra_body=body,
        )
    except openai.RateLimitError as error:
        assert error.response.headers["retry-after"] == "1"
        assert error.body["code"] == "queue_full" and "max-waiting-requests" in error.message
        return "429"
    return reply.choices[0].finish_reason


async def _first_answers(tasks: list[asyncio.Task], count: int) -> list[str]:
    """The results of the first `count` tasks to end (waiting at most BOUND_WAIT_S)."""
    done: set[asyncio.Task] = set()
    pending = set(tasks)
    while len(done) < count:
        finished, pending = await asyncio.wait(
            pending, timeout=BOUND_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        assert finished, f"only {len(done)} of {len(tasks)} requests were answered"
        done |= finished
    assert len(done) == count, "more requests were answered than the bound refuses"
    return [task.result() for task in done]


def _queued(server: TinyServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(s for s in text.splitlines() if s.startswith("engine_http_requests_queued "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def bounded():
    engine = tiny_engine(max_running_requests=1)
    with serving(engine, ServerOptions(max_waiting_requests=3)) as server:
        yield server


def test_concurrent_submissions_past_the_bound_get_429_and_the_accepted_complete(bounded):
    server = bounded

    async def main() -> None:
        client = _client(server)
        server.pacer.pause()  # nothing is admitted: every accepted request counts
        tasks = [asyncio.create_task(_complete(client, server, 4)) for _ in range(8)]
        assert await _first_answers(tasks, 5) == ["429"] * 5
        assert _queued(server) == 3
        server.pacer.run()
        assert sorted(await asyncio.gather(*tasks)) == ["429"] * 5 + ["length"] * 3
        # admitted or finished requests stop counting: as many are accepted again
        again = await asyncio.gather(*(_complete(client, server, 4) for _ in range(3)))
        assert again == ["length"] * 3

    asyncio.run(main())
    server.wait_idle()
    assert _queued(server) == 0
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_requests_waiting_behind_a_running_one_count_toward_the_bound(bounded):
    server = bounded

    async def main() -> None:
        client = _client(server)
        server.pacer.crawl()  # a step per submission: the running request never finishes
        body = server.body(200)
        blocker = await client.completions.create(
            model=body.pop("model"),
            prompt=body.pop("prompt"),
            max_tokens=body.pop("max_tokens"),
            stream=True,
            extra_body=body,
        )  # answered once its first token is out: it holds the only row
        tasks = [asyncio.create_task(_complete(client, server, 4)) for _ in range(5)]
        assert await _first_answers(tasks, 2) == ["429"] * 2
        for _ in range(SETTLE_POLLS):  # the engine takes the accepted ones from its inbox
            if server.engine.metrics()["num_waiting"] == 3:
                break
            await asyncio.sleep(0.05)
        assert server.engine.metrics()["num_waiting"] == 3 and _queued(server) == 3
        assert await _complete(client, server, 4) == "429"  # those waiting still count
        server.pacer.run()
        await blocker.close()  # the client leaves: its request is aborted
        results = sorted(await asyncio.gather(*tasks))
        assert results == ["429"] * 2 + ["length"] * 3

    asyncio.run(main())
    server.wait_idle()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


@pytest.fixture(scope="module")
def deadline():
    engine = tiny_engine(max_running_requests=4)
    with serving(engine, ServerOptions(request_timeout_s=0.3)) as server:
        yield server


def test_a_request_past_its_deadline_gets_408_and_its_slots_come_back(deadline):
    server = deadline
    for pace in (server.pacer.pause, server.pacer.crawl):  # before and after its first token
        pace()
        answer = httpx.post(f"{server.url}/v1/completions", json=server.body(200), timeout=60)
        assert answer.status_code == 408
        error = answer.json()["error"]
        assert error["code"] == "request_timeout" and "0.3 s" in error["message"]
        assert "--request-timeout" in error["message"]
        server.pacer.run()
        server.wait_idle()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_stream_past_its_deadline_ends_with_an_error_event_then_done(deadline):
    server = deadline
    server.pacer.crawl()  # its first token comes out, then it stalls
    body = server.body(200, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as answer:
        assert answer.status_code == 200  # the stream had begun
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    server.pacer.run()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    server.wait_idle()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'finish_reason="timeout"' in metrics


def test_without_a_deadline_the_same_server_answers(deadline):
    server = deadline
    options = server.state.options
    server.state.options = attrs.evolve(options, request_timeout_s=None)
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json=server.body(8), timeout=60)
    finally:
        server.state.options = options
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


@pytest.fixture(scope="module")
def small_bodies():
    with serving(tiny_engine(), ServerOptions(max_body_bytes=4096)) as server:
        yield server


def _chunks(data: bytes, size: int = 1000):
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("size", [5000, 20_000])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_gets_413(small_bodies, size, chunked):
    server = small_bodies
    body = json.dumps(server.body(4, user="x" * size)).encode()
    content = _chunks(body) if chunked else body
    answer = httpx.post(
        f"{server.url}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["code"] == "request_too_large" and "4096 bytes" in error["message"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ok = httpx.post(f"{server.url}/v1/completions", json=server.body(4), timeout=60)
    assert ok.status_code == 200
    server.wait_idle()
