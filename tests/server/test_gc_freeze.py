"""`engine serve` freezes the process's start-up objects (`freeze_startup_objects`) before it
listens: a full garbage collection then scans only what serving created. Run in a child
process: a freeze in the test process would keep its objects from ever being collected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc
    from engine.server import app

    seen = {}

    class Socket:
        def close(self):
            pass

    class Server:  # stands for uvicorn: records the collector's state when serving starts
        class config:
            @staticmethod
            def bind_socket():
                return Socket()

        def run(self, sockets):
            seen["frozen"] = gc.get_freeze_count()
            seen["tracked"] = len(gc.get_objects())

    app.make_server = lambda *args, **kwargs: Server()
    app.serve(None, "127.0.0.1", 0, False, random_weights="tiny", device="cpu")
    print(seen["frozen"], seen["tracked"])
    """
)


def test_serve_freezes_the_startup_objects_before_it_listens():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, tracked = map(int, done.stdout.split()[-2:])
    assert frozen > 50_000  # torch, the model, the tokenizer, the engine
    assert tracked < 1_000  # what a full collection still scans
