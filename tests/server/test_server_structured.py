"""Structured output and tool calls through the real `openai` client: response_format
(json_object, json_schema), structured_outputs (regex, Lark grammar, choice), tools with
tool_choice "required" or a named function (whole and streamed); what cannot be served is a
400 naming the field."""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest
from serverkit import Served, serving, tiny_engine

from engine.shell import grammar

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
        "label": {"enum": ["start", "end"]},
    },
    "required": ["x", "y", "label"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "local"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
ASK = [{"role": "user", "content": "Give a point as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _settled(served: Served) -> None:
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200
    served.engine.check()


def _grammar_metrics(served: Served) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in (
            line.split(" ", 1)
            for line in httpx.get(f"{served.url}/metrics").text.splitlines()
            if line.startswith("engine_grammar_")
        )
    }


def test_json_schema_response_format_validates(served: Served) -> None:
    client = served.client()
    _settled(served)
    before = _grammar_metrics(served)  # the server is shared: this request's own count
    response = client.chat.completions.create(
        model=served.model,
        messages=ASK,
        max_tokens=32,
        temperature=0.9,
        seed=3,
        n=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "point", "schema": POINT, "strict": True},
        },
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), POINT)
    _settled(served)
    after = _grammar_metrics(served)
    masks = after["engine_grammar_masks_total"] - before["engine_grammar_masks_total"]
    assert masks >= response.usage.completion_tokens  # sampled rows: one per token drawn
    seconds = "engine_grammar_mask_seconds_total"
    assert after[seconds] - before[seconds] > 0


def test_json_object_on_completions_and_streamed_chat(served: Served) -> None:
    client = served.client()
    text = client.completions.create(
        model=served.model,
        prompt="A JSON object:",
        max_tokens=40,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert text.choices[0].text.startswith("{")
    if text.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text.choices[0].text), dict)
    chunks = client.chat.completions.create(
        model=served.model,
        messages=ASK,
        max_tokens=32,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "point", "schema": POINT},
        },
    )
    pieces, reasons = [], []
    for chunk in chunks:
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(pieces)), POINT)
    _settled(served)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}, r"[A-Z][a-z]{2,5} [0-9]{2}"),
        (
            {"grammar": 'start: "(" word ("," word)* ")"\nword: /[a-z]{1,4}/\n'},
            r"\([a-z]{1,4}(,[a-z]{1,4})*\)",
        ),
        ({"choice": ["left", "right", "straight on"]}, r"left|right|straight on"),
    ],
)
def test_structured_outputs_constrain_exactly(served: Served, constraint: dict, check: str) -> None:
    response = served.client().chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Answer in the given form."}],
        max_tokens=24,
        temperature=0.0,
        extra_body={"structured_outputs": constraint},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert re.fullmatch(check, choice.message.content), choice.message.content


def test_a_named_function_is_called_with_arguments_of_its_schema(served: Served) -> None:
    response = served.client().chat.completions.create(
        model=served.model,
        messages=WEATHER_ASK,
        max_tokens=32,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_calls_parse_whole_and_streamed_alike(served: Served) -> None:
    kwargs = dict(
        model=served.model,
        messages=WEATHER_ASK,
        max_tokens=48,
        temperature=0.0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    client = served.client()
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": ZONE}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        assert not delta.content
        for piece in delta.tool_calls or ():
            entry = streamed.setdefault(piece.index, {"name": None, "arguments": ""})
            if piece.id is not None:
                assert entry["name"] is None and piece.function.name is not None
                entry["name"] = piece.function.name
            entry["arguments"] += piece.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert list(streamed.values()) == [
        {"name": call.function.name, "arguments": call.function.arguments}
    ]
    _settled(served)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "response_format",
            "frob",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "give one of them",
        ),
        ({"tools": TOOLS}, "tool_choice", "chat template does not render them"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "'auto'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(
    served: Served, body: dict, param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().chat.completions.create(
            model=served.model, messages=ASK, max_tokens=4, extra_body=body
        )
    error = caught.value.body
    assert error["param"].startswith(param), error
    assert says in error["message"], error


def test_the_grammar_vocabulary_is_built_before_the_first_request(monkeypatch) -> None:
    built_on: list[str] = []
    build = grammar.grammar_vocabulary

    def recorded(*args):
        built_on.append(threading.current_thread().name)
        return build(*args)

    monkeypatch.setattr(grammar, "grammar_vocabulary", recorded)
    with serving(tiny_engine()) as server:
        assert len(built_on) == 1 and server.engine.grammars.ready  # the server is up
        response = httpx.post(
            f"{server.url}/v1/completions",
            json=server.body(max_tokens=3, logprobs=0, structured_outputs={"regex": "[a-c]{3}"}),
            timeout=60,
        )
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]  # bytes: no tokenizer
        assert tokens and set(tokens) <= {f"token_id:{ord(c)}" for c in "abc"}
        assert len(built_on) == 1  # the request found it built
        server.wait_idle()
