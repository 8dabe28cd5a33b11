"""Every Triton launch the CPU tests make, compiled for the GPU the engine targets (sm_90:
H100 and H200), on a machine without one.

The CPU suite runs the kernels in Triton's interpreter, which executes each kernel body as
Python: a construct the compiler refuses (an `if` on a string constexpr, a tile shape the
code generator rejects, a launch keyword that no kernel parameter or compiler option takes)
passes there and fails only on a device. Triton's compiler needs no device (its PTX assembler
ships in the wheel), so with `ENGINE_RECORD_LAUNCHES=DIR` the suite records each distinct
launch (kernel, argument types, constexpr values, compiler options, as the JIT would
specialise them on a device) into DIR, one file a process (`tests/conftest.py`), and

    python tests/kernel_launches.py DIR

compiles each one to a cubin in processes without the interpreter, and one launch of each
kernel in every programmatic-dependent-launch mode besides (the interpreter runs without
PDL), and exits 1 naming every launch that does not compile or needs more shared memory
than an sm_90 block has. `make test` runs both. `--usage` also prints each launch's
registers, spills and shared memory, as the device would report them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

TARGET = ("cuda", 90, 32)  # backend, compute capability (H100, H200), warp size
MAX_SHARED = 232448  # bytes of shared memory a block may have on sm_90 (227 KB)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT specialises it: where the kernel lives, its parameters'
    types and constexpr values, the alignment attributes, and the compiler options. `error`
    holds why the launch could not be specialised (e.g. an unrecognised keyword)."""

    module: str
    file: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]
    attrs: tuple[tuple[tuple[int, ...], Any], ...]
    options: tuple[tuple[str, Any], ...]
    error: str = ""

    @property
    def key(self) -> tuple:
        """What makes two launches compile differently, but for the alignment attributes
        (which only tune the code the rest decides)."""
        return (self.module, self.name, self.signature, self.constexprs, self.options, self.error)

    def values(self, show=repr) -> str:
        """The constexpr parameters as `NAME=value, ...`."""
        return ", ".join(
            f"{self.signature[path[0]][0]}={show(value)}" for path, value in self.constexprs
        )

    def describe(self) -> str:
        return f"{self.module}.{self.name}({self.values()})"


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*TARGET)


