"""OpenAI-style error bodies {"error": {message, type, param, code}} and the app's error
handlers."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class OpenAIError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(
            status_code=self.status_code,
            content=error_body(self.message, self.error_type, self.param, self.code),
            headers=self.headers,
        )


def error_body(
    message: str, error_type: str, param: str | None, code: str | None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """'body.messages.0.role' -> 'messages.0.role'; pydantic's union-branch names are dropped."""
    parts = (
        [str(part) for part in loc[1:] if not _is_union_branch(part)]
        if loc[:1] == ("body",)
        else [str(part) for part in loc]
    )
    return ".".join(parts) or None


def _is_union_branch(part: Any) -> bool:
    return isinstance(part, str) and (
        part.startswith(("list[", "function-")) or part in ("str", "int", "float", "bool")
    )


# Other servers' names of fields this server takes under other names: a request that uses
# one is told which (vLLM's `guided_*`, which vLLM itself now takes as `structured_outputs`;
# Hugging Face's `max_new_tokens`)
RENAMED = {
    "guided_json": 'structured_outputs {"json": SCHEMA}',
    "guided_regex": 'structured_outputs {"regex": PATTERN}',
    "guided_choice": 'structured_outputs {"choice": [STRINGS]}',
    "guided_grammar": 'structured_outputs {"grammar": LARK}',
    "guided_decoding_backend": "structured_outputs (one backend: llguidance)",
    "max_new_tokens": "max_tokens",
}


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first pydantic error, as a 400 that names the field and the value it got."""
    errors = exc.errors()
    first: dict[str, Any] = (
        errors[0] if errors else {"type": "invalid", "loc": (), "msg": "invalid request"}
    )
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return OpenAIError(400, f"request body is not valid JSON: {detail}", None, "invalid_json")
    param = _param_of(tuple(first["loc"]))
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"{param} is required" if param else "a JSON object request body is required"
    elif first["type"] == "model_attributes_type" and param is None:
        message = "request body must be a JSON object"
    elif first["type"] == "extra_forbidden":
        instead = RENAMED.get(param or "")
        remedy = f"use {instead} instead" if instead else "remove it"
        message = (
            f"{param} is not supported by this server; {remedy} (no field is taken and ignored)"
        )
        return OpenAIError(400, message, param, "unsupported_parameter")
    elif first["type"] == "value_error":
        pass  # our own validators' messages already name the field and the allowed values
    elif "input" in first and not isinstance(first["input"], (dict, list)):
        message = f"{param}: {message} (got {first['input']!r})"
    else:
        message = f"{param}: {message}" if param else message
    return OpenAIError(400, message, param, "invalid_value")


def _answer(request: Request, error: OpenAIError) -> JSONResponse:
    state = getattr(request.app.state, "server", None)
    if state is not None:
        state.metrics.requests_rejected.labels(str(error.status_code)).inc()
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.status_code != 404 else f"no route {request.url.path}"
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _answer(request, OpenAIError(exc.status_code, message, None, None, error_type))
