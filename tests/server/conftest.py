"""One real Engine (default model, CPU) behind one in-process server on 127.0.0.1, shared by the
server tests; Engine.generate references are computed on it before its loop starts.
Also puts this directory on sys.path (--import-mode=importlib) so tests import serverkit."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from serverkit import MAX_CONTEXT, Served, references_of  # noqa: E402

from engine import Engine  # noqa: E402
from engine.server import BackgroundServer, create_app  # noqa: E402
from engine.server.app import model_name_of  # noqa: E402


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    engine = Engine(None, device="cpu", max_running_requests=32, max_context=MAX_CONTEXT)
    references = references_of(engine)
    server = BackgroundServer(create_app(engine)).start()
    try:
        yield Served(server.url, engine, model_name_of(engine.config), references)
    finally:
        server.stop()
