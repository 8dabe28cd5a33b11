"""The prefix cache seen from the server: a prompt sent again reports cached prompt tokens, in
its usage and in /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverkit import Served

# ~100 tokens of system message: a long prefix for the second request to find cached
SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening "
    "hours, borrowing rules, late fees, room bookings and the catalogue. Keep every answer "
    "short, polite and factual; when you do not know something, say so and suggest asking "
    "the front desk. Never invent book titles, authors or dates. Use plain language and "
    "avoid lists unless the reader asks for one."
)
QUESTION = "When does the library open on Saturdays?"
HIT_TOKENS = "engine_prefix_cache_hit_tokens"  # the counter's family name, without _total


def _hit_tokens(served: Served) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == HIT_TOKENS)
    return family.samples[0].value


def _body(endpoint: str, model: str) -> dict:
    body = {"model": model, "max_tokens": 4, "temperature": 0}
    if endpoint == "completions":
        body["prompt"] = f"{SYSTEM}\n\nQuestion: {QUESTION}\nAnswer:"
    else:
        body["messages"] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
        ]
    return body


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_repeated_prompt_reports_cached_tokens(served: Served, endpoint: str) -> None:
    url = f"{served.url}/v1/{endpoint}"
    body = _body(endpoint, served.model)
    hit_tokens_before = _hit_tokens(served)
    usages = []
    for _ in range(2):  # sequential: the first one's prefix is cached when it finishes
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    second = usages[1]
    assert second["prompt_tokens"] == usages[0]["prompt_tokens"] >= 80
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"], usages
    assert _hit_tokens(served) - hit_tokens_before >= cached
