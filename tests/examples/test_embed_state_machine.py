"""examples/embed_state_machine.py: the toy server loop ends every request, leaks no slot,
and goes through retractions, aborts and every kind of finish."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "embed_state_machine.py"


def load():
    spec = importlib.util.spec_from_file_location("embed_state_machine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", range(4))
def test_every_request_ends_and_every_slot_comes_back(seed):
    result = load().serve(40, seed)
    ends = result["ends"]
    assert ends["STOP"] + ends["LENGTH"] + ends["ABORT"] == 40
    assert result["free"] == result["capacity"]
    assert ends["RETRACTED"] > 0 and ends["STOP"] > 0 and ends["LENGTH"] > 0


def test_it_runs_as_a_script():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "8", "--seed", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.startswith("8 requests: ")
    assert "200 of 200 slots free" in done.stdout
