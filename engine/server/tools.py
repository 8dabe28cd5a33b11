"""Tool calls in chat: `tools` with `tool_choice` "required" or a named function, by
constrained decoding of the call's JSON from the functions' parameter schemas, read back as
OpenAI's `tool_calls` (whole, or as stream deltas)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.server.formats import NAME_PATTERN, with_leniency
from engine.state import StructuredOutputs

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# "required" generates a JSON array of these objects, compact and in this key order
CALL_START, CALL_MIDDLE = '{"name":"', '","parameters":'


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any] | bool:
        """The schema a call's arguments are generated to (no `parameters`: no arguments),
        lenient unless `strict` (`with_leniency`); not named `schema`, which is BaseModel's."""
        return with_leniency(self.parameters or NO_PARAMETERS, self.strict)


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders `tools` (where it does not, the model never
    sees them and cannot choose to call one)."""
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


class ToolCalls:
    """One request's tool choice: the grammar its output follows, and the calls read back from
    that output. A named function's output is its arguments; "required" outputs a JSON array
    of {"name", "parameters"} objects (one at most without `parallel_tool_calls`)."""

    def __init__(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> None:
        functions = {tool.function.name: tool.function for tool in tools}
        self.named: str | None = None
        if isinstance(choice, NamedToolChoice):
            self.named = choice.function.name
            if self.named not in functions:
                raise ValueError(
                    f"tool_choice names function {self.named!r}, which is not among the tools "
                    f"({', '.join(functions) or 'none given'})"
                )
            self.structured = StructuredOutputs(json=functions[self.named].arguments_schema)
            return
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": function.arguments_schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, function in functions.items()
        ]
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        self.structured = StructuredOutputs(json=calls)

    def calls(self, text: str, complete: bool) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in a finished output; None where the output
        is not a whole call (`complete` false: it ran out of tokens), except for a named
        function, whose arguments are the output as it is."""
        if self.named is not None:
            return [(self.named, text)]
        if not complete:
            return None
        try:
            json.loads(text)
        except ValueError:  # cut short by a stop string
            return None
        return partial_calls(text)  # the arguments as generated, as a stream has them

    def read(self, text: str, complete: bool) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole output's content and calls: the calls where it is whole ones, else the
        text as content."""
        found = self.calls(text, complete)
        return (None, found) if found else (text, [])

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's `tool_calls`, with a new id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolCallStream:
    """Turns a streamed output into OpenAI's tool-call deltas: a call's first delta carries
    its index, id, type and name, the next ones pieces of its arguments."""

    def __init__(self, tools: ToolCalls) -> None:
        self.tools = tools
        self.text = ""
        self.sent: list[int] = []  # arguments characters sent, per call begun

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def finish(self, complete: bool) -> tuple[str, list[dict[str, Any]]]:
        """Nothing is held back: every piece of a call went out as it came (an output
        `complete` or not)."""
        return "", []

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """No content (the output is the calls' JSON), and the calls' deltas."""
        self.text += text
        if self.tools.named is not None:
            found = [(self.tools.named, self.text)]
        else:
            found = partial_calls(self.text)
        deltas = []
        for index, (name, arguments) in enumerate(found):
            if index == len(self.sent):
                deltas.append({"index": index, **tool_call(name, arguments)})
                self.sent.append(len(arguments))
            elif len(arguments) > self.sent[index]:
                piece = arguments[self.sent[index] :]
                deltas.append({"index": index, "function": {"arguments": piece}})
                self.sent[index] = len(arguments)
        return "", deltas


def partial_calls(text: str) -> list[tuple[str, str]]:
    """The calls begun in a prefix of a "required" output (`[{"name":"f","parameters":{...}},
    ...]`, compact, as the grammar makes it): each one's name, once whole, and as much of its
    arguments as there is so far."""
    calls: list[tuple[str, str]] = []
    position = 1  # past "["
    while text.startswith(CALL_START, position):
        name_start = position + len(CALL_START)
        name_end = text.find('"', name_start)
        if name_end < 0 or not text.startswith(CALL_MIDDLE, name_end):
            break  # the name is not whole yet
        start = name_end + len(CALL_MIDDLE)
        end = json_value_end(text, start)
        calls.append((text[name_start:name_end], text[start : len(text) if end is None else end]))
        if end is None:
            break
        position = end + 2  # past the call's "}" and the "," (or "]") after it
    return calls


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array at `text[start]` ends (one past its closing bracket), or
    None if it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for position in range(start, len(text)):
        char = text[position]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return None
