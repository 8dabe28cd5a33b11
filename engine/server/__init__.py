"""OpenAI-compatible HTTP server embedding the engine (FastAPI + uvicorn): `engine serve`.

Lazy: `engine.server.options` imports without the server extra (the CLI reads its defaults)."""

from __future__ import annotations

from typing import Any

__all__ = ["BackgroundServer", "ServerOptions", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("BackgroundServer", "create_app", "serve"):
        from engine.server import app

        return getattr(app, name)
    if name == "ServerOptions":
        from engine.server.options import ServerOptions

        return ServerOptions
    raise AttributeError(name)
