"""Make the shared case builders (backend_cases.py) importable under --import-mode=importlib,
which does not put test directories on sys.path."""

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_configure(config) -> None:
    # The Triton interpreter trips a NumPy deprecation on every scalar it indexes with.
    config.addinivalue_line(
        "filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter"
    )
