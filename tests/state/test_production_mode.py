"""The suite runs with ENGINE_DEBUG=1, so the trusted constructors' fast path (what production
runs) would go untested: the state tests and one end-to-end engine run, again with
ENGINE_DEBUG=0, in a separate process (the switch is read at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.state import debug

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
# Speculative verify on a tiny random model: rejected drafts' slots are freed through the
# trusted Effects, and the test checks that every slot comes back.
ENGINE_TEST = (
    "tests/shell/test_spec_overflow.py::"
    "test_verify_beyond_the_largest_graph_equals_greedy_and_frees_everything"
)


@pytest.mark.skipif(not debug.DEBUG, reason="this process already runs with ENGINE_DEBUG=0")
def test_state_tests_and_an_engine_run_pass_with_engine_debug_off():
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    command += ["tests/state", f"--ignore={THIS}", ENGINE_TEST]
    env = {**os.environ, "ENGINE_DEBUG": "0"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"with ENGINE_DEBUG=0:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
