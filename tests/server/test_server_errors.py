"""Bad input gets a 400 with an OpenAI error body naming the field; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serverkit import CHAT_MESSAGES, Served


def _valid(served: Served, path: str) -> dict:
    if path == "/v1/completions":
        return {"model": served.model, "prompt": "Hello", "max_tokens": 1}
    return {"model": served.model, "messages": CHAT_MESSAGES, "max_tokens": 1}


# (path, change to a valid body, param named in the error, words the message must contain)
BAD_BODIES = [
    ("/v1/completions", {"model": "no-such-model"}, "model", "no-such-model"),
    ("/v1/chat/completions", {"model": "gpt-4"}, "model", "gpt-4"),
    ("/v1/completions", {"prompt": [7] * 3000}, "prompt", "max_context"),
    ("/v1/completions", {"prompt": "lorem ipsum " * 1500}, "prompt", "max_context"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x " * 3000}]},
        "messages",
        "max_context",
    ),
    ("/v1/completions", {"max_tokens": -5}, "max_tokens", "-5"),
    ("/v1/chat/completions", {"max_tokens": -1}, "max_tokens", "-1"),
    ("/v1/completions", {"temperature": 2.5}, "temperature", "2.5"),
    ("/v1/chat/completions", {"temperature": -0.1}, "temperature", "-0.1"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/completions", {"n": 0}, "n", "n"),
    ("/v1/chat/completions", {"n": 65}, "n", "n"),
    ("/v1/completions", {"top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"top_k": 0}, "top_k", "top_k=0"),
    ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
    ("/v1/completions", {"prompt": None}, "prompt", "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages.0.role",
        "robot",
    ),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
    # fields this server does not implement are refused, never taken and ignored
    (
        "/v1/chat/completions",
        {"response_format": {"type": "xml"}},
        "response_format.type",
        "json_schema",
    ),
    ("/v1/completions", {"tools": []}, "tools", "not supported"),
    ("/v1/completions", {"suffix": "!"}, "suffix", "not supported"),
    ("/v1/completions", {"best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {"no_such_field": 1}, "no_such_field", "not supported"),
    # how chat messages render: a variable the template does not read is refused
    (
        "/v1/chat/completions",
        {"chat_template_kwargs": {"enable_thinking": False}},
        "chat_template_kwargs.enable_thinking",
        "does not read 'enable_thinking'",
    ),
    (
        "/v1/chat/completions",
        {"continue_final_message": True},
        "continue_final_message",
        "add_generation_prompt=false",
    ),
    (
        "/v1/completions",
        {"return_tokens_as_token_ids": True},
        "return_tokens_as_token_ids",
        "needs logprobs",
    ),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "0"),
    ("/v1/completions", {"truncate_prompt_tokens": 3, "echo": True}, "echo", "echo with"),
    (
        "/v1/completions",
        {"stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
        "needs include_usage",
    ),
    # vLLM's older names: the error names the field to use
    (
        "/v1/chat/completions",
        {"guided_choice": ["a"]},
        "guided_choice",
        'use structured_outputs {"choice"',
    ),
    ("/v1/completions", {"guided_json": {}}, "guided_json", 'use structured_outputs {"json"'),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
        "messages.0.name",
        "not supported",
    ),
    ("/v1/completions", {"max_tokens": 5000}, "max_tokens", "room for"),
    ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_tokens", "room for"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "21"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "21"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ("/v1/completions", {"bad_words": [" "]}, "bad_words", "non-empty"),
    ("/v1/chat/completions", {"allowed_token_ids": [999999]}, "allowed_token_ids", "vocabulary"),
    (
        "/v1/chat/completions",
        {"prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
        "stream=true",
    ),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs", "30"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty", "3"),
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty", "-2.5"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "0"),
    ("/v1/completions", {"min_p": 1.5}, "min_p", "1.5"),
    ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias", "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ("/v1/completions", {"stop_token_ids": [999999]}, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": ["Hello", ""]}, "prompt", "empty"),
]


def _post(served: Served, path: str, content: bytes) -> httpx.Response:
    return httpx.post(
        served.url + path,
        content=content,
        timeout=120,
        headers={"content-type": "application/json"},
    )


def _assert_still_serving(served: Served, path: str) -> None:
    response = _post(served, path, json.dumps(_valid(served, path)).encode())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("path", "change", "param", "words"), BAD_BODIES)
def test_bad_field_gets_400_naming_it(
    served: Served, path: str, change: dict, param: str, words: str
) -> None:
    _assert_rejected(served, path, {**_valid(served, path), **change}, param, words)


@pytest.mark.parametrize(
    ("path", "change", "param", "words"), [BAD_BODIES[i] for i in (0, 2, 4, 5, 10)]
)
def test_bad_field_of_a_stream_request_gets_400_before_any_event(
    served: Served, path: str, change: dict, param: str, words: str
) -> None:
    _assert_rejected(served, path, {**_valid(served, path), **change, "stream": True}, param, words)


def _assert_rejected(served: Served, path: str, body: dict, param: str, words: str) -> None:
    response = _post(served, path, json.dumps(body).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert words in error["message"] and param.split(".")[0] in error["message"]
    _assert_still_serving(served, path)


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "x",', b"", b"[1, 2]", b"42"])
def test_malformed_json_gets_400(served: Served, raw: bytes) -> None:
    response = _post(served, "/v1/completions", raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]
    _assert_still_serving(served, "/v1/completions")


def test_missing_field_is_named(served: Served) -> None:
    response = _post(served, "/v1/chat/completions", json.dumps({"model": served.model}).encode())
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "messages is required",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "invalid_value",
    }


def test_openai_client_raises_bad_request_and_the_next_call_works(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=served.model, prompt="Hi", max_tokens=-3)
    assert "max_tokens" in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="model"):
        client.chat.completions.create(model="nope", messages=CHAT_MESSAGES)
    assert client.completions.create(model=served.model, prompt="Hi", max_tokens=2).choices


def test_unknown_route_is_404_with_an_error_body(served: Served) -> None:
    response = httpx.get(f"{served.url}/v1/engines")
    assert response.status_code == 404
    assert "/v1/engines" in response.json()["error"]["message"]