class Recorder:
    """Records the interpreter's launches (`InterpretedFunction.run`) as `Launch`es while
    installed; each distinct one is kept once. One installed inside another takes the
    launches from it until it is uninstalled (a test's own launches stay out of the suite's
    record)."""

    def __init__(self, execute: bool = True) -> None:
        """`execute=False`: record the launches and run none (for launches the interpreter
        cannot run, such as those with PDL: their outputs are left as they were)."""
        self.execute = execute
        self.launches: dict[tuple, Launch] = {}
        self._binders: dict[Any, tuple] = {}
        self._original = None

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        interpret = getattr(original, "interpret", original)  # the interpreter's own
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            recorder.record(fn.fn, args, kwargs)
            if recorder.execute:
                return interpret(fn, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        run.interpret = interpret  # type: ignore[attr-defined]
        self._original = original
        InterpretedFunction.run = run

    def uninstall(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        if self._original is not None:
            InterpretedFunction.run = self._original
            self._original = None

    def __enter__(self) -> Recorder:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _binder(self, fn) -> tuple:
        if fn not in self._binders:
            from triton.compiler import make_backend
            from triton.runtime.jit import KernelParam, create_function_from_signature

            backend = make_backend(_target())
            sig = inspect.signature(fn)
            params = [
                KernelParam(i, p, False, False) for i, p in enumerate(sig.parameters.values())
            ]
            self._binders[fn] = (
                backend,
                params,
                create_function_from_signature(sig, params, backend),
            )
        return self._binders[fn]

    def record(self, fn, args: tuple, kwargs: dict) -> None:
        """Specialise one launch as `JITFunction.run` would for the target and keep it."""
        from triton import knobs
        from triton.runtime.jit import JITFunction

        backend, params, binder = self._binder(fn)
        kwargs = dict(
            kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode
        )
        where = dict(module=fn.__module__, file=inspect.getsourcefile(fn) or "", name=fn.__name__)
        try:
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = JITFunction._pack_args(
                types.SimpleNamespace(params=params),
                backend,
                kwargs,
                bound,
                specialization,
                options,
            )
        except Exception as exc:  # the launch itself is wrong: reported by `compile_all`
            launch = Launch(
                **where, signature=(), constexprs=(), attrs=(), options=(), error=repr(exc)
            )
        else:
            launch = Launch(
                **where,
                signature=tuple(signature.items()),
                constexprs=tuple(sorted(constexprs.items(), key=lambda kv: kv[0])),
                attrs=tuple(sorted(attrs.items(), key=lambda kv: kv[0])),
                options=tuple(sorted(vars(options).items())),
            )
        self.launches.setdefault(launch.key, launch)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps([vars(launch) for launch in self.launches.values()]))


def load(directory: Path) -> list[Launch]:
    """The distinct launches of every file in `directory`."""
    launches: dict[tuple, Launch] = {}
    for path in sorted(directory.glob("*.pickle")):
        for fields in pickle.loads(path.read_bytes()):
            launch = Launch(**fields)
            launches.setdefault(launch.key, launch)
    return list(launches.values())


def _kernel(launch: Launch):
    try:
        module = importlib.import_module(launch.module)
    except ImportError:  # a kernel defined in a test module, which pytest imported by path
        spec = importlib.util.spec_from_file_location(launch.module, launch.file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return getattr(module, launch.name)


def with_pdl(launches: list[Launch]) -> list[Launch]:
    """For one launch of each kernel that takes the PDL constexpr, the same launch in each of
    `engine.pdl`'s modes, launched with PDL: the interpreter runs without it (mode 0), so
    the suite records none of these."""
    from engine.pdl import MODES

    variants, seen = [], set()
    for launch in launches:
        names = [name for name, _ in launch.signature]
        if launch.error or "PDL" not in names or (launch.module, launch.name) in seen:
            continue
        seen.add((launch.module, launch.name))
        at = (names.index("PDL"),)
        options = tuple((k, True if k == "launch_pdl" else v) for k, v in launch.options)
        for mode in sorted(set(MODES.values()) - {0}):
            constexprs = tuple((p, mode if p == at else v) for p, v in launch.constexprs)
            variants.append(replace(launch, constexprs=constexprs, options=options))
    return variants


@dataclass(frozen=True)
class Compiled:
    """What compiling a launch gave: why it failed ("" where it did not), and the kernel's
    registers a thread, bytes spilled to local memory a thread and shared memory a block
    (from the cubin: `cuobjdump -res-usage`, which ships with Triton); with `mix`, its
    instructions by opcode (`sass_mix`)."""

    error: str
    registers: int = 0
    spilled: int = 0
    shared: int = 0
    mix: dict[str, int] = field(default_factory=dict)


# an instruction of `cuobjdump -sass`: /*0170*/ [@[!]Pn] OPCODE[.MODIFIERS] operands ;
_SASS_LINE = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([.A-Z0-9_]*)\s*([^;]*);"
)


def sass_mix(sass: str) -> dict[str, int]:
    """A kernel's SASS (`cuobjdump -sass`) as counts: its instructions by opcode (modifiers
    dropped), "all" (every instruction, the instructions a thread issues once through the
    code), and "wait all" (waits for every outstanding asynchronous copy, `DEPBAR.LE SB0,
    0x0`: where a loop keeps none of its copies in flight across the wait)."""
    counts: Counter[str] = Counter()
    for opcode, modifiers, operands in _SASS_LINE.findall(sass):
        counts[opcode] += 1
        counts["all"] += 1
        if opcode == "DEPBAR" and modifiers == ".LE" and operands.replace(" ", "") == "SB0,0x0":
            counts["wait all"] += 1
    return dict(counts)


def _mix(cubin: bytes) -> dict[str, int]:
    return sass_mix(_cuobjdump(cubin, "-sass"))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """`cuobjdump flag` of `cubin` (the tool ships with Triton)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run(
            [str(tool), flag, file.name], capture_output=True, text=True, check=True
        ).stdout


def _usage(cubin: bytes) -> dict[str, int]:
    out = _cuobjdump(cubin, "-res-usage")
    fields = {name: int(value) for name, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", out)}
    # a thread's local memory: its stack frame (where registers spill) and the rest, the
    # figure the driver gives a loaded kernel (Triton's `n_spills`)
    spilled = fields.get("STACK", 0) + fields.get("LOCAL", 0)
    return {"registers": fields.get("REG", 0), "spilled": spilled}


def compile_launch(launch: Launch, usage: bool = False, mix: bool = False) -> Compiled:
    """`launch` compiled to a cubin for TARGET: an error where it does not compile or its
    shared memory does not fit an sm_90 block; with `usage`, its resources too; with `mix`,
    its instructions by opcode."""
    if launch.error:
        return Compiled(launch.error)
    import triton
    from triton.compiler import ASTSource

    try:
        source = ASTSource(
            _kernel(launch), dict(launch.signature), dict(launch.constexprs), dict(launch.attrs)
        )
        kernel = triton.compile(source, target=_target(), options=dict(launch.options))
    except Exception as exc:
        return Compiled(f"{type(exc).__name__}: {exc}")
    shared = kernel.metadata.shared
    error = ""
    if shared > MAX_SHARED:  # the launch would fail: out of resources
        error = f"needs {shared} bytes of shared memory; sm_90 has {MAX_SHARED}"
    found = _usage(kernel.asm["cubin"]) if usage else {}
    return Compiled(error, shared=shared, mix=_mix(kernel.asm["cubin"]) if mix else {}, **found)


def compile_all(
    launches: list[Launch], workers: int, usage: bool = False, mix: bool = False
) -> list[Compiled]:
    """Each launch compiled (`compile_launch`), in `workers` processes without the
    interpreter (TRITON_INTERPRET is taken out of this process's environment for them)."""
    os.environ.pop("TRITON_INTERPRET", None)
    # spawned, not forked: a caller that recorded in the interpreter has its kernels
    # imported as interpreted functions, which the compiler cannot read
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        work = partial(compile_launch, usage=usage, mix=mix)
        return list(pool.map(work, launches, chunksize=4))


def print_usage(launches: list[Launch], compiled: list[Compiled]) -> None:
    """A table of each launch's resources, by kernel."""
    print("\n| kernel | constexprs | warps | stages | registers | spilled B | shared B |")
    print("|---|---|---|---|---|---|---|")
    rows = sorted(zip(launches, compiled, strict=True), key=lambda lc: lc[0].describe())
    for launch, result in rows:
        options = dict(launch.options)
        print(
            f"| {launch.name} | {launch.values(str)} | {options.get('num_warps')} | "
            f"{options.get('num_stages')} | {result.registers} | {result.spilled} | "
            f"{result.shared} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the suite recorded its launches")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--usage",
        action="store_true",
        help="also print each launch's registers, spilled bytes and shared memory",
    )
    args = parser.parse_args(argv)
    launches = load(args.directory)
    if not launches:
        print(f"no launches recorded in {args.directory}", file=sys.stderr)
        return 1
    launches += with_pdl(launches)
    compiled = compile_all(launches, args.workers, usage=args.usage)
    failures = [(launch, c.error) for launch, c in zip(launches, compiled, strict=True) if c.error]
    if args.usage:
        print_usage(launches, compiled)
    kernels = len({(launch.module, launch.name) for launch in launches})
    counts = f"{len(launches)} launches of {kernels} kernels"
    print(f"{counts} compiled for sm_{TARGET[1]}: {len(failures)} failed")
    for launch, error in failures:
        print(f"\n{launch.describe()}:\n  " + "\n  ".join(error.strip().splitlines()[-40:]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
