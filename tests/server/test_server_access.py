"""Access and operations: the API key (401 without it or with a wrong one, /health open), CORS
headers for allowed origins only, one log line per request without the prompt unless asked."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from serverkit import serving, tiny_engine

from engine.server.options import ServerOptions

KEY = "sk-test-0123456789"
ALLOWED = "https://app.example"
PROMPT = [101, 202, 203, 204, 205]


@pytest.fixture(scope="module")
def guarded():
    options = ServerOptions(api_key=KEY, allowed_origins=[ALLOWED])
    with serving(tiny_engine(), options) as server:
        yield server


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}],
)
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("GET", "/v1/models/any"),
    ],
)
def test_without_the_key_every_endpoint_but_health_answers_401(guarded, headers, method, path):
    answer = httpx.request(
        method, f"{guarded.url}{path}", json=guarded.body(), headers=headers, timeout=60
    )
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == "Bearer"
    error = answer.json()["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
    assert httpx.get(f"{guarded.url}/health").json() == {"status": "ok"}


def test_the_openai_client_is_refused_with_a_wrong_key_and_served_with_the_right_one(guarded):
    with pytest.raises(openai.AuthenticationError):
        _client(guarded.url, "sk-wrong").models.list()
    client = _client(guarded.url, KEY)
    assert [model.id for model in client.models.list().data] == [guarded.model]
    reply = client.completions.create(
        model=guarded.model, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    metrics = httpx.get(f"{guarded.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert metrics.status_code == 200 and 'engine_http_requests_rejected_total{status="401"}' in (
        metrics.text
    )
    guarded.wait_idle()


def test_cors_headers_go_to_allowed_origins_only(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    allowed = httpx.get(f"{guarded.url}/v1/models", headers=auth | {"Origin": ALLOWED})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    other = httpx.get(f"{guarded.url}/v1/models", headers=auth | {"Origin": "https://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    # a browser's preflight carries no key
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(f"{guarded.url}/v1/completions", headers=preflight | {"Origin": ALLOWED})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = httpx.options(
        f"{guarded.url}/v1/completions", headers=preflight | {"Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in refused.headers


@pytest.fixture(scope="module")
def plain():
    with serving(tiny_engine(), ServerOptions(log_requests=True)) as server:
        yield server


def test_without_allowed_origins_there_are_no_cors_headers(plain):
    answer = httpx.get(f"{plain.url}/v1/models", headers={"Origin": ALLOWED})
    assert answer.status_code == 200  # and no key is needed
    assert not any(name.startswith("access-control-") for name in answer.headers)


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engine.server.requests"]


@pytest.mark.parametrize("stream", [False, True])
def test_log_requests_writes_one_line_per_request_without_the_prompt(plain, caplog, stream):
    caplog.set_level(logging.INFO, logger="engine.server.requests")
    body = plain.body(5, stream=stream) | {"prompt": PROMPT}
    answer = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200
    plain.wait_idle()
    (line,) = _request_lines(caplog)
    assert line.startswith("request cmpl-") and "endpoint=completions" in line
    assert "prompt_tokens=5 completion_tokens=5" in line and "finish=length" in line
    assert " ttft_s=" in line and "ttft_s=-" not in line
    if not stream:
        assert f"request {answer.json()['id']} " in line
    assert "prompt=" not in line and "101, 202" not in line and "101,202" not in line


def test_log_prompts_adds_the_prompt(plain, caplog):
    options = plain.state.options
    plain.state.options = ServerOptions(log_prompts=True)
    try:
        caplog.set_level(logging.INFO, logger="engine.server.requests")
        body = plain.body(2) | {"prompt": PROMPT}
        assert httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        plain.state.options = options
    plain.wait_idle()
    (line,) = _request_lines(caplog)
    assert line.endswith(" prompt=[101, 202, 203, 204, 205]")


def test_a_refused_request_writes_no_line(plain, caplog):
    caplog.set_level(logging.INFO, logger="engine.server.requests")
    body = plain.body(2) | {"prompt": [999]}  # outside the tiny vocabulary
    assert httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).status_code == 400
    assert _request_lines(caplog) == []
    assert httpx.get(f"{plain.url}/health").json() == {"status": "ok"}
