"""docs/api/state.md is rendered from the docstrings of engine.state's public names (`make
docs`): every stable name has a docstring, and the file is current."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import engine.state as state

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_stable_name_is_documented():
    script = load_script()
    missing = []
    for name in state.__all__:
        obj = getattr(state, name)
        if inspect.isclass(obj):
            documented = bool(vars(obj).get("__doc__"))  # its own, not one it inherits
        elif callable(obj):
            documented = bool(obj.__doc__)
        else:
            documented = name in script.CONSTANTS
        if not documented:
            missing.append(name)
    assert missing == []


def test_the_rendered_api_is_current():
    script = load_script()
    assert script.render() == script.OUT.read_text(), "docs/api/state.md is stale: `make docs`"
