"""Engines on the default model, shared per session (weights and tokenizer load once); the
shared checks (engine_checks.py) importable under --import-mode=importlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.shell.engine import Engine

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

CHAT_PROMPTS = [
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "What is the capital of France? Answer briefly."}],
]
TEXT_PROMPTS = ["The quick brown fox", "Once upon a time, in a small village near the mountains,"]


@pytest.fixture(scope="session")
def default_engine() -> Engine:
    return Engine(dtype="float32", device="cpu", max_running_requests=16)


def make_engine(**overrides) -> Engine:
    """An engine sharing the default model's weights, with its own pool and settings."""
    return Engine(dtype="float32", device="cpu", **overrides)


def _assert_all_free(engine: Engine) -> None:
    """No request left anywhere, and every KV slot and table row back in the pool."""
    assert not engine.has_work
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]


@pytest.fixture
def assert_all_free():
    return _assert_all_free


@pytest.fixture(name="make_engine")
def make_engine_fixture():
    return make_engine
