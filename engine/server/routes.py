"""The HTTP endpoints: completions and chat completions (JSON or SSE), models, health, metrics."""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import attrs
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import InvalidRequest
from engine.server.errors import OpenAIError
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.respond import Run, SSEResponse, collect, sse
from engine.server.runs import ServerState, run_request
from engine.server.shapes import ResponseShape
from engine.server.tool_parser import HermesToolParser, reader_for
from engine.server.tools import ToolCalls, takes_tools
from engine.shell.textio import ChatPrompt
from engine.state import SamplingParams, StructuredOutputs

router = APIRouter()
_SERVER_START_S = int(time.time())
try:
    _VERSION = importlib.metadata.version("engine")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    _VERSION = "not installed"


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    """Every sampling field of the body, in the engine's terms (max_tokens None: up to the
    context limit); `structured`: what the output must match (`_constraint`)."""
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop_strings,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            seed=body.seed,
            n=body.n,
            logprobs=body.logprob_count,
            prompt_logprobs=body.prompt_logprob_count,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=tuple(body.bad_words or ()),
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=tuple((body.logit_bias or {}).items()),
            structured_outputs=structured,
        )
    except ValueError as exc:
        field = re.match(r"^(\w+)=", str(exc))
        param = field.group(1) if field else None
        raise OpenAIError(400, str(exc), param, "invalid_value") from exc


def _constraint(
    body: CompletionRequest | ChatCompletionRequest, tokenizer: Any
) -> tuple[StructuredOutputs | None, str | None, ToolCalls | HermesToolParser | None]:
    """What the output must match, the request field it came from (one at most of
    response_format, structured_outputs and a tool choice), and the reader of the tool
    choice's calls."""
    sources: list[tuple[str, Any]] = []
    if body.response_format is not None and body.response_format.type != "text":
        sources.append(("response_format", body.response_format.structured))
    if body.structured_outputs is not None:
        sources.append(("structured_outputs", body.structured_outputs.structured))
    if isinstance(body, ChatCompletionRequest) and _tool_calls_asked(body):
        sources.append(("tool_choice", lambda: reader_for(body, tokenizer)))
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        message = f"{names} each constrain the output; give one of them"
        raise OpenAIError(400, message, sources[1][0], "invalid_value")
    if not sources:
        return None, None, None
    field, make = sources[0]
    try:
        made = make()
    except ValueError as exc:
        raise OpenAIError(400, f"{field}: {exc}", field, "invalid_value") from exc
    if isinstance(made, ToolCalls):
        return made.structured, field, made
    if isinstance(made, HermesToolParser):
        return None, field, made
    return made, field, None


