"""The bodies the server sends back: a response, a stream chunk, the usage, and the logprobs
objects inside them, in OpenAI's shapes (and vLLM's, for prompt_logprobs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.shell.request import Usage


def usage_body(usage: Any) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` counts prompt tokens whose KV the prefix cache
    supplied."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def combined_usage(usages: list[Any], n: int) -> Usage:
    """One response's usage over its choices (n per prompt, prompt by prompt): each prompt
    counted once, every choice's completion tokens."""
    firsts = usages[::n]
    return Usage(
        sum(u.prompt_tokens for u in firsts),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in firsts),
    )


class ResponseShape:
    """Builds the response and chunk bodies of one request: its id, model and creation time;
    `token_text` spells a token id for logprobs (its text: the offsets and bytes), and with
    `as_ids` (vLLM's return_tokens_as_token_ids) a logprob's token is "token_id:N"."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        token_text: Callable[[int], str],
        as_ids: bool = False,
    ) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.token_text = token_text
        self.as_ids = as_ids
        self.created_s = int(time.time())

    def _token(self, token: int) -> str:
        """A logprob entry's token: its text, or with `as_ids` "token_id:N"."""
        return f"token_id:{token}" if self.as_ids else self.token_text(token)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created_s,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        logprobs: Any = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole response; `logprobs`: its tokens' entries, or None;
        `tool_calls`: a chat message's calls (with its content, None where there is none)."""
        body = self.logprobs_body(logprobs, 0)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {
                "index": index,
                "message": message,
                "logprobs": body,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": body, "finish_reason": finish_reason}

    def full(self, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_body(usage)
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: Any = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """One stream chunk of choice `index`: new text (None = an empty delta) with its
        tokens' logprobs, or the finish reason."""
        body = self.logprobs_body(logprobs, text_offset)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": body,
                "finish_reason": finish_reason,
            }
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": body,
            "finish_reason": finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def tool_chunk(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A chat stream chunk of choice `index` carrying tool-call deltas."""
        choice = {
            "index": index,
            "delta": {"tool_calls": calls},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, usage: Any) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body

    def logprobs_body(self, entries: Any, text_offset: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object for `entries` (TokenLogprob), or None without them: chat's
        `content` list, or the completions' parallel lists (`text_offset` from the first
        token's offset in the choice's text)."""
        if entries is None:
            return None
        if not self.chat:
            return self._completion_logprobs(entries, text_offset)
        spell, label = self.token_text, self._token

        def item(token: int, logprob: float) -> dict[str, Any]:
            text = spell(token)
            return {"token": label(token), "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                item(e.token_id, e.logprob) | {"top_logprobs": [item(t, v) for t, v in e.top]}
                for e in entries
            ]
        }

    def _completion_logprobs(self, entries: Any, text_offset: int) -> dict[str, Any]:
        """The completions' parallel lists; an entry may be a bare token id (the echoed
        prompt's first token, which nothing scores: null logprob and alternatives)."""
        rows = [
            (e, None, None) if isinstance(e, int) else (e.token_id, e.logprob, e.top)
            for e in entries
        ]
        offsets = []
        for token, _, _ in rows:
            offsets.append(text_offset)
            text_offset += len(self.token_text(token))
        label = self._token
        return {
            "tokens": [label(token) for token, _, _ in rows],
            "token_logprobs": [logprob for _, logprob, _ in rows],
            "top_logprobs": [
                None if top is None else {label(t): v for t, v in top} for _, _, top in rows
            ],
            "text_offset": offsets,
        }

    def prompt_logprobs_body(self, entries: Any, top: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token, null (the first) or a map of token id to
        its logprob, rank and text, for the `top` most likely there and the token itself."""

        def item(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self._token(token)}

        body: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                body.append(None)
                continue
            scores = {
                str(t): item(t, v, rank) for rank, (t, v) in enumerate(entry.top[:top], start=1)
            }
            scores.setdefault(str(entry.token_id), item(entry.token_id, entry.logprob, entry.rank))
            body.append(scores)
        return body
