"""OpenAI request bodies (validated with pydantic); the bodies sent back are in shapes.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.model.tokenizer import ChatRendering
from engine.server.formats import ResponseFormat, StructuredOutputsBody
from engine.server.tools import Tool, ToolChoice
from engine.state.params import MAX_LOGPROBS, MAX_N

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 64  # prompts in one /v1/completions request


class _Strict(BaseModel):
    """A body whose unknown fields are refused (400 naming the field), as OpenAI does: a
    field we would not honour is never taken and ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """OpenAI's `include_usage` (a last chunk with the usage), and vLLM's
    `continuous_usage_stats` (with it, every chunk carries its choice's usage so far)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _with_usage(cls, continuous: bool, info: Any) -> bool:
        if continuous and not info.data.get("include_usage"):
            raise ValueError("stream_options.continuous_usage_stats needs include_usage=true")
        return continuous


class _SamplingFields(_Strict):
    """Fields of /v1/completions and /v1/chat/completions: OpenAI's, and vLLM's top_k,
    min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
    include_stop_str_in_output, skip_special_tokens, return_tokens_as_token_ids,
    truncate_prompt_tokens, prompt_logprobs, allowed_token_ids, bad_words and
    structured_outputs (response_format and structured_outputs: formats.py)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None  # the end user's id: logged with --log-requests
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, top: int | None, info: Any) -> int | None:
        if top is not None and info.data.get("stream"):
            raise ValueError(
                "prompt_logprobs is not available with stream=true (as vLLM); ask without "
                "streaming (with /v1/completions, echo and logprobs stream the prompt's)"
            )
        return top

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, top_k: int) -> int:
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k={top_k} is not allowed; use -1 (disabled) or an integer >= 1")
        return top_k

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or not all(strings):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """One prompt or a batch of them, as a list of prompts."""
        batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        batch = prompt if batched else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"prompt is a batch of {len(batch)}; at most {MAX_PROMPTS} at once")
        for one in batch:
            if len(one) == 0:
                raise ValueError("prompt is empty; send at least one character or token")
            if isinstance(one, list) and any(token_id < 0 for token_id in one):
                raise ValueError("prompt token ids must be >= 0")
        return batch

    @field_validator("echo")
    @classmethod
    def _echo_whole_prompts(cls, echo: bool, info: Any) -> bool:
        if echo and info.data.get("truncate_prompt_tokens") is not None:
            raise ValueError(
                "echo with truncate_prompt_tokens is not supported (the echo would not be the "
                "prompt the model saw)"
            )
        return echo

    @property
    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the alternatives asked for."""
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """Whether the choices' logprobs start with the echoed prompt's."""
        return self.echo and self.logprobs is not None

    @property
    def prompt_logprob_count(self) -> int | None:
        """SamplingParams.prompt_logprobs: prompt_logprobs, or with echo and logprobs at
        least as many as logprobs (the echo's)."""
        counts = [self.prompt_logprobs, self.logprobs if self.echo else None]
        given = [count for count in counts if count is not None]
        return max(given) if given else None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(
                f"arguments must be a JSON object as text, as the call returned it; "
                f"got {arguments[:40]!r}"
            )
        return arguments


class MessageToolCall(_Strict):
    """A call an assistant message made (from an earlier response)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    """A chat message: OpenAI's roles; an assistant's message may carry the `tool_calls` it
    made (its content may then be null), a "tool" message answers one by `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[MessageToolCall] | None = Field(default=None, validate_default=True)
    tool_call_id: str | None = Field(default=None, validate_default=True)
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_assistant(cls, calls: list | None, info: Any) -> list | None:
        role = info.data.get("role")
        if calls is not None and role not in (None, "assistant"):
            raise ValueError(
                f"tool_calls is allowed on an assistant message only, not on a {role!r} one"
            )
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _id_of_tool(cls, call_id: str | None, info: Any) -> str | None:
        role = info.data.get("role")
        if (call_id is None) == (role == "tool"):
            raise ValueError(
                "tool_call_id is required on a tool message (the id of the call it answers)"
                if role == "tool"
                else f"tool_call_id is allowed on a tool message only, not on a {role!r} one"
            )
        return call_id

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: Any) -> Any:
        if content is None and not info.data.get("tool_calls"):
            raise ValueError(
                "content is required (it may be null only on an assistant message with tool_calls)"
            )
        return content

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: text content, a call's arguments as an
        object."""
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "".join(part.text for part in self.content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text,
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _ChatRenderingFields(_Strict):
    """vLLM's fields of how chat messages are rendered (`ChatRendering`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def rendering(self) -> ChatRendering:
        return ChatRendering(
            self.add_generation_prompt,
            self.continue_final_message,
            self.chat_template_kwargs or {},
        )


class TokenizeRequest(_ChatRenderingFields):
    """POST /tokenize (vLLM's): a prompt as /v1/completions takes it, or chat messages as
    /v1/chat/completions renders them (its template, with the same rendering fields): one of
    the two."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and self.rendering != ChatRendering():
            raise ValueError(
                "add_generation_prompt, continue_final_message and chat_template_kwargs "
                "render chat messages; give messages, not a prompt"
            )
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): the text of token ids."""

    model: str | None = None
    tokens: list[int]


class ChatCompletionRequest(_SamplingFields, _ChatRenderingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # with tools: "auto" unless given
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: Any) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top

    @property
    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the alternatives asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_logprob_count(self) -> int | None:
        return self.prompt_logprobs

    @property
    def echo_logprobs(self) -> bool:
        return False  # a chat response has no echo

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
