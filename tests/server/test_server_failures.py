"""A pass that fails in the engine: its request gets HTTP 500 (or an error event in its
stream), the server answers the next request as before, and /health reports failures in a
row."""

from __future__ import annotations

import json

import httpx
import pytest

from engine import Engine
from engine.server import BackgroundServer, create_app
from engine.server.app import model_name_of
from engine.shell.failures import UNHEALTHY_AFTER, Faults


@pytest.fixture(scope="module")
def failing():
    engine = Engine(None, device="cpu", dtype="float32", max_running_requests=4, max_context=256)
    engine.faults = Faults.at()
    server = BackgroundServer(create_app(engine)).start()
    try:
        body = {"model": model_name_of(engine.config), "prompt": "The capital of", "max_tokens": 4}
        yield server.url, engine, body
    finally:
        server.stop()


def fail_next_forward(engine: Engine, count: int = 1) -> None:
    faults = engine.faults
    done = faults.calls["forward"]
    faults.plan["forward"] = frozenset(range(done + 1, done + 1 + count))


def test_a_failed_request_is_a_500_and_the_next_one_is_served(failing):
    url, engine, body = failing
    fail_next_forward(engine)
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "server_error"
    assert "injected fault at forward" in error["message"]
    ok = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    engine.check()


def test_a_failed_stream_ends_with_an_error_event(failing):
    url, engine, body = failing
    fail_next_forward(engine)
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60
    ) as answer:
        assert answer.status_code == 200  # the stream had begun: the error comes as an event
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]


def test_failures_in_a_row_make_health_503_until_a_request_succeeds(failing):
    url, engine, body = failing
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    fail_next_forward(engine, UNHEALTHY_AFTER)
    for _ in range(UNHEALTHY_AFTER):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 500
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy"
    assert health.json()["failed_in_a_row"] == UNHEALTHY_AFTER
    assert "injected fault" in health.json()["last_error"]
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
