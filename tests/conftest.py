"""Test set-up: run Triton kernels in the interpreter when there is no CUDA device (this must
happen before any module defining kernels is imported), and make every run draw the same
hypothesis examples.
"""

import importlib
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ENGINE_DEBUG", "1")

# Deterministic CI: the examples follow from each test's name and strategies alone (no random
# seed, no example database to replay from, so a fresh clone draws what every other run draws);
# no time limit per example and no too-slow health check (both are wall-clock assertions, and
# this machine is shared). A failure prints the blob that reproduces it (@reproduce_failure).
# Tests whose space is large ask for more examples in their own @settings, which inherit
# this profile: it is loaded here, before any test module builds its settings.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


@pytest.fixture
def bench_script(monkeypatch):
    """`bench_script(name)`: the script `benchmarks/<name>.py` imported as a module (the
    folder is on sys.path for the test, as it is for a script run from it). Not `benchmark`:
    pytest-benchmark, installed on the GPU image, owns that fixture name and errors on
    a test whose `benchmark` is anything else."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module


@pytest.fixture
def bench_refusal(bench_script, monkeypatch, capsys):
    """`bench_refusal(name, argv, cuda)`: what `benchmarks/<name>.py`'s main writes to stderr
    as it exits on `argv`, with torch seeing a CUDA device or not (`cuda`); the test fails
    where it does not exit."""

    def refuse(name: str, argv: list[str], cuda: bool) -> str:
        script = bench_script(name)
        monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
        monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
        with pytest.raises(SystemExit):
            script.main()
        return capsys.readouterr().err

    return refuse


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_kernels: needs the CPU kernels (engine/csrc); "
        "skipped, with the reason, where they cannot be built",
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("cpu_kernels") is not None:
        from engine import cpu_kernels

        status = cpu_kernels.status()
        if not status.available:
            pytest.skip(f"CPU kernels: {status.reason}")


def _load_kernel_launches():
    """tests/kernel_launches.py as the module `kernel_launches` (the suite imports test
    files by path, so tests/ is not on sys.path)."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kernel_launches", Path(__file__).with_name("kernel_launches.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_launches"] = module  # before it runs: its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


kernel_launches = _load_kernel_launches()

# ENGINE_RECORD_LAUNCHES=DIR: record every Triton launch the interpreter runs, one file a
# process, for `tests/kernel_launches.py DIR` to compile for the GPU (`make test` does).
_RECORD = os.environ.get("ENGINE_RECORD_LAUNCHES")
if _RECORD and os.environ.get("TRITON_INTERPRET") == "1":
    from pathlib import Path

    _recorder = kernel_launches.Recorder()
    _recorder.install()

    def pytest_sessionfinish(session):
        if _recorder.launches:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            _recorder.save(Path(_RECORD) / f"{worker}.pickle")
