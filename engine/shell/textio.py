"""Text at the edges: prompts in (text, token ids or chat messages, with their sampling
parameters), text out (incremental detokenization and stop strings, matched where the text is
produced)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import attrs

from engine.errors import InvalidRequest
from engine.model.tokenizer import ChatRendering, IncrementalDetokenizer
from engine.shell.request import Request
from engine.state import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs


# ChatPrompt's converters, typed: with `tuple` itself, mypy's attrs plugin cannot bind its
# type variable and refuses a list of messages
def _dict_tuple(dicts: Iterable[dict]) -> tuple[dict, ...]:
    return tuple(dicts)


def _dict_tuple_or_none(dicts: Iterable[dict] | None) -> tuple[dict, ...] | None:
    return None if dicts is None else tuple(dicts)


@attrs.frozen
class ChatPrompt:
    """Chat messages with the tools the chat template renders for the model (OpenAI's
    function tools; None: no tools). Messages are OpenAI's, as the template reads them: an
    assistant's `tool_calls` (their arguments as objects), a tool's `tool_call_id`."""

    messages: tuple[dict, ...] = attrs.field(converter=_dict_tuple)
    tools: tuple[dict, ...] | None = attrs.field(default=None, converter=_dict_tuple_or_none)
    rendering: ChatRendering | None = None  # None: the generation prompt appended


PromptInput = str | list[int] | list[dict] | ChatPrompt


def prompt_to_ids(tokenizer: Any, prompt: PromptInput) -> list[int]:
    """Token ids of a prompt: a string, a list of token ids, chat messages or a ChatPrompt."""
    if _is_token_ids(prompt):
        return list(prompt)
    if tokenizer is None:
        raise InvalidRequest(
            "prompt",
            "this engine has no tokenizer (random weights); give the prompt as a list of token ids",
        )
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, ChatPrompt):
        return _chat_ids(tokenizer, list(prompt.messages), prompt.tools, prompt.rendering)
    if _is_messages(prompt):
        return _chat_ids(tokenizer, list(prompt), None, None)
    raise InvalidRequest(
        "prompt",
        f"must be a string, a list of token ids or a list of chat "
        f"messages; got {type(prompt).__name__}",
    )


def _is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    """Whether `prompt` is a list (or tuple) of token ids (ints, not bools; empty counts)."""
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def _is_messages(prompt: object) -> TypeGuard[Sequence[dict]]:
    """Whether `prompt` is a list (or tuple) of chat messages."""
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)


def _chat_ids(
    tokenizer: Any,
    messages: list[dict],
    tools: tuple[dict, ...] | None,
    rendering: ChatRendering | None,
) -> list[int]:
    if not messages:
        raise InvalidRequest("messages", "is empty; give at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise InvalidRequest(f"messages[{i}]", "needs a string 'role' and 'content'")
    return list(tokenizer.apply_chat_template(messages, tools=tools, rendering=rendering))


class TextOutput:
    """Turns each request's output ids into text as they arrive and applies stop strings.

    Text that could still be the start of a stop string is held back from streaming, so the
    streamed text always equals the final text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def update(self, request: Request, new_ids: list[int], stop_token: bool = False) -> bool:
        """Extend request.text by its output ids just gained (`new_ids`, already appended to
        request.output_ids); `stop_token`: the last of them stopped the request (EOS or a stop
        token id), and its text is left out unless the request includes it. True when a stop
        string matched: the text ends before it (or after it, where included)."""
        if self.tokenizer is None:
            return False
        params = request.params
        if request.detok is None:
            request.detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_ids, params.skip_special_tokens
            )
        if stop_token and not params.include_stop_str_in_output:
            new_ids = new_ids[:-1]
        old_len = len(request.text)
        request.text += request.detok.add(new_ids)
        stops = params.stop
        if not stops:
            return False
        search_from = max(0, old_len - max(len(s) for s in stops) + 1)
        hits = [(at, -len(s)) for s in stops if (at := request.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        at, minus_length = min(hits)  # the first to start; of those, the longest
        request.text = request.text[
            : at - minus_length if params.include_stop_str_in_output else at
        ]
        request.stopped_by_string = True
        return True

    def finish(self, request: Request) -> None:
        """Flush what the detokenizer held back (unless a stop string cut the text)."""
        if request.detok is not None and not request.stopped_by_string:
            request.text += request.detok.flush()

    @staticmethod
    def streamable_chars(request: Request) -> int:
        """How much of request.text may be streamed now."""
        if request.done or not request.params.stop:
            return len(request.text)
        hold = max(len(s) for s in request.params.stop) - 1
        return max(request.sent_chars, len(request.text) - hold)


def to_params(params: SamplingParams | dict | None) -> SamplingParams:
    """A request's sampling parameters from what a caller gave (None: the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    try:
        return SamplingParams(**params)
    except TypeError as error:
        raise InvalidRequest("sampling_params", str(error)) from None
    except ValueError as error:
        field = str(error).split("=", 1)[0]
        raise InvalidRequest(field, str(error)) from None


def as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt, or a list of them, as a list."""
    if _is_one_prompt(prompts):
        return [prompts]
    return list(prompts)


def _is_one_prompt(prompts: PromptInput | Sequence[PromptInput]) -> TypeIs[PromptInput]:
    """Whether `prompts` is one prompt rather than a list of them: a string, a ChatPrompt, or
    a list that begins with a token id or a chat message (an empty list has no prompts)."""
    if isinstance(prompts, (str, ChatPrompt)):
        return True
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], (int, dict))
