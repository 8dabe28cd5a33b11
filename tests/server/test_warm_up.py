"""`engine serve` runs `warm_up` before it listens, unless `--skip-warm-up`."""

from __future__ import annotations

import pytest

from engine.cli import build_parser, server_options_from
from engine.server import app
from engine.server.options import ServerOptions


class _Socket:
    def close(self) -> None:
        pass


@pytest.mark.parametrize("skip", [False, True])
def test_serve_warms_the_engine_up_before_it_listens_unless_told_not_to(monkeypatch, skip):
    events = []

    class Server:  # stands for uvicorn
        class config:
            @staticmethod
            def bind_socket():
                return _Socket()

        def run(self, sockets):
            events.append("listen")

    monkeypatch.setattr(app, "make_server", lambda *args, **kwargs: Server())
    monkeypatch.setattr(app, "freeze_startup_objects", lambda engine: events.append("freeze"))
    monkeypatch.setattr(app, "warm_up", lambda engine: events.append("warm up"))
    args = build_parser().parse_args(["serve", *(["--skip-warm-up"] if skip else [])])
    options = server_options_from(args)
    assert options.warm_up is not skip
    app.serve(None, "127.0.0.1", 0, False, options=options, random_weights="tiny", device="cpu")
    assert events == (["freeze", "listen"] if skip else ["warm up", "freeze", "listen"])
    assert ServerOptions().warm_up
