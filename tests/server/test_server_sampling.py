"""The sampling fields through the real `openai` client: logprobs (streamed too), n, prompt
lists, echo, stop_token_ids, min_tokens, penalties and logit_bias, each equal to what
Engine.generate gives with the same parameters; the server stays healthy and its pool whole."""

from __future__ import annotations

import httpx
import pytest
from serverkit import CHAT_MESSAGES, COMPLETION_PROMPT, MAX_CONTEXT, Served

from engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def reference() -> Engine:
    """An engine of the served model for the expected results (the served one's loop belongs
    to the server: nothing else may step it)."""
    return Engine(None, device="cpu", max_running_requests=32, max_context=MAX_CONTEXT)


def _settled(served: Served) -> None:
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200


def test_completion_logprobs_streamed_and_not(served: Served, reference: Engine) -> None:
    client = served.client()
    kwargs = dict(model=served.model, prompt=COMPLETION_PROMPT, max_tokens=6, temperature=0.0)
    full = client.completions.create(logprobs=2, **kwargs)
    expected = reference.generate(COMPLETION_PROMPT, SamplingParams(max_tokens=6, logprobs=2))[0]
    logprobs = full.choices[0].logprobs
    assert len(logprobs.tokens) == len(expected.token_ids) == len(logprobs.token_logprobs)
    spelled = [reference.tokenizer.decode([t]) for t in expected.token_ids]
    assert logprobs.tokens == spelled
    for got, want in zip(logprobs.token_logprobs, expected.logprobs, strict=True):
        assert abs(got - want.logprob) < 1e-4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    chunks = list(client.completions.create(logprobs=2, stream=True, **kwargs))
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert len(streamed) == len(expected.token_ids)
    assert max(abs(a - b) for a, b in zip(streamed, logprobs.token_logprobs, strict=True)) < 1e-4
    plain = client.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    _settled(served)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_logprobs_name_their_tokens_by_id_when_asked(
    served: Served, reference: Engine, chat: bool
) -> None:
    """vLLM's return_tokens_as_token_ids: each logprob's token (and its alternatives') is
    "token_id:N", N the id generate gives; text, offsets and bytes stay the tokens' text."""
    client, greedy = served.client(), {"max_tokens": 4, "temperature": 0.0}
    asked = {"return_tokens_as_token_ids": True}
    want = reference.generate(
        [CHAT_MESSAGES] if chat else COMPLETION_PROMPT, SamplingParams(max_tokens=4, logprobs=2)
    )[0]
    ids = [f"token_id:{t}" for t in want.token_ids]
    tops = [[f"token_id:{t}" for t, _ in entry.top] for entry in want.logprobs]
    if chat:
        response = client.chat.completions.create(
            model=served.model,
            messages=CHAT_MESSAGES,
            logprobs=True,
            top_logprobs=2,
            extra_body=asked,
            **greedy,
        )
        content = response.choices[0].logprobs.content
        assert [e.token for e in content] == ids
        assert [[t.token for t in e.top_logprobs] for e in content] == tops
        texts = [reference.tokenizer.decode([t]) for t in want.token_ids]
        assert [e.bytes for e in content] == [list(text.encode()) for text in texts]
    else:
        plain = client.completions.create(
            model=served.model, prompt=COMPLETION_PROMPT, logprobs=2, **greedy
        )
        named = client.completions.create(
            model=served.model, prompt=COMPLETION_PROMPT, logprobs=2, extra_body=asked, **greedy
        )
        assert named.choices[0].logprobs.tokens == ids
        assert [list(top) for top in named.choices[0].logprobs.top_logprobs] == tops
        assert named.choices[0].logprobs.text_offset == plain.choices[0].logprobs.text_offset
        assert named.choices[0].text == plain.choices[0].text


