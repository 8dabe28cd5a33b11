"""Completions and chat, streamed and not, against Engine.generate; usage, models, health,
metrics, the tokenizer's endpoints."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import pytest
from serverkit import CHAT_MESSAGES, COMPLETION_PROMPT, MAX_TOKENS, SAMPLED, Served

SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": SAMPLED}


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_completion_streamed_equals_non_streamed_equals_generate(
    served: Served, sampling: str
) -> None:
    client = served.client()
    kwargs = dict(
        model=served.model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS, **SAMPLINGS[sampling]
    )
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    reference = served.references[f"completion/{sampling}"]

    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.model == served.model and full.created > 0
    assert full.choices[0].index == 0
    assert full.choices[0].text == reference.text
    assert full.choices[0].finish_reason == reference.finish_reason
    assert full.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert full.usage.completion_tokens == len(reference.token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert "".join(c.choices[0].text for c in chunks) == reference.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == reference.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_chat_streamed_equals_non_streamed_equals_generate(served: Served, sampling: str) -> None:
    client = served.client()
    kwargs = dict(
        model=served.model, messages=CHAT_MESSAGES, max_tokens=MAX_TOKENS, **SAMPLINGS[sampling]
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    reference = served.references[f"chat/{sampling}"]

    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == reference.text
    assert full.choices[0].finish_reason == reference.finish_reason
    assert full.usage.completion_tokens == len(reference.token_ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_include_usage_sends_a_final_usage_chunk(served: Served) -> None:
    chunks = list(
        served.client().chat.completions.create(
            model=served.model,
            messages=CHAT_MESSAGES,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"top_k": 5, "ignore_eos": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(
    served: Served, n: int
) -> None:
    """vLLM's continuous_usage_stats: each chunk's usage is its choice's prompt and the
    tokens sent so far; the last chunk is the whole response's, as with include_usage."""
    body = {
        "model": served.model,
        "messages": CHAT_MESSAGES,
        "max_tokens": 4,
        "n": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line) for line in lines]
    prompt = len(served.references["chat/greedy"].prompt_token_ids)
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 * n
    seen = {index: [] for index in range(n)}
    for chunk in choice_chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        seen[chunk["choices"][0]["index"]].append(usage["completion_tokens"])
    for counts in seen.values():
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 4


def _assert_cached_tokens_reported(usage: dict) -> None:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert type(cached) is int and 0 <= cached <= usage["prompt_tokens"], usage


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_usage_reports_cached_prompt_tokens_streamed_and_not(served: Served, endpoint: str) -> None:
    body = {"model": served.model, "max_tokens": 3, "temperature": 0}
    if endpoint == "completions":
        body["prompt"] = COMPLETION_PROMPT
    else:
        body["messages"] = CHAT_MESSAGES
    url = f"{served.url}/v1/{endpoint}"
    full = httpx.post(url, json=body, timeout=120)
    assert full.status_code == 200, full.text
    _assert_cached_tokens_reported(full.json()["usage"])

    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=stream, timeout=120) as response:
        raw = response.read().decode()
    events = [json.loads(event[len("data: ") :]) for event in raw.split("\n\n")[:-2]]
    assert events[-1]["choices"] == []
    _assert_cached_tokens_reported(events[-1]["usage"])


def test_openai_client_parses_cached_tokens(served: Served) -> None:
    full = served.client().chat.completions.create(
        model=served.model, messages=CHAT_MESSAGES, max_tokens=2
    )
    assert isinstance(full.usage.prompt_tokens_details.cached_tokens, int)


def test_sse_wire_format_ends_with_done(served: Served) -> None:
    body = {"model": served.model, "prompt": COMPLETION_PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-2])


def test_stop_string_ends_the_text_with_finish_reason_stop(served: Served) -> None:
    reference = served.references["completion/greedy"].text
    stop = reference.strip().split()[1]
    full = served.client().completions.create(
        model=served.model,
        prompt=COMPLETION_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=[stop],
    )
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].text == reference[: reference.index(stop)]


