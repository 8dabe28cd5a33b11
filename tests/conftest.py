"""Test set-up: run Triton kernels in the interpreter when there is no CUDA device (this must
happen before any module defining kernels is imported), and make every run draw the same
hypothesis examples.
"""

import os

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_kernels: needs the CPU kernels (engine/csrc); "
        "skipped, with the reason, where they cannot be built",
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("cpu_kernels") is not None:
        import pytest

        from engine import cpu_kernels

        status = cpu_kernels.status()
        if not status.available:
            pytest.skip(f"CPU kernels: {status.reason}")
