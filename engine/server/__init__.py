"""OpenAI-compatible HTTP server embedding the engine (FastAPI + uvicorn): `engine serve`."""

from __future__ import annotations

from engine.server.app import BackgroundServer, create_app, serve

__all__ = ["BackgroundServer", "create_app", "serve"]
