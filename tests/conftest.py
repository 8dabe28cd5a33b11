"""Test set-up: run Triton kernels in the interpreter when there is no CUDA device.

This must happen before any module defining kernels is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ENGINE_DEBUG", "1")


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
