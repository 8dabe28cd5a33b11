"""The suite's own fixtures keep clear of the names pytest plugins define: a plugin that
checks its fixture's value (pytest-benchmark, on the GPU image, errors on a test whose
`benchmark` is not its own) breaks every test that asks for ours."""

import ast
from pathlib import Path

# Fixtures of plugins the suite runs beside: pytest-benchmark (the GPU image), pytest-xdist
# (`make test`, the GPU suite's workers), pytest-mock.
PLUGIN_FIXTURES = {
    "benchmark",
    "benchmark_weave",
    "worker_id",
    "testrun_uid",
    "mocker",
    "class_mocker",
    "module_mocker",
    "package_mocker",
    "session_mocker",
}


def _fixtures(path: Path) -> set[str]:
    """The names of the functions `path` decorates with pytest.fixture."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) in ("pytest.fixture", "fixture"):
                    names.add(node.name)
    return names


def test_the_suites_fixtures_take_no_plugins_name():
    tests = Path(__file__).resolve().parent
    owned = {
        name: path.relative_to(tests)
        for path in [*tests.rglob("conftest.py"), tests / "model_passes.py"]
        for name in _fixtures(path)
    }
    assert owned, "no fixtures found: the scan is broken"
    clashes = {name: str(path) for name, path in owned.items() if name in PLUGIN_FIXTURES}
    assert not clashes, f"fixtures named as a plugin's: {clashes}"
