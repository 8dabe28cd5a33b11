"""Any body the OpenAI routes get is answered 200 or 400 with an error naming a field, and
loses nothing: no request left anywhere, every KV slot back, the engine healthy. The bodies
are valid requests with a few sampling, rendering and output fields set to values of any
JSON type, in range or not (hypothesis)."""

from __future__ import annotations

import json
import math
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverkit import SETTLE_POLLS, Served

FIELDS = [
    "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
    "stream_options", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "return_tokens_as_token_ids",
    "truncate_prompt_tokens", "user", "response_format", "structured_outputs",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "logprobs", "echo", "top_logprobs",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools",
    "tool_choice", "suffix", "best_of",
]  # fmt: skip
TOKEN = st.integers(-2, 50_000)
VALUES = st.one_of(
    st.integers(-3, 5),
    st.sampled_from([2**31, 2**63, -(2**63), 10**30]),
    st.floats(-3, 3),
    st.sampled_from([math.nan, math.inf, -0.0, 1e308]),
    st.sampled_from(["", "a", "\x00", "stop", "ééé", "{", "<|im_end|>"]),
    st.none(),
    st.booleans(),
    st.lists(TOKEN, max_size=3),
    st.lists(st.sampled_from(["a", "", "xy", "<|im_end|>"]), max_size=2),
    st.dictionaries(TOKEN.map(str), st.floats(-200, 200), max_size=2),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["json_object", "json_schema", "text", "regex", "bogus"]),
            "json_schema": st.sampled_from([None, {}, {"name": "x", "schema": {}}, {"schema": 3}]),
        }
    ),
    st.fixed_dictionaries(
        {
            "json": st.sampled_from([{"type": "integer"}, {}, "x", 3]),
            "regex": st.sampled_from([None, "a+", "("]),
        }
    ),
    st.fixed_dictionaries({"include_usage": st.sampled_from([True, False, 1, "x"])}),
    st.lists(st.lists(TOKEN, min_size=1, max_size=2), max_size=2),
)
PROMPTS = st.sampled_from(["Hello", [1, 2, 3], ["a", "b"], [[5, 6], [7]], "", []])
MESSAGES = st.sampled_from(
    [
        [{"role": "user", "content": "Hi"}],
        [{"role": "assistant", "content": "x"}],
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}]},
            {"role": "tool", "content": "r", "tool_call_id": "1"},
        ],
    ]
)


@st.composite
def bodies(draw) -> tuple[str, dict]:
    """(path, body): a small valid request, then one to four fields set to any value."""
    chat = draw(st.booleans())
    body: dict = {"max_tokens": 3}
    if chat:
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(PROMPTS)
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        body[field] = draw(VALUES)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _settle(served: Served) -> None:
    """Waits (bounded) until no request is anywhere and every KV slot is back."""
    engine, book = served.engine, served.engine.book
    for _ in range(SETTLE_POLLS):
        if not engine.has_work and book.num_available == book.slots.capacity:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {engine.metrics()}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=bodies())
def test_any_body_gets_200_or_a_400_naming_a_field_and_loses_nothing(
    served: Served, request: tuple[str, dict]
) -> None:
    path, body = request
    content = json.dumps({"model": served.model, **body}).encode()
    response = httpx.post(
        served.url + path,
        content=content,
        timeout=120,
        headers={"content-type": "application/json"},
    )
    assert response.status_code in (200, 400), (response.status_code, response.text)
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"], error
    _settle(served)
    assert served.engine.healthy
