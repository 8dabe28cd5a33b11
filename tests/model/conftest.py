"""The shared model-pass helpers and fixtures (tests/model_passes.py); --import-mode=importlib
does not put test directories on sys.path."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from model_passes import (  # noqa: E402, F401  (fixtures, found by name)
    chunked_logits,
    greedy_runner,
    one_torch_thread,
    two_passes,
)
