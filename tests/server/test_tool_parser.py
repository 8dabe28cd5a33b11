"""The Hermes-style tool-call parser ("auto" tool choice) on texts: calls, content around them,
malformed and partial blocks; streamed in any pieces, it gives what the whole text gives."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.server.tool_parser import HermesToolParser, hermes_template

NAMES = ["get_weather", "get_time"]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
PARIS = ("get_weather", '{"city": "Paris"}')
UTC = ("get_time", '{"zone": "utc"}')

CASES = [
    # (text, ended by itself, content, calls)
    (WEATHER, True, None, [PARIS]),
    ("Let me look.\n" + WEATHER, True, "Let me look.\n", [PARIS]),
    (WEATHER + "\n" + TIME + "\n", True, None, [PARIS, UTC]),
    ("\n\n" + WEATHER, True, None, [PARIS]),
    ("It is sunny.", True, "It is sunny.", []),
    ("  ", True, "  ", []),
    ("a < b and <tool_ca", True, "a < b and <tool_ca", []),
    # malformed JSON, an unknown function, arguments that are not an object: content
    ("<tool_call>{nope}</tool_call>", True, "<tool_call>{nope}</tool_call>", []),
    (
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        True,
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>' + TIME,
        True,
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        [UTC],
    ),
    # an open last block: a call when whole and the output ended by itself
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}', True, None, [UTC]),
    (
        '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}',
        False,
        '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}',
        [],
    ),
    (WEATHER + '<tool_call>{"name": "get_ti', False, '<tool_call>{"name": "get_ti', [PARIS]),
    # no arguments, or OpenAI's other spelling
    ('<tool_call>{"name": "get_time"}</tool_call>', True, None, [("get_time", "{}")]),
    (
        '<tool_call>{"name": "get_time", "parameters": {"zone": "utc"}}</tool_call>',
        True,
        None,
        [UTC],
    ),
]


@pytest.mark.parametrize(("text", "complete", "content", "calls"), CASES)
def test_whole_outputs_read_into_content_and_calls(
    text: str, complete: bool, content: str | None, calls: list
) -> None:
    assert HermesToolParser(NAMES).read(text, complete) == (content, calls)


def streamed(text: str, cuts: list[int], complete: bool) -> tuple[str | None, list]:
    """Streams `text` in the pieces `cuts` make; the content and calls the deltas add up to
    (checking each call's delta has the shape of OpenAI's first delta)."""
    stream = HermesToolParser(NAMES).stream()
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [stream.add(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces.append(stream.finish(complete))
    content = "".join(piece for piece, _ in pieces)
    calls = []
    for _, deltas in pieces:
        for delta in deltas:
            assert delta["index"] == len(calls) and delta["id"].startswith("call_")
            assert delta["type"] == "function"
            calls.append((delta["function"]["name"], delta["function"]["arguments"]))
    return (None if calls and not content else content), calls


@pytest.mark.parametrize(("text", "complete", "content", "calls"), CASES)
def test_every_split_streams_what_the_whole_text_reads(
    text: str, complete: bool, content: str | None, calls: list
) -> None:
    for cut in range(len(text) + 1):
        assert streamed(text, [cut], complete) == (content, calls), cut
    assert streamed(text, list(range(len(text))), complete) == (content, calls)


FRAGMENTS = st.sampled_from(
    [WEATHER, TIME, "<tool_call>", "</tool_call>", "{", "}", "<", "tool", " ", "\n", "ok", '"']
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(FRAGMENTS, max_size=8).map("".join),
    st.lists(st.integers(0, 200), max_size=6),
    st.booleans(),
)
def test_streams_of_any_text_add_up_to_the_whole_read(
    text: str, cuts: list[int], complete: bool
) -> None:
    whole = HermesToolParser(NAMES).read(text, complete)
    assert streamed(text, [c for c in cuts if c <= len(text)], complete) == whole
    content, calls = whole
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)
    if not calls:
        assert content == text  # nothing is lost: without calls the text is the content


@pytest.mark.parametrize(
    ("template", "specials", "reads"),
    [
        ("{{ tools }} <tool_call>{...}</tool_call>", [], True),
        ("{{ tools }} <tool_call>{...}</tool_call>", ["<tool_call>", "</tool_call>"], False),
        ("{{ tools }} [TOOL_CALLS]", [], False),  # another format
        ("<tool_call>", [], False),  # the tools are not rendered
        (None, [], False),
    ],
)
def test_auto_is_read_where_the_template_asks_for_tags_that_reach_the_text(
    template: str | None, specials: list[str], reads: bool
) -> None:
    tokenizer = SimpleNamespace(
        hf=SimpleNamespace(chat_template=template, all_special_tokens=specials)
    )
    assert hermes_template(tokenizer) is reads


def test_without_parallel_calls_only_the_first_block_is_a_call() -> None:
    text = WEATHER + "\n" + TIME
    one = HermesToolParser(NAMES, max_calls=1)
    assert one.read(text, True) == ("\n" + TIME, [PARIS])
    stream = one.stream()
    pieces = [stream.add(text[:50]), stream.add(text[50:]), stream.finish(True)]
    assert "".join(content for content, _ in pieces) == "\n" + TIME
    assert [d["function"]["name"] for _, deltas in pieces for d in deltas] == ["get_weather"]