def test_token_id_prompt_matches_text_prompt(served: Served) -> None:
    reference = served.references["completion/greedy"]
    full = served.client().completions.create(
        model=served.model,
        prompt=list(reference.prompt_token_ids),
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert full.choices[0].text == reference.text


def test_models_and_health(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_version_is_the_packages(served: Served) -> None:
    answer = httpx.get(f"{served.url}/version")
    assert answer.status_code == 200
    assert answer.json() == {"version": importlib.metadata.version("engine")}


def test_a_model_is_retrieved_by_its_id(served: Served) -> None:
    assert served.client().models.retrieve(served.model).id == served.model
    missing = httpx.get(f"{served.url}/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_gives_the_ids_the_server_runs_and_detokenize_their_text(served: Served) -> None:
    """/tokenize's ids are a completion's prompt ids (text) and a chat's (its messages through
    the template): the usage counts them alike; /detokenize gives the text back."""
    completion, chat = served.references["completion/greedy"], served.references["chat/greedy"]
    text = httpx.post(f"{served.url}/tokenize", json={"prompt": COMPLETION_PROMPT}).json()
    assert text["tokens"] == list(completion.prompt_token_ids) and text["count"] == len(
        text["tokens"]
    )
    assert text["max_model_len"] == served.client().models.retrieve(served.model).max_model_len
    messages = {"model": served.model, "messages": CHAT_MESSAGES}
    assert httpx.post(f"{served.url}/tokenize", json=messages).json()["tokens"] == list(
        chat.prompt_token_ids
    )
    back = httpx.post(f"{served.url}/detokenize", json={"tokens": text["tokens"]}).json()
    assert back == {"prompt": COMPLETION_PROMPT}


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/tokenize", {}, None, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "a", "messages": CHAT_MESSAGES}, None, "exactly one"),
        ("/tokenize", {"prompt": [1, 10**9]}, "prompt", "outside the vocabulary"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens", "not"),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, "model", "gpt-4"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {}, "tokens", "required"),
    ],
)
def test_tokenize_and_detokenize_refuse_naming_the_field(
    served: Served, path: str, body: dict, param: str | None, words: str
) -> None:
    answer = httpx.post(f"{served.url}{path}", json=body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and words in error["message"]


def test_a_chat_continues_the_assistants_last_message_when_asked(served: Served) -> None:
    """vLLM's continue_final_message (with add_generation_prompt false): the chat renders to
    ids that end in the assistant's unfinished message (no end of turn, no new turn), and the
    reply is what those ids give as a completion's prompt."""
    messages = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "The fruit I pick is"},
    ]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    opened = httpx.post(f"{served.url}/tokenize", json={"messages": messages, **fields}).json()
    text = httpx.post(f"{served.url}/detokenize", json={"tokens": opened["tokens"]}).json()
    assert text["prompt"].endswith("assistant\nThe fruit I pick is")
    client, greedy = served.client(), {"max_tokens": 6, "temperature": 0}
    reply = client.chat.completions.create(
        model=served.model, messages=messages, extra_body=fields, **greedy
    )
    continued = client.completions.create(model=served.model, prompt=opened["tokens"], **greedy)
    assert reply.choices[0].message.content == continued.choices[0].text
    assert reply.usage.prompt_tokens == opened["count"]


def test_a_prompt_longer_than_the_context_runs_truncated_when_asked(served: Served) -> None:
    """truncate_prompt_tokens keeps the prompt's last tokens: a prompt past the context,
    refused without it, runs as those tokens alone do."""
    reference = served.references["completion/greedy"]
    tail = list(reference.prompt_token_ids)
    long_prompt = [11] * 3000 + tail  # past the served context
    client, greedy = served.client(), {"max_tokens": MAX_TOKENS, "temperature": 0}
    cut = client.completions.create(
        model=served.model,
        prompt=long_prompt,
        extra_body={"truncate_prompt_tokens": len(tail)},
        **greedy,
    )
    assert cut.usage.prompt_tokens == len(tail)
    assert cut.choices[0].text == reference.text


def test_metrics_lists_engine_and_latency_series(served: Served) -> None:
    served.client().completions.create(model=served.model, prompt="Hi", max_tokens=2)
    text = httpx.get(f"{served.url}/metrics").text
    for name in (
        "engine_requests_running",
        "engine_requests_waiting",
        "engine_kv_slots_used",
        "engine_kv_slots_free",
        "engine_generation_tokens_total",
        "engine_spec_accepted_tokens_total",
        "engine_spec_acceptance_rate",
        "engine_spec_draft_cost",
        "engine_step_seconds_bucket",
        "engine_time_to_first_token_seconds_bucket",
        "engine_inter_token_latency_seconds_bucket",
        "engine_speculative_enabled 0.0",
        "engine_prefix_cache_slots",
        "engine_prefix_cache_locked_slots",
        "engine_prefix_cache_hit_rate",
        "engine_prefix_cache_hit_tokens_total",
        "engine_prefix_cache_queried_tokens_total",
        "engine_prefix_cache_evicted_slots_total",
        "engine_prefix_cache_evictions_total",
    ):
        assert name in text, name
