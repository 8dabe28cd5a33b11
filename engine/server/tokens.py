"""The tokenizer's endpoints, as vLLM's: POST /tokenize (the ids the server would run a prompt
or chat as, and their count) and POST /detokenize (the text of ids)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.errors import InvalidRequest
from engine.server.errors import OpenAIError
from engine.server.protocol import DetokenizeRequest, TokenizeRequest
from engine.server.runs import ServerState
from engine.shell.inbox import validate_token_ids
from engine.shell.textio import ChatPrompt, prompt_to_ids

router = APIRouter()


def _served(request: Request, model: str | None) -> ServerState:
    """The server's state, once `model` (where given) is the one served here."""
    state: ServerState = request.app.state.server
    if model is not None:
        state.check_model(model)
    return state


def _refused(exc: InvalidRequest, field: str) -> OpenAIError:
    return OpenAIError(400, f"{field}: {exc.message}", field, "invalid_value")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _served(request, body.model)
    engine = state.aengine.engine
    if body.messages is not None:
        field = "messages"
        messages = tuple(message.as_dict() for message in body.messages)
        prompt: Any = ChatPrompt(messages, None, body.rendering)
    else:
        field, prompt = "prompt", body.prompt
    try:
        ids = prompt_to_ids(engine.tokenizer, prompt)
        validate_token_ids(ids, engine.runtime.vocab_size)
    except InvalidRequest as exc:
        raise _refused(exc, field) from exc
    return {"count": len(ids), "max_model_len": state.max_context, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    engine = _served(request, body.model).aengine.engine
    try:
        validate_token_ids(body.tokens, engine.runtime.vocab_size, "tokens")
        if engine.tokenizer is None:
            raise InvalidRequest("tokens", "this engine has no tokenizer (random weights)")
    except InvalidRequest as exc:
        raise _refused(exc, "tokens") from exc
    return {"prompt": engine.tokenizer.decode(body.tokens)}
