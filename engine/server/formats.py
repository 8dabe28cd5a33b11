"""Structured output in requests: OpenAI's `response_format` (json_object, json_schema) and
vLLM's `structured_outputs` (json, regex, grammar, choice), as the engine's
`StructuredOutputs`. Tools (chat) are in tools.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.state import StructuredOutputs

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: the schema is enforced token by token whether `strict`
    is true or not; with `strict` true, a keyword the grammar engine cannot enforce is refused
    (400), otherwise it is ignored."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format.json_schema is given exactly when type is 'json_schema'"
            )
        return self

    def structured(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.json_schema is None:
            return StructuredOutputs(json_object=True)
        schema = self.json_schema
        return StructuredOutputs(json=with_leniency(schema.json_schema, schema.strict))


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    def structured(self) -> StructuredOutputs:
        fields: dict[str, Any] = dict(
            json=self.json_schema,
            regex=self.regex,
            grammar=self.grammar,
            choice=self.choice,
            json_object=bool(self.json_object),
        )
        return StructuredOutputs(**{k: v for k, v in fields.items() if v not in (None, False)})


def with_leniency(schema: dict[str, Any] | bool, strict: bool | None) -> dict[str, Any] | bool:
    """`schema`, told to ignore keywords the grammar engine does not implement unless
    `strict` (llguidance's `x-guidance` options; a schema's own take precedence)."""
    if strict or not isinstance(schema, dict):
        return schema
    options = {"lenient": True, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}
