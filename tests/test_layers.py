"""The package's layers, read from its imports: each module imports only layers below its own
(or its own group), and no set of modules imports itself round a cycle. Imports inside
functions and under TYPE_CHECKING count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "engine"

# (rank, group): a module may import a lower rank, or its own group. Groups of one rank are
# peers and may not import each other (spec, backends and ops each stand on state alone).
LAYERS = {
    "engine.errors": (0, "errors"),
    "engine.cpu_kernels": (0, "cpu_kernels"),
    "engine.pdl": (0, "pdl"),
    "engine.state": (1, "state"),
    "engine.spec": (2, "spec"),
    "engine.backends": (2, "backends"),
    "engine.ops": (2, "ops"),
    "engine.model": (3, "model"),
    "engine.shell": (4, "shell"),
    "engine.api": (5, "api"),
    "engine.server": (6, "server"),
    "engine.cli": (7, "cli"),
    "engine.__main__": (8, "main"),
    "engine": (8, "package"),  # engine/__init__.py: the public names, re-exported
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> tuple[int, str]:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer; add it to LAYERS in {__file__}")


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """The engine modules `path` imports, anywhere in it."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "engine")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "engine":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if is_module(sub) else base)
    return found


def graph() -> dict[str, set[str]]:
    return {
        module_name(path): imports_of(path) - {module_name(path)}
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in edges.items():
        rank, group = layer_of(module)
        for target in sorted(targets):
            target_rank, target_group = layer_of(target)
            if target_group != group and target_rank >= rank:
                bad.append(f"{module} ({group}) imports {target} ({target_group})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def without_package_init(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exports its modules, which import siblings through it: that
    is not a cycle of dependencies, so the re-export edges are left out."""
    return {
        module: {t for t in targets if not module.startswith(t + ".")}
        for module, targets in edges.items()
    }


def test_every_import_goes_down_a_layer():
    assert upward_imports(graph()) == []


def test_no_import_cycles():
    assert cycles(without_package_init(graph())) == []


def test_no_module_imports_another_modules_private_name():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                bad += [
                    f"{module_name(path)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert bad == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"engine.state.batch": {"engine.shell.kv"}}, ["engine.state.batch (state) imports"]),
        ({"engine.spec.tree": {"engine.backends.base"}}, ["engine.spec.tree (spec) imports"]),
        ({"engine.shell.kv": {"engine.state.batch"}}, []),
        ({"engine.shell.kv": {"engine.shell.engine"}}, []),
    ],
)
def test_the_check_sees_an_upward_import(edges, expected):
    found = upward_imports(edges)
    assert [f[: len(e)] for f, e in zip(found, expected, strict=True)] == expected


def test_the_check_sees_a_cycle():
    edges = {"engine.a": {"engine.b"}, "engine.b": {"engine.c"}, "engine.c": {"engine.a"}}
    assert cycles(edges) == [["engine.a", "engine.b", "engine.c"]]
    assert cycles({"engine.a": {"engine.b"}, "engine.b": set()}) == []
