"""Tool calls a model writes in its own format (`tool_choice` "auto"): Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as the Qwen2.5 / Qwen3 chat
templates ask for, read from a whole output or from its stream.

A block whose JSON parses into a call of a declared function becomes a call; anything else
(text around the blocks, a malformed block, a call of an unknown function) stays content.
A block left open at the end of an output that ended by itself counts when its JSON is whole
(a stop string may have cut the closing tag). Streaming gives the same content and calls as
the whole output: content as it comes (holding back what may begin a tag), each call once its
block is closed.
"""

from __future__ import annotations

import json
from typing import Any

from engine.server.tools import ToolCalls, takes_tools, tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def hermes_template(tokenizer: Any) -> bool:
    """Whether the model's chat template asks for Hermes-style `<tool_call>` blocks that
    reach the output text (a tag that is a special token is dropped from it)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not takes_tools(tokenizer):
        return False
    specials = getattr(hf, "all_special_tokens", ())
    return OPEN in hf.chat_template and not {OPEN, CLOSE} & set(specials)


def reader_for(body: Any, tokenizer: Any) -> ToolCalls | HermesToolParser:
    """How a chat request's tool calls are made and read: by constrained decoding for
    "required" or a named function; from the model's own `<tool_call>` blocks for "auto"
    (the default with tools). ValueError for "auto" where the model cannot call tools."""
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice != "auto":
        return ToolCalls(body.tools, choice, body.parallel_tool_calls)
    if hermes_template(tokenizer):
        names = [tool.function.name for tool in body.tools]
        return HermesToolParser(names, max_calls=None if body.parallel_tool_calls else 1)
    why = (
        "calls tools in a format this server does not read (it reads <tool_call> blocks)"
        if takes_tools(tokenizer)
        else "never sees the tools: its chat template does not render them"
    )
    raise ValueError(
        f"'auto' (the default with tools) is not supported: the model {why}; "
        "use tool_choice 'required' or name a function"
    )


def parse_call(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one block's text, or None when it is not a call of one of
    `names` with an object of arguments."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _content_or_none(content: str, calls: list[Any]) -> str | None:
    """A message's content: None when calls were made and nothing but whitespace is left."""
    return None if calls and not content.strip() else content


class HermesToolParser:
    """Reads the calls of one request's output; `names`: the functions it may call;
    `max_calls`: how many blocks become calls (1 without `parallel_tool_calls`: later blocks
    stay content), None for any number."""

    def __init__(self, names: list[str], max_calls: int | None = None) -> None:
        self.names = frozenset(names)
        self.max_calls = max_calls

    def read(self, text: str, complete: bool) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole output's content (None when it is only calls) and its calls; `complete`:
        the output ended by itself (not out of tokens), so an open last block may count."""
        stream = self.stream()
        stream.add(text)
        stream.finish(complete)
        return _content_or_none(stream.content, stream.calls), list(stream.calls)

    def stream(self) -> HermesStream:
        return HermesStream(self.names, self.max_calls)


class HermesStream:
    """One streamed output: `add` takes new text and gives the content to send and the
    tool-call deltas (OpenAI's: index, id, type, name and the whole arguments of a call);
    `finish` gives what was held back. Whitespace before anything else is held until it is
    known to be content (not just the space around calls)."""

    def __init__(self, names: frozenset[str], max_calls: int | None = None) -> None:
        self.names, self.max_calls = names, max_calls
        self.pending = ""  # text not yet classified: a possible tag start, or a block
        self.inside = False  # `pending` is the text of an open block
        self.held = ""  # leading whitespace, sent once content follows
        self.content = ""  # content so far (sent or held)
        self.calls: list[tuple[str, str]] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        out, deltas = "", []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(CLOSE) :]
                self.inside = False
                piece, delta = self._block(block, closed=True)
                out += piece
                deltas.extend(delta)
                continue
            start = self.pending.find(OPEN)
            if start < 0:
                keep = _tag_prefix_len(self.pending)
                out += self._text(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            out += self._text(self.pending[:start])
            self.pending = self.pending[start + len(OPEN) :]
            self.inside = True
        return out, deltas

    def finish(self, complete: bool) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: an open block counts if its JSON is whole and the output
        ended by itself (`complete`: not out of tokens); what was held back is content
        (leading whitespace only where no call was made)."""
        out = ""
        deltas: list[dict[str, Any]] = []
        if self.inside:
            self.inside = False
            if complete:
                out, deltas = self._block(self.pending, closed=False)
            else:
                out = self._text(OPEN + self.pending)
        else:
            out = self._text(self.pending)
        self.pending = ""
        if self.held and not self.calls:
            out, self.held = self.held + out, ""
        return out, deltas

    def _text(self, text: str) -> str:
        """Content to send now (leading whitespace held until something else comes)."""
        self.content += text
        if not self.content.strip():
            self.held += text
            return ""
        text, self.held = self.held + text, ""
        return text

    def _block(self, block: str, closed: bool) -> tuple[str, list[dict[str, Any]]]:
        full = self.max_calls is not None and len(self.calls) >= self.max_calls
        found = None if full else parse_call(block, self.names)
        if found is None:  # not a call: the block's text is content, as it was written
            return self._text(OPEN + block + (CLOSE if closed else "")), []
        self.calls.append(found)
        return "", [{"index": len(self.calls) - 1, **tool_call(*found)}]


def _tag_prefix_len(text: str) -> int:
    """The length of the longest end of `text` that begins the opening tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