def _tool_calls_asked(body: ChatCompletionRequest) -> bool:
    """Whether the request asks for tool calls (tools, and a tool choice other than "none";
    without one, "auto")."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            message = "tool_choice needs tools to choose from"
            raise OpenAIError(400, message, "tool_choice", "invalid_value")
        return False
    return body.tool_choice != "none"


def _check_servable(state: ServerState, model: str) -> None:
    if state.draining:
        raise OpenAIError(
            503,
            "the server is shutting down; retry on another replica",
            None,
            "shutting_down",
            "server_error",
        )
    state.check_model(model)


async def _first_delta(deltas: AsyncIterator[Any], chat: bool, origin: str | None = None) -> Any:
    """Waits for the first delta, turning the engine's validation error into a 400 (for chat,
    the engine's "prompt" is the request's "messages"; its "structured_outputs" is the field
    `origin` the constraint came from)."""
    try:
        first = await anext(deltas, None)
    except InvalidRequest as exc:
        field = "messages" if chat and exc.field == "prompt" else exc.field
        if origin is not None and field.startswith("structured_outputs"):
            field = origin
        raise OpenAIError(400, f"{field}: {exc.message}", field, "invalid_value") from exc
    if first is None:
        raise OpenAIError(
            500, "the engine ended the request without a result", None, None, "server_error"
        )
    return first


async def _generate(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: Sequence[str | list[int] | ChatPrompt],
    max_tokens: int | None,
    chat: bool,
) -> Response:
    """Every prompt's n choices (index: prompt by prompt, then sample), as one response."""
    state = _state(request)
    _check_servable(state, body.model)
    engine = state.aengine.engine
    structured, origin, tools = _constraint(body, engine.tokenizer)
    params = _sampling_params(body, max_tokens, structured)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.return_tokens_as_token_ids and params.logprobs is None:
        raise OpenAIError(
            400,
            "return_tokens_as_token_ids spells the tokens of logprobs; it needs logprobs",
            "return_tokens_as_token_ids",
            "invalid_value",
        )
    shape = ResponseShape(
        chat,
        request_id,
        state.model_name,
        _speller(engine.tokenizer),
        body.return_tokens_as_token_ids,
    )
    endpoint = "chat" if chat else "completions"
    echo = [
        _echo_text(engine.tokenizer, prompt) if getattr(body, "echo", False) else ""
        for prompt in prompts
    ]
    total = len(prompts) * params.n

    scores: dict[int, tuple[Any, Any]] = {}  # by prompt: its first sample's prompt scores

    async def start(index: int) -> Run:
        prompt, sample = divmod(index, params.n)
        one_id = request_id if total == 1 else f"{request_id}-{index}"
        one = params.sample(sample)
        if sample:  # a prompt's later samples take its first's prompt scores
            one = attrs.evolve(one, prompt_logprobs=None)
        deltas = run_request(state, request, endpoint, prompts[prompt], one, one_id)
        try:
            first = await _first_delta(deltas, chat, origin)
            if not sample:
                scores[prompt] = _prompt_scores(body, shape, first)
            return Run(index, first, deltas, echo[prompt], *scores[prompt])
        except BaseException:
            await deltas.aclose()
            raise

    # Each prompt's first sample, then (its prompt's KV cached by then) the other samples.
    first_samples = [p * params.n for p in range(len(prompts))]
    others = [i for i in range(total) if i % params.n]
    runs: list[Run] = []
    for group in (first_samples, others):
        started = await asyncio.gather(*(start(i) for i in group), return_exceptions=True)
        runs.extend(r for r in started if isinstance(r, Run))
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:  # one invalid prompt refuses the whole request: the others end too
            for run in runs:
                await run.deltas.aclose()
            raise failed[0]
    runs.sort(key=lambda run: run.index)
    if body.stream:
        return SSEResponse(
            sse(shape, runs, body.include_usage, params.n, tools, body.continuous_usage),
            headers={"Cache-Control": "no-cache"},
        )
    return JSONResponse(await collect(shape, runs, params.n, tools))


def _prompt_scores(
    body: CompletionRequest | ChatCompletionRequest, shape: ResponseShape, first: Any
) -> tuple[list[Any] | None, list[Any] | None]:
    """From a choice's first delta: its echo's logprobs (the prompt's first token bare, the
    others with `logprobs` alternatives), where echo and logprobs are asked, and vLLM's
    prompt_logprobs body, where prompt_logprobs is."""
    scores, ids = first.prompt_logprobs, first.prompt_token_ids
    if scores is None or ids is None:
        return None, None
    echoed = None
    if body.echo_logprobs:
        top = body.logprob_count or 0
        echoed = [
            token if entry is None else attrs.evolve(entry, top=entry.top[:top])
            for token, entry in zip(ids, scores, strict=True)
        ]
    asked = body.prompt_logprobs
    return echoed, None if asked is None else shape.prompt_logprobs_body(scores, asked)


def _speller(tokenizer: Any) -> Any:
    """A token id's text for logprobs ("token_id:N" without a tokenizer, as vLLM spells it)."""
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token])


def _echo_text(tokenizer: Any, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "" if tokenizer is None else tokenizer.decode(prompt)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    # CompletionRequest's validator made `prompt` a list of prompts, whatever it was sent as
    prompts = cast(list[str | list[int]], body.prompt)
    return await _generate(request, body, prompts, body.max_tokens, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    messages = [message.as_dict() for message in body.messages]
    tokenizer = _state(request).aengine.engine.tokenizer
    tools = None
    if body.tools and body.tool_choice != "none" and takes_tools(tokenizer):
        tools = tuple(tool.model_dump(exclude_none=True) for tool in body.tools)
    prompt = ChatPrompt(tuple(messages), tools, body.rendering)
    return await _generate(request, body, [prompt], body.max_new_tokens, chat=True)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": _SERVER_START_S,
        "owned_by": "engine",
        "max_model_len": state.max_context,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(model, status=404)
    return _model_card(state)


@router.get("/version")
async def version() -> dict[str, str]:
    """The engine package's version (vLLM's /version)."""
    return {"version": _VERSION}


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if not state.aengine.running:
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)
    if not state.aengine.healthy:
        health = state.aengine.engine.health
        body = {
            "status": "unhealthy",
            "failed_in_a_row": health.failed_in_a_row,
            "last_error": health.last_error,
        }
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
