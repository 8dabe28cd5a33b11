"""OpenAI-compatible HTTP server embedding the engine (FastAPI + uvicorn): `engine serve`."""

from __future__ import annotations

from engine.server.app import BackgroundServer, add_serve_arguments, create_app, serve

__all__ = ["BackgroundServer", "add_serve_arguments", "create_app", "serve"]