def test_chat_logprobs_with_top_alternatives(served: Served, reference: Engine) -> None:
    client = served.client()
    response = client.chat.completions.create(
        model=served.model,
        messages=CHAT_MESSAGES,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    expected = reference.generate([CHAT_MESSAGES], SamplingParams(max_tokens=5, logprobs=3))[0]
    assert len(content) == len(expected.token_ids)
    for entry, want in zip(content, expected.logprobs, strict=True):
        assert entry.token == reference.tokenizer.decode([want.token_id])
        assert abs(entry.logprob - want.logprob) < 1e-4
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == [
            reference.tokenizer.decode([t]) for t, _ in want.top
        ]
    stream = client.chat.completions.create(
        model=served.model,
        messages=CHAT_MESSAGES,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        stream=True,
    )
    tokens = [
        e.token
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in content]


def test_n_seeded_samples_are_reproducible_streamed_and_not(
    served: Served, reference: Engine
) -> None:
    client = served.client()
    kwargs = dict(
        model=served.model, messages=CHAT_MESSAGES, max_tokens=8, temperature=1.0, seed=5, n=3
    )
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    expected = reference.generate(
        [CHAT_MESSAGES], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3)
    )
    assert texts == [c.text for c in expected]
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    assert first.usage.prompt_tokens == len(expected[0].prompt_token_ids)  # counted once
    streamed = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    _settled(served)


def test_a_list_of_prompts_gives_their_choices_in_order(served: Served, reference: Engine) -> None:
    for prompts in (["The sea is", "Three colours:", "Hello"], [[504, 2377, 314], [504]]):
        response = served.client().completions.create(
            model=served.model, prompt=prompts, max_tokens=5, temperature=0.0, n=2
        )
        expected = reference.generate(prompts, SamplingParams(max_tokens=5))
        assert [c.index for c in response.choices] == list(range(2 * len(prompts)))
        assert [c.text for c in response.choices] == [r.text for r in expected for _ in range(2)]
        assert response.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)


def test_echo_returns_the_prompt_first(served: Served, reference: Engine) -> None:
    client = served.client()
    kwargs = dict(
        model=served.model, prompt=COMPLETION_PROMPT, max_tokens=4, temperature=0.0, echo=True
    )
    text = client.completions.create(**kwargs).choices[0].text
    expected = reference.generate(COMPLETION_PROMPT, SamplingParams(max_tokens=4))[0]
    assert text == COMPLETION_PROMPT + expected.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == text


