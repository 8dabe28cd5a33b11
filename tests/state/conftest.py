"""Make the shared builders (state_builders.py) importable under --import-mode=importlib,
which does not put test directories on sys.path."""

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
