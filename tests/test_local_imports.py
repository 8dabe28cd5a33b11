"""Imports inside test functions resolve on any machine. A CUDA-only test is skipped on the
CPU before its body runs, so a name it imports there that has moved went unseen until the GPU
suite ran (`LogitsEdit`, moved to `engine.model.logits_edit`)."""

import ast
import importlib
from pathlib import Path

TESTS = Path(__file__).parent


def _local_engine_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) for each `from engine... import name` inside a function."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                if module is not None and (module == "engine" or module.startswith("engine.")):
                    rel = str(path.relative_to(TESTS))
                    found.extend((rel, node.lineno, module, a.name) for a in node.names)
    return found


def test_the_names_test_functions_import_from_the_package_exist() -> None:
    imports = _local_engine_imports()
    assert imports  # the walk finds them (CUDA-only tests import inside their bodies)
    missing = []
    for where, line, module, name in imports:
        found = importlib.import_module(module)
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{where}:{line}: {name} from {module}")
    assert not missing, missing