def test_echo_with_logprobs_scores_the_prompt_streamed_and_not(
    served: Served, reference: Engine
) -> None:
    """As vLLM: echo with logprobs gives the prompt's tokens first, the first with null
    logprob and alternatives, the others with the model's, then the output's; streamed, the
    echo's chunk carries the prompt's."""
    client = served.client()
    kwargs = dict(
        model=served.model,
        prompt=COMPLETION_PROMPT,
        max_tokens=4,
        temperature=0.0,
        echo=True,
        logprobs=2,
    )
    want = reference.generate(
        COMPLETION_PROMPT, SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=2)
    )[0]
    ids = list(want.prompt_token_ids) + list(want.token_ids)
    got = client.completions.create(**kwargs).choices[0].logprobs
    spell = reference.tokenizer.decode
    assert got.tokens == [spell([t]) for t in ids]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    expected = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    assert max(abs(a - b) for a, b in zip(got.token_logprobs[1:], expected, strict=True)) < 1e-4
    assert all(len(top) == 2 for top in got.top_logprobs[1:])
    assert got.text_offset[0] == 0
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == got.tokens
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == got.text_offset
    _settled(served)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_prompt_logprobs_as_vllm_gives_them(served: Served, reference: Engine, chat: bool) -> None:
    """vLLM's prompt_logprobs: null for the first prompt token, then a map of token id to
    logprob, rank and text for the most likely there and the prompt's token; on each
    completions choice, at the top of a chat response."""
    prompt = [CHAT_MESSAGES] if chat else COMPLETION_PROMPT
    want = reference.generate(prompt, SamplingParams(max_tokens=3, prompt_logprobs=1))[0]
    body = {"model": served.model, "max_tokens": 3, "temperature": 0.0, "prompt_logprobs": 1}
    if chat:
        body["messages"] = CHAT_MESSAGES
    else:  # two prompts, two samples each: every choice has its prompt's
        body.update(prompt=[COMPLETION_PROMPT, COMPLETION_PROMPT], n=2)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(served.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    bodies = (
        [answer["prompt_logprobs"]] if chat else [c["prompt_logprobs"] for c in answer["choices"]]
    )
    assert len(bodies) == (1 if chat else 4)
    for scores in bodies:
        assert len(scores) == len(want.prompt_token_ids) and scores[0] is None
        for entry, expected in zip(scores[1:], want.prompt_logprobs[1:], strict=True):
            mine = entry[str(expected.token_id)]
            assert abs(mine["logprob"] - expected.logprob) < 1e-4
            assert mine["rank"] == expected.rank
            assert mine["decoded_token"] == reference.tokenizer.decode([expected.token_id])
            best, value = expected.top[0]
            assert entry[str(best)]["rank"] == 1 and abs(entry[str(best)]["logprob"] - value) < 1e-4
            assert len(entry) == (1 if best == expected.token_id else 2)
    _settled(served)


def test_stop_token_ids_min_tokens_penalties_and_bias_equal_generate(
    served: Served, reference: Engine
) -> None:
    client = served.client()
    greedy = reference.generate(COMPLETION_PROMPT, SamplingParams(max_tokens=8))[0]
    cases = [
        (dict(stop_token_ids=[greedy.token_ids[2]]), dict(stop_token_ids=(greedy.token_ids[2],))),
        (dict(min_tokens=8, ignore_eos=False), dict(min_tokens=8)),
        (
            dict(stop_token_ids=[greedy.token_ids[2]], include_stop_str_in_output=True),
            dict(stop_token_ids=(greedy.token_ids[2],), include_stop_str_in_output=True),
        ),
        (dict(skip_special_tokens=False), dict(skip_special_tokens=False)),
        (dict(frequency_penalty=1.5), dict(frequency_penalty=1.5)),
        (dict(presence_penalty=2.0), dict(presence_penalty=2.0)),
        (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (dict(min_p=0.2, temperature=1.0, seed=3), dict(min_p=0.2, temperature=1.0, seed=3)),
        (
            dict(allowed_token_ids=list(greedy.token_ids[3:6])),
            dict(allowed_token_ids=greedy.token_ids[3:6]),
        ),
        (
            dict(bad_words=reference.tokenizer.decode(greedy.token_ids[1:3]).split()),
            dict(bad_words=reference.tokenizer.decode(greedy.token_ids[1:3]).split()),
        ),
    ]
    for body, params in cases:
        extra = {
            k: v
            for k, v in body.items()
            if k
            in (
                "stop_token_ids",
                "min_tokens",
                "repetition_penalty",
                "min_p",
                "ignore_eos",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "allowed_token_ids",
                "bad_words",
            )
        }
        openai_fields = {k: v for k, v in body.items() if k not in extra}
        response = client.completions.create(
            model=served.model,
            prompt=COMPLETION_PROMPT,
            max_tokens=8,
            **({"temperature": 0.0} | openai_fields),
            extra_body=extra,
        )
        want = reference.generate(COMPLETION_PROMPT, SamplingParams(max_tokens=8, **params))[0]
        assert response.choices[0].text == want.text, body
        if "bad_words" in body:  # they changed the output
            assert want.token_ids[:8] != greedy.token_ids[:8]
        assert response.choices[0].finish_reason == want.finish_reason, body
    stopped = client.completions.create(
        model=served.model,
        prompt=COMPLETION_PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_body={"stop_token_ids": [greedy.token_ids[2]]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    token = reference.tokenizer.encode(" sea")[0]
    biased = client.completions.create(
        model=served.model,
        prompt=COMPLETION_PROMPT,
        max_tokens=4,
        temperature=0.0,
        logit_bias={str(token): 100},
    )
    assert biased.choices[0].text == " sea" * 4
    _settled(served)
    served.engine.check()
