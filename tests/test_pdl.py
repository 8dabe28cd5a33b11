"""Programmatic dependent launch (`engine.pdl`): a kernel launched with it runs beside the one
before it, so every kernel of the package must wait (`enter(PDL)`) before it touches what
another kernel writes, and every launch must give the constexpr and the launch option
together. Read from the source here; on a Hopper GPU the engine's passes give the same
logits, bit for bit, with it and without."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import pdl
from engine.shell.engine import Engine
from engine.spec.cost import PassCost
from engine.state import SamplingParams

PACKAGE = Path(__file__).resolve().parents[1] / "engine"
# what a kernel may do before `enter`: nothing another kernel of the stream writes
BEFORE_ENTER = {"_prefetch_rows"}
MEMORY_OPS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max"}
LAUNCH_HELPERS = {"launch", "_pdl_params"}  # pdl.launch(device, kind), gemv's with its prefetch


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_jit(node: ast.FunctionDef) -> bool:
    return any(
        isinstance(d, ast.Attribute)
        and d.attr == "jit"
        or isinstance(d, ast.Name)
        and d.id == "jit"
        for d in node.decorator_list
    )


def _kernels() -> dict[str, tuple[Path, ast.FunctionDef]]:
    """Every Triton kernel the package launches: jit functions named *_kernel."""
    found = {}
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.FunctionDef)
                and _is_jit(node)
                and node.name.endswith("_kernel")
            ):
                found[node.name] = (path, node)
    return found


def _called(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_the_package_has_the_kernels_this_checks():
    assert {
        "gemv_kernel",
        "_decode_split_kernel",
        "_extend_kernel",
        "_merge_splits_kernel",
    } <= set(_kernels())


@pytest.mark.parametrize("name", sorted(_kernels()))
def test_every_kernel_waits_before_it_touches_memory(name):
    path, kernel = _kernels()[name]
    assert "PDL" in [a.arg for a in kernel.args.args], f"{name} ({path}) takes no PDL constexpr"
    body = kernel.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    entered = [
        i
        for i, stmt in enumerate(body)
        if isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and getattr(stmt.value.func, "id", "") == "enter"
        and [getattr(a, "id", "") for a in stmt.value.args] == ["PDL"]
    ]
    assert entered, f"{name} ({path}) never calls enter(PDL)"
    for stmt in body[: entered[0]]:
        calls = _called(stmt)
        assert not calls & MEMORY_OPS, (
            f"{name} touches memory before enter(PDL): {ast.unparse(stmt)}"
        )
        assert isinstance(stmt, ast.Assign) or calls <= BEFORE_ENTER, (
            f"{name} runs {ast.unparse(stmt)!r} before enter(PDL); only assignments and "
            f"{sorted(BEFORE_ENTER)} may"
        )


def test_every_launch_passes_the_launch_options():
    kernels = set(_kernels())
    launches = 0
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and getattr(node.func.value, "id", "") in kernels
            ):
                continue
            launches += 1
            spread = [k.value for k in node.keywords if k.arg is None]
            helpers = {
                call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
                for call in spread
                if isinstance(call, ast.Call)
            }
            where = f"{path.name}:{node.lineno} ({node.func.value.id})"
            assert helpers & LAUNCH_HELPERS, f"{where} launches without **pdl.launch(...)"
            named = {k.arg for k in node.keywords}
            assert not named & {"PDL", "launch_pdl"}, f"{where} sets PDL apart from its option"
    assert launches >= len(kernels)


def test_launch_options_by_mode_and_device():
    assert pdl.launch(torch.device("cpu"), "products") == {"PDL": 0}  # off by default
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9
    for name, value in pdl.MODES.items():
        with pdl.using(name):
            assert pdl.launch(torch.device("cpu"), "products") == {"PDL": 0}
            if torch.cuda.is_available():
                on = {"PDL": value, "launch_pdl": True} if hopper and value else {"PDL": 0}
                assert pdl.launch(torch.device("cuda", 0), "products") == on
    assert pdl.launch(torch.device("cpu"), "products") == {"PDL": 0}


def test_a_pass_runs_under_auto_only_where_the_package_runs_its_products():
    """Under `auto`: `top` on every launch up to AUTO_MAX_ROWS rows, on every launch the
    process allows but the products up to AUTO_BESIDE_MAX_ROWS, where the package's kernels
    run every product of the layers and no weight of theirs is past AUTO_MAX_WEIGHT_ELEMENTS;
    off otherwise. A mode the process names: every pass."""
    top_rows, beside_rows = pdl.AUTO_MAX_ROWS, pdl.AUTO_BESIDE_MAX_ROWS
    with pdl.using("auto"):
        assert pdl.for_pass(1, True, 1) == pdl.for_pass(top_rows, True, 1) == ("top", None)
        beside = ("top", frozenset(pdl.KINDS) - {"products"})
        assert pdl.for_pass(top_rows + 1, True, 1) == pdl.for_pass(beside_rows, True, 1) == beside
        assert pdl.for_pass(beside_rows + 1, True, 1) == ("off", None)
        assert pdl.for_pass(1, False, 1) == pdl.for_pass(13, False, 1) == ("off", None)
        # a layer weight past the bound PDL was measured to pay under: off at any rows
        bound = pdl.AUTO_MAX_WEIGHT_ELEMENTS
        assert pdl.for_pass(1, True, bound) == ("top", None)
        assert pdl.for_pass(1, True, bound + 1) == pdl.for_pass(13, True, bound + 1)
        assert pdl.for_pass(1, True, bound + 1) == ("off", None)
        with pdl.only_kinds("products,merge"):  # the process's kinds less the products
            assert pdl.for_pass(13, True, 1) == ("top", frozenset({"merge"}))
        assert pdl.launch(torch.device("cpu"), "products") == {"PDL": 0}
        if torch.cuda.is_available():  # outside a pass that chose a mode: off
            assert pdl.launch(torch.device("cuda", 0), "products") == {"PDL": 0}
    for name in pdl.MODES:  # a mode set for the process holds in every pass
        with pdl.using(name):
            assert pdl.for_pass(1, True, 1) == pdl.for_pass(13, False, 1) == (name, None)


def test_a_pass_runs_its_launches_as_its_choice_says(monkeypatch):
    """`running((setting, kinds))` holds the setting, and the kinds where given, for its
    block; both are back as they were after it, an exception or not."""
    monkeypatch.setattr(pdl, "_capable", lambda device: True)  # as on a Hopper GPU
    device = torch.device("cuda", 0)
    before = pdl._state["setting"], pdl._kinds_state["kinds"]
    with pdl.running(("top", frozenset({"attention"}))):
        assert {k for k in pdl.KINDS if pdl.launch(device, k)["PDL"]} == {"attention"}
    with pdl.running(("top", frozenset())):  # the process kept PDL to the products alone
        assert not any(pdl.launch(device, k)["PDL"] for k in pdl.KINDS)
    with pdl.running(("late", None)):
        assert all(pdl.launch(device, k) == {"PDL": 2, "launch_pdl": True} for k in pdl.KINDS)
    with pytest.raises(RuntimeError), pdl.running(("top", frozenset({"ops"}))):
        raise RuntimeError
    assert (pdl._state["setting"], pdl._kinds_state["kinds"]) == before


def _python(
    code: str, setting: str | None, kinds: str | None = None
) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter with ENGINE_PDL=`setting` and ENGINE_PDL_KINDS=`kinds`
    (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PDL", "ENGINE_PDL_KINDS")}
    if setting is not None:
        env["ENGINE_PDL"] = setting
    if kinds is not None:
        env["ENGINE_PDL_KINDS"] = kinds
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_the_process_setting_is_auto_unless_engine_pdl_names_one():
    read = "from engine import pdl; print(pdl._state['setting'])"
    assert _python(read, None).stdout.strip() == "auto"
    assert _python(read, "late").stdout.strip() == "late"
    refused = _python(read, "on")
    assert refused.returncode != 0 and "ENGINE_PDL must be one of ['auto'" in refused.stderr


def test_a_mode_named_for_a_device_without_pdl_is_warned_of_once():
    launch_twice = (
        "import torch; from engine import pdl; "
        "print(pdl.launch(torch.device('cpu'), 'ops'), pdl.launch(torch.device('cpu'), 'ops'))"
    )
    for setting, warned in (("top", 1), ("off", 0), ("auto", 0)):
        done = _python(launch_twice, setting)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "{'PDL': 0} {'PDL': 0}"
        assert done.stderr.count("ENGINE_PDL=") == warned, done.stderr
        assert warned == ("capability 9.0 or newer; launches on cpu run without it" in done.stderr)


def test_launches_of_kinds_left_out_run_without_pdl(monkeypatch):
    """`only_kinds` (ENGINE_PDL_KINDS for a process) keeps PDL to launches of those kinds;
    the others launch without it, under any mode."""
    monkeypatch.setattr(pdl, "_capable", lambda device: True)  # as on a Hopper GPU
    device = torch.device("cuda", 0)
    with pdl.using("top"):
        assert all(pdl.launch(device, k) == {"PDL": 1, "launch_pdl": True} for k in pdl.KINDS)
        with pdl.only_kinds("products,merge"):
            on = {k for k in pdl.KINDS if pdl.launch(device, k)["PDL"]}
            assert on == {"products", "merge"}
            with pdl.only_kinds("all"):
                assert all(pdl.launch(device, k)["PDL"] for k in pdl.KINDS)
        assert all(pdl.launch(device, k)["PDL"] for k in pdl.KINDS)
    with pytest.raises(ValueError, match="kind must be one of .*'attention'.*got 'matmul'"):
        pdl.launch(device, "matmul")
    for bad in ("", "products,rope"):
        with pytest.raises(ValueError, match=f"'all' or kinds of .*got '{bad}'"):
            with pdl.only_kinds(bad):
                pass
    read = "from engine import pdl; print(sorted(pdl._kinds_state['kinds']))"
    env_kinds = _python(read, None, kinds="attention,ops")
    assert env_kinds.stdout.strip() == "['attention', 'ops']", env_kinds.stderr
    refused = _python(read, None, kinds="gemv")
    assert refused.returncode != 0 and "ENGINE_PDL_KINDS must be 'all' or kinds" in refused.stderr


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match="one of .*'late'.*got 'fast'"):
        with pdl.using("fast"):
            pass


def _logits_of_a_run(dtype: str, device: str = "cuda") -> tuple[list, list]:
    engine = Engine(
        random_weights="tiny",
        device=device,
        dtype=dtype,
        max_context=256,
        kv_cache_slots=1024,  # not sized from free memory: it runs under compute-sanitizer
        chunk_size=32,  # prompts prefill in chunks, decodes riding along
        speculative=True,  # verify passes too (the all-rows products in float32)
        draft_budget=4,
        # a fixed draft cost: adaptive drafting then weighs drafts by it, not by the passes'
        # measured times, so both runs draft alike and run the same passes (in bfloat16 a
        # verify pass rounds otherwise than a decode pass)
        draft_cost=0.1,
    )
    runner, passes = engine.runner, []
    launch = runner.launch

    def recorded(prepared, batch, input_ids=None, shift=None):
        logits = launch(prepared, batch, input_ids, shift)
        passes.append((batch.mode, logits.cpu()))
        return logits

    runner.launch = recorded
    prompts = [[(7 * i + j % (3 + i)) % 250 + 3 for j in range(9 + 23 * i)] for i in range(3)]
    done = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    return [c.token_ids for c in done], passes


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability(0)[0] < 9,
    reason="programmatic dependent launch needs a Hopper GPU",
)
@pytest.mark.parametrize("mode", ["top", "late", "exit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_passes_give_the_same_logits_with_and_without_programmatic_launch(dtype, mode):
    with pdl.using(mode):
        tokens, passes = _logits_of_a_run(dtype)
    plain_tokens, plain_passes = _logits_of_a_run(dtype)
    assert tokens == plain_tokens
    assert [mode for mode, _ in passes] == [mode for mode, _ in plain_passes]
    assert len({mode for mode, _ in passes}) == 3  # extend, decode and verify passes
    for (_, logits), (_, plain) in zip(passes, plain_passes, strict=True):
        assert torch.equal(logits, plain)


def test_the_compared_runs_make_the_same_passes_whatever_their_timing(monkeypatch):
    """The comparison above holds only if its two runs make the same passes: with drafting
    weighed by measured step times, a run whose verify steps took longer (a kernel compiled
    in one run only, PDL's own timing) drafted otherwise. Here verify steps cost 1 and then 5
    decode steps' time."""
    observe = PassCost.observe_step
    modes = []
    for verify_ms in (1.0, 5.0):

        def timed(cost, rows, seconds, verify=False, verify_ms=verify_ms):
            return observe(cost, rows, (verify_ms if verify else 1.0) * 1e-3, verify)

        monkeypatch.setattr(PassCost, "observe_step", timed)
        _, passes = _logits_of_a_run("float32", device="cpu")
        modes.append([mode for mode, _ in passes])
    assert modes[0] == modes[1]
    assert len(set(modes[0])) == 3  # extend, decode and verify passes
