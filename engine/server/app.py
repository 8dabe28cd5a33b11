"""Builds the FastAPI app around one Engine and runs it with uvicorn (`engine serve`).

The engine loop runs in the AsyncEngine's one background thread; handlers submit, stream, abort.
SIGINT / SIGTERM: stop accepting, abort the requests in flight, stop the engine, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from engine.api import AsyncEngine
from engine.model.loader import DEFAULT_GGUF_NAME
from engine.server.errors import install_error_handlers
from engine.server.guards import BodyLimit, RequireAPIKey
from engine.server.metrics import ServerMetrics
from engine.server.options import ServerOptions
from engine.server.routes import router
from engine.server.runs import ServerState, request_log
from engine.server.tokens import router as token_router
from engine.shell.config import EngineConfig
from engine.shell.engine import Engine
from engine.shell.startup import freeze_startup_objects, warm_up

GRACEFUL_SHUTDOWN_S = 10


def model_name_of(config: EngineConfig) -> str:
    """The id clients send: the model file's or directory's name (the default GGUF's stem)."""
    if config.random_weights:
        return f"random-{config.random_weights}"
    return Path(config.model).stem if config.model else Path(DEFAULT_GGUF_NAME).stem


def create_app(
    engine: Engine, served_model_name: str | None = None, options: ServerOptions | None = None
) -> FastAPI:
    """An app serving `engine`; the engine loop starts and stops with the app's lifespan."""
    options = options or ServerOptions()
    aengine = AsyncEngine(engine, max_waiting=options.max_waiting_requests)
    state = ServerState(
        aengine=aengine,
        model_name=served_model_name or model_name_of(engine.config),
        max_context=engine.max_context,
        metrics=ServerMetrics(engine, engine.config.speculative),
        options=options,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # no request waits for the grammar vocabulary: it is built before the server listens
        await asyncio.to_thread(engine.grammars.wait_ready)
        aengine.start()
        try:
            yield
        finally:
            state.abort_all()
            await asyncio.to_thread(aengine.stop)  # aborts what is left, joins the loop thread

    app = FastAPI(title="engine", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(token_router)
    _add_middleware(app, options, state.metrics)
    return app


def _add_middleware(app: FastAPI, options: ServerOptions, metrics: ServerMetrics) -> None:
    """Outermost first: CORS (a browser's preflight carries no key), the API key, the body
    limit (an unauthorized body is never read)."""
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes, metrics=metrics)
    if options.api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=options.api_key, metrics=metrics)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests when it starts shutting down, and returns
    normally after a signal instead of re-raising it (so the process exits with status 0).
    `on_listening(url)`, if given, is called once it accepts connections, with the URL of the
    port it listens on (the port it got, where it was asked for port 0)."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        on_listening: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._state = state
        self._on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_listening is not None:
            self._on_listening(self.url)

    @property
    def url(self) -> str:
        """The URL of the port listened on (the first, where the host has several)."""
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.config.host
        return f"{'https' if self.config.is_ssl else 'http'}://" + (
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        )

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._state.abort_all()
        await super().shutdown(sockets)


def make_server(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    on_listening: Callable[[str], None] | None = None,
) -> GracefulServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    return GracefulServer(config, app.state.server, on_listening)


def serve(
    model: str | None,
    host: str,
    port: int,
    speculative: bool,
    log_level: str = "info",
    served_model_name: str | None = None,
    on_listening: Callable[[str], None] | None = None,
    options: ServerOptions | None = None,
    **engine_overrides: Any,
) -> None:
    """`engine serve`: load the model, serve until SIGINT / SIGTERM, then return. Port 0
    listens on a free port; `on_listening(url)` is called with its URL once it accepts."""
    options = options or ServerOptions()
    if options.logs_requests:
        _log_requests_to_stderr()
    engine = Engine(model, speculative=speculative, **engine_overrides)
    if options.warm_up:
        warm_up(engine)  # before the loop's thread exists
    app = create_app(engine, served_model_name, options)
    freeze_startup_objects(engine)
    server = make_server(app, host, port, log_level, on_listening)
    # One socket, bound here: port 0 becomes one port (a host name resolving to several
    # addresses would otherwise get a different free port on each)
    listener = server.config.bind_socket()
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
        engine.close()  # joins the tensor-parallel workers: none outlives the server


def _log_requests_to_stderr() -> None:
    """The request log lines on stderr, beside uvicorn's own, whatever `--log-level` says."""
    if not request_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


class BackgroundServer:
    """Runs an app on 127.0.0.1 in a daemon thread (tests, benchmarks); stop() shuts it down."""

    def __init__(self, app: FastAPI, port: int = 0, log_level: str = "warning") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, "127.0.0.1", self.port, log_level)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="uvicorn", daemon=True
        )

    def start(self, timeout_s: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline_s = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline_s:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the server did not start listening within {timeout_s} s")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError(f"the server did not stop within {timeout_s} s")
