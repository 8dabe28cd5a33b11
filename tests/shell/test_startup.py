"""`freeze_startup_objects` lives in the shell, so that what imports it (`profile_steps.py`,
`bench_gc.py`) runs where the server's packages are not installed (the GPU image has no
uvicorn or FastAPI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoServerPackages(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("uvicorn", "fastapi", "starlette"):
                raise ImportError(f"{name} is not installed here")
            return None

    sys.meta_path.insert(0, NoServerPackages())
    sys.path.insert(0, "benchmarks")
    import profile_steps, bench_gc  # noqa: F401
    from engine.shell.startup import freeze_startup_objects  # noqa: F401
    print("imported")
    """
)


def test_the_benchmarks_that_freeze_import_without_the_server_packages():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("imported")
