"""Structured output: what a request's output must match (a JSON schema, a regular expression,
a Lark grammar or a choice of strings), one frozen value checked cheaply here. The engine
compiles it when the request is submitted (`engine/shell/grammar.py`)."""

from __future__ import annotations

import json
from typing import Any

import attrs

KINDS = ("json", "regex", "grammar", "choice", "json_object")


def _json_text(value: object) -> object:
    """A JSON schema as compact JSON text, from a dict, a bool or JSON text (its keys in
    their order: properties are generated in the schema's order); anything else (or text
    that is not JSON) is kept for the validator to name."""
    if isinstance(value, (dict, bool)):
        try:
            return json.dumps(value, separators=(",", ":"))
        except (TypeError, ValueError):
            return value
    if isinstance(value, str):
        try:
            return json.dumps(json.loads(value), separators=(",", ":"))
        except ValueError:
            return value
    return value


def _choices(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _fail(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{field}={value!r} is not allowed; {field} must be {allowed}")


@attrs.frozen
class StructuredOutputs:
    """Exactly one of: `json`, a JSON schema (a dict, or its JSON text); `regex`, a regular
    expression the whole output matches; `grammar`, a Lark grammar (its `start` rule);
    `choice`, strings of which the output is one; `json_object`, any JSON object. Field
    names are vLLM's."""

    json: str | None = attrs.field(default=None, converter=_json_text)
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    json_object: bool = False

    def __attrs_post_init__(self) -> None:
        where = "structured_outputs"
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{where}={self.describe()} is not allowed; {where} must set exactly one of "
                f"{', '.join(KINDS)} (got {len(given)})"
            )
        if self.json is not None:
            schema = _parsed(self.json)
            if not isinstance(schema, (dict, bool)):
                raise _fail(f"{where}.json", self.json, "a JSON schema: an object (or a bool)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise _fail(f"{where}.{name}", value, "a non-empty string")
        choice = self.choice
        if choice is not None and not (
            isinstance(choice, tuple) and choice and all(isinstance(c, str) and c for c in choice)
        ):
            raise _fail(f"{where}.choice", choice, "a non-empty list of non-empty strings")
        if not isinstance(self.json_object, bool):
            raise _fail(f"{where}.json_object", self.json_object, "a bool")

    @property
    def kind(self) -> str:
        """Which of the fields is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> Any:
        """The JSON schema (`json`, or any object for `json_object`); None for the others."""
        if self.json_object:
            return {"type": "object"}
        return None if self.json is None else json.loads(self.json)

    def describe(self) -> str:
        """The fields that are set, for messages."""
        return repr({k: getattr(self, k) for k in KINDS if getattr(self, k) not in (None, False)})


def _parsed(text: str) -> object:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def as_structured(value: object) -> object:
    """`SamplingParams.structured_outputs` from a StructuredOutputs, a dict of its fields or
    None; a dict with unknown keys raises ValueError naming them."""
    if not isinstance(value, dict):
        return value
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise ValueError(
            f"structured_outputs={value!r} is not allowed; structured_outputs takes "
            f"{', '.join(KINDS)} (not {', '.join(map(str, unknown))})"
        )
    return StructuredOutputs(**value)
