"""Concurrency and disconnects: 32 streaming clients, then 200 requests of which a random third
leave early; afterwards every KV slot is free or held, unlocked, by the prefix cache, and
/metrics says so."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from serverkit import Served

LOAD_MAX_TOKENS = 8
# Requests that must still be streaming when their client leaves: far longer than it stays
LONG_MAX_TOKENS = 900
SETTLE_POLLS = 1200  # 60 s at most: a bound on waiting, not an assertion on time


def scrape(served: Served) -> dict[str, float]:
    """Unlabelled samples of /metrics, by sample name."""
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def unsettled(metrics: dict[str, float]) -> list[str]:
    """What a scrape still shows running or held, of every gauge the tests assert after
    settling: the engine's (aborts are applied at its next step) and the server's requests
    in flight (a handler ends after its request's slots may already be free)."""
    checks = {
        "requests running": metrics["engine_requests_running"] == 0,
        "requests waiting": metrics["engine_requests_waiting"] == 0,
        "KV slots used": metrics["engine_kv_slots_used"] == 0,
        "KV slots neither free nor cached": metrics["engine_kv_slots_free"]
        + metrics["engine_prefix_cache_slots"]
        == metrics["engine_kv_slots_total"],
        "cached slots locked": metrics["engine_prefix_cache_locked_slots"] == 0,
        "HTTP requests in flight": metrics["engine_http_requests_in_flight"] == 0,
    }
    return [name for name, settled in checks.items() if not settled]


def settle(served: Served) -> dict[str, float]:
    """Polls /metrics (bounded) until `unsettled` finds nothing; returns the last scrape.
    Once no handler is in flight, every finish (aborts included) has been counted too."""
    for _ in range(SETTLE_POLLS):
        metrics = scrape(served)
        if not unsettled(metrics):
            return metrics
        time.sleep(0.05)
    return metrics


def assert_all_slots_free(served: Served, metrics: dict[str, float]) -> None:
    assert unsettled(metrics) == []
    assert metrics["engine_kv_slots_total"] > 0
    engine_metrics = served.engine.metrics()
    for field, name in (
        ("kv_slots_used", "engine_kv_slots_used"),
        ("kv_slots_free", "engine_kv_slots_free"),
        ("num_running", "engine_requests_running"),
    ):
        assert _field(engine_metrics, field) == metrics[name], field
    served.engine.check()  # slot conservation and request-table integrity, from the engine


def _field(engine_metrics: object, field: str) -> float:
    return (
        engine_metrics[field]
        if isinstance(engine_metrics, dict)
        else getattr(engine_metrics, field)
    )


def _body(served: Served, index: int, max_tokens: int = LOAD_MAX_TOKENS) -> dict:
    return {
        "model": served.model,
        "prompt": f"Story number {index}: once upon a time",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def test_32_concurrent_streaming_clients(served: Served) -> None:
    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=served.model,
            prompt=f"Story number {index}: once upon a time",
            max_tokens=LOAD_MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def main() -> list[tuple[str, str, int]]:
        client = served.async_client()
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [reason for _, reason, _ in results] == ["length"] * 32
    assert [tokens for _, _, tokens in results] == [LOAD_MAX_TOKENS] * 32
    assert all(text for text, _, _ in results)
    assert_all_slots_free(served, settle(served))


async def _stay(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, int]:
    """Reads a whole stream; returns its finish reason and completion token count."""
    reason, tokens = "", -1
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    reason = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return reason, tokens


async def _leave_after_events(
    client: httpx.AsyncClient, url: str, body: dict, num_events: int
) -> None:
    async with client.stream("POST", url, json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= num_events:
                return  # leaving the block closes the connection mid-stream


async def _leave_at_once(client: httpx.AsyncClient, url: str, body: dict, delay_s: float) -> None:
    """Cancels the request after delay_s, whether it is waiting, streaming or done."""
    task = asyncio.ensure_future(_stay(client, url, body))
    await asyncio.sleep(delay_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_200_requests_with_a_random_third_leaving_early(served: Served) -> None:
    rng = random.Random(6)
    leavers = set(rng.sample(range(200), 200 // 3))
    aborted_before = scrape_abort_count(served)
    url = f"{served.url}/v1/completions"

    async def main() -> list[object]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            jobs = []
            for i in range(200):
                body = _body(served, i)
                if i not in leavers:
                    jobs.append(_stay(client, url, body))
                elif i % 2:  # mid-stream, whatever the pace: each of these is an abort
                    body = _body(served, i, max_tokens=LONG_MAX_TOKENS)
                    jobs.append(_leave_after_events(client, url, body, rng.randint(1, 3)))
                else:
                    jobs.append(_leave_at_once(client, url, body, rng.uniform(0.0, 1.0)))
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    stayed = [results[i] for i in range(200) if i not in leavers]
    assert stayed == [("length", LOAD_MAX_TOKENS)] * len(stayed)
    metrics = settle(served)
    assert_all_slots_free(served, metrics)
    # every client that left mid-stream was counted as an abort; one that left at once may
    # have left before its request was submitted or after it finished
    mid_stream = sum(i % 2 for i in leavers)
    assert mid_stream > 0
    assert aborted_before + mid_stream <= scrape_abort_count(served)
    assert scrape_abort_count(served) <= aborted_before + len(leavers)


def test_a_disconnect_mid_stream_aborts_the_request_and_frees_its_slots(served: Served) -> None:
    aborted_before = scrape_abort_count(served)

    async def main() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = _body(served, 0, max_tokens=LONG_MAX_TOKENS)
            async with client.stream("POST", f"{served.url}/v1/completions", json=body) as resp:
                lines = resp.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                return scrape(served)  # still streaming: the request holds slots

    during = asyncio.run(main())
    assert during["engine_requests_running"] == 1 and during["engine_kv_slots_used"] > 0
    assert_all_slots_free(served, settle(served))
    assert scrape_abort_count(served) == aborted_before + 1


def scrape_abort_count(served: Served) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "engine_http_requests_finished_total"
        and sample.labels.get("finish_reason") == "abort"
    )
