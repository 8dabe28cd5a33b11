"""Render the public API of `engine.state` (the names in its `__all__`) from the docstrings
to docs/api/state.md: `make docs`, or `python scripts/api_docs.py [--check]`."""

from __future__ import annotations

import argparse
import enum
import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api" / "state.md"

INTRO = """\
# `engine.state`: the API

Generated from the docstrings by `make docs` (`scripts/api_docs.py`); do not edit by hand.

`engine.state` is the scheduling core: frozen values (`Running`, `Batch`, `SeqLens`,
`DraftTrees`, `Effects`) and pure transitions that take a snapshot and data (slots handed
out, sampled tokens, accepted paths) and return `Result(running, effects)`. Nothing here
allocates KV or touches a device: the embedding server owns the slots and the request table
and applies each `Effects` in the order its docstring gives. The names below are the stable
ones (`engine.state.__all__`); anything else in the package may change.
`examples/embed_state_machine.py` is a whole server loop over them in about 130 lines;
`docs/architecture.md` tells how this project's engine drives them.
"""


CONSTANTS = {  # what the comments beside them in engine/state/batch.py say
    "PADDING_SLOT": "The KV slot padded entries (a CUDA graph's padding tokens) write to: never "
    "handed to a request, so a pool of capacity C has C + 1 slots.",
    "MAX_TREE_NODES": "The most nodes a draft tree has (ancestor masks are int64 bit sets).",
}


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(no docstring)"


def _signature(obj: Any, method: bool = False) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    if method:  # self or cls goes without saying
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return str(signature).replace("'", "")


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods, class methods and properties defined on `cls` itself."""
    found: list[tuple[str, Any]] = []
    for name, member in vars(cls).items():
        if name.startswith("_") or not (member.__doc__ or isinstance(member, property)):
            continue
        if isinstance(member, (classmethod, staticmethod)):
            found.append((name, member.__func__))
        elif isinstance(member, property) or inspect.isfunction(member):
            found.append((name, member))
    return found


def _class(name: str, cls: type) -> list[str]:
    lines = [f"## class `{name}`", ""]
    if issubclass(cls, enum.Enum):
        lines += [_doc(cls), "", "Members: " + ", ".join(f"`{m.name}`" for m in cls), ""]
        return lines
    fields = getattr(cls, "__attrs_attrs__", None)
    if fields is not None:
        names = [f"`{f.name}`" for f in fields if not f.name.startswith("_")]
        lines += [f"`{name}({', '.join(f.alias for f in fields if f.init)})`", ""]
        lines += [_doc(cls), "", "Fields: " + ", ".join(names) + ".", ""]
    else:
        lines += [_doc(cls), ""]
    for member_name, member in _members(cls):
        text = _doc(member).replace("\n", " ")
        if isinstance(member, property):
            lines += [f"- `{member_name}` (property)" + (f": {text}" if member.__doc__ else "")]
        else:
            bound = not isinstance(vars(cls)[member_name], staticmethod)
            lines += [f"- `{member_name}{_signature(member, method=bound)}`: {text}"]
    return lines + [""]


def render() -> str:
    sys.path.insert(0, str(ROOT))
    import engine.state as state

    parts = [INTRO]
    for name in state.__all__:
        obj = getattr(state, name)
        if inspect.isclass(obj):
            parts += _class(name, obj)
        elif callable(obj):
            parts += [f"## `{name}{_signature(obj)}`", "", _doc(obj), ""]
        else:
            parts += [f"## `{name} = {obj!r}`", "", CONSTANTS.get(name, ""), ""]
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the file is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
