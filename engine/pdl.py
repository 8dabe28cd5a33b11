"""Programmatic dependent launch (PDL, Hopper on): a kernel launched with it may start while
the kernel before it in the stream is still running, and waits for that kernel on the device
(`gdc_wait`) instead of in the launch queue.

Every Triton kernel of the package starts with `enter(PDL)`: with PDL, wait until the kernel
before has finished and its stores are visible. Before the wait a kernel may read only what
no kernel of the stream writes: the matrix kernels prefetch their weights into L2 there
(`prefetch_l2`), beside the kernel before. When a kernel lets the next one launch is the
mode: `top` right after its wait, `late` after its main loop (`leave(PDL)`), `exit` as its
programs end. A kernel that skips `enter` must never be launched with PDL, so
`launch(device, kind)` gives the constexpr and the launch option together, and
tests/test_pdl.py checks every kernel of the package for the call and every launch for the
options.

By default (`auto`) only passes of a few rows of a small model use it, in mode `top`: a graph
pass of at most AUTO_MAX_ROWS rows whose layers' products all run in the package's matrix
kernels (one-row or all-rows; the output layer, the pass's last product, may be cuBLAS's), none
on a weight of more than AUTO_MAX_WEIGHT_ELEMENTS elements (`for_pass`); up to
AUTO_BESIDE_MAX_ROWS rows such a pass runs `top` on every launch but the products. On an H200
(`bench_steps.py --pdl off,top`, docs/benchmarks.md) `top` made the default model's decode
passes of 1, 2, 4 and 8 rows 22%, 12%, 17% and 2% faster and its verify passes of 2, 4 and 8
rows at batch 1 14-18% faster, but its passes of 13 and 16 rows 1-13% slower (the all-rows
kernel holds 16 rows there; its launches run longer after a PDL wait); every mode made a
batch-1 decode pass of random Llama-3-8B 4-9% slower, with cuBLAS's products between the
package's kernels, and `top` 20% slower with every product the package's (an H100: 6.95 against
5.79 ms; not traced: its gate_up launch of 3584 programs, 27 an SM, runs in many waves, beside
which the next kernel's programs, started early, hold places on the SMs).
`ENGINE_PDL=<setting>` sets a process's setting (`auto` or one mode for every launch),
`using(setting)` a block's (a CUDA graph keeps the launches it captured), so benchmarks
compare them in one run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LINE_BYTES = 128  # an L2 line: one prefetch each
MODES = {"off": 0, "top": 1, "late": 2, "exit": 3}  # the kernels' PDL constexpr


SETTINGS = ("auto", *MODES)  # auto: `for_pass` chooses a pass's mode, off elsewhere
AUTO_MAX_ROWS = 8  # the most rows (tokens) of a pass that `auto` runs with PDL
# Up to AUTO_BESIDE_MAX_ROWS rows `auto` runs PDL on every launch but the matrix products
# (`for_pass`): the rows of a batch-1 verify pass of the default draft budget's trees, where
# it was measured. On an H100 (`bench_steps.py --pdl top --pdl-kinds`, the default model's
# shape, fp32) that pass took 1.286 ms with PDL on every launch but the products, against
# 1.318 with PDL off and 1.319 on every launch: the all-rows products run longer after a
# PDL wait than without PDL there (docs/benchmarks.md, "A verify pass on the device's
# timeline"). Passes of 14-16 rows (the all-rows kernel's most) were not timed so and stay
# off.
AUTO_BESIDE_MAX_ROWS = 13
# `auto` runs PDL only where no layer product's weight has more than AUTO_MAX_WEIGHT_ELEMENTS
# elements (`for_pass`): the default model's largest (gate_up, 3.5M) is
# within it and gains, Llama-3-8B's gate_up (117M) past it and loses (above). Weights in
# between were not timed; the bound is the one-row kernel's limit before it took every
# weight (`gemv_policy.MAX_WEIGHT_ELEMENTS`), under which PDL was measured.
AUTO_MAX_WEIGHT_ELEMENTS = 32 * 2**20


def _setting(name: str, source: str) -> str:
    if name not in SETTINGS:
        raise ValueError(f"{source} must be one of {sorted(SETTINGS)}; got {name!r}")
    return name


# The kinds of launch (`launch(device, kind)`). ENGINE_PDL_KINDS=<kind>,... (or `only_kinds`
# in a block) runs PDL on launches of those kinds only, the others without it: a diagnostic,
# to time which launches' overlap a pass gains or loses (`bench_steps.py --pdl-kinds`).
KINDS = ("products", "attention", "merge", "ops", "index", "draw")


def _kinds(names: str, source: str) -> frozenset[str]:
    kinds = frozenset(n for n in names.split(",") if n) if names != "all" else frozenset(KINDS)
    if not kinds or not kinds <= set(KINDS):
        raise ValueError(
            f"{source} must be 'all' or kinds of {list(KINDS)} separated by commas; got {names!r}"
        )
    return kinds


_NAMED = os.environ.get("ENGINE_PDL")  # the process's setting as ENGINE_PDL names it, if it does
_state = {"setting": _setting(_NAMED or "auto", "ENGINE_PDL")}
_kinds_state = {"kinds": _kinds(os.environ.get("ENGINE_PDL_KINDS", "all"), "ENGINE_PDL_KINDS")}


@functools.cache
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def mode(device: torch.device) -> int:
    """The PDL constexpr of a launch on `device` now (0: launched without PDL, as under
    `auto` outside a pass that chose a mode). A mode ENGINE_PDL names, on a device without
    PDL, is warned of once per device."""
    on = MODES.get(_state["setting"], 0)
    if not on:
        return 0
    if _capable(device):
        return on
    if _state["setting"] == _NAMED:
        _warn_unavailable(str(device), _state["setting"])
    return 0


@functools.cache
def _warn_unavailable(device: str, setting: str) -> None:
    warnings.warn(
        f"ENGINE_PDL={setting}: programmatic dependent launch needs a CUDA device of compute "
        f"capability 9.0 or newer; launches on {device} run without it",
        RuntimeWarning,
        stacklevel=3,
    )


def for_pass(
    rows: int, package_products: bool, largest_weight: int
) -> tuple[str, frozenset[str] | None]:
    """The setting a pass of `rows` rows (tokens) runs under, and the kinds of launch it keeps
    PDL to (None: those the process keeps it to). A mode the process names holds in every
    pass. Under `auto`, where the package's matrix kernels run every product of the pass's
    layers (`package_products`: the caller knows) and none of their weights has more than
    AUTO_MAX_WEIGHT_ELEMENTS elements (`largest_weight`: the largest's): `top` on every
    launch up to AUTO_MAX_ROWS rows, `top` on every launch but the products up to
    AUTO_BESIDE_MAX_ROWS; else off."""
    if _state["setting"] != "auto":
        return _state["setting"], None
    small = largest_weight <= AUTO_MAX_WEIGHT_ELEMENTS
    if not (package_products and small) or rows > AUTO_BESIDE_MAX_ROWS:
        return "off", None
    if rows <= AUTO_MAX_ROWS:
        return "top", None
    return "top", _kinds_state["kinds"] - {"products"}


@contextlib.contextmanager
def running(choice: tuple[str, frozenset[str] | None]) -> Iterator[None]:
    """Launches in this block run as `for_pass`'s `choice` says."""
    setting, kinds = choice
    held = _kinds_state["kinds"] if kinds is None else kinds
    with using(setting), _holding(_kinds_state, "kinds", held):
        yield


def launch(device: torch.device, kind: str) -> dict:
    """A launch's keyword arguments on `device`: the kernel's PDL constexpr, and where it is
    not 0 the launch option too (the two always together). `kind` (of KINDS): without PDL
    where the kinds in use leave it out."""
    if kind not in KINDS:
        raise ValueError(f"a launch's kind must be one of {list(KINDS)}; got {kind!r}")
    on = mode(device) if kind in _kinds_state["kinds"] else 0
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": 0}


@contextlib.contextmanager
def _holding(state: dict, key: str, value: object) -> Iterator[None]:
    """`state[key]` is `value` in this block, and what it was after."""
    before = state[key]
    state[key] = value
    try:
        yield
    finally:
        state[key] = before


def only_kinds(names: str) -> contextlib.AbstractContextManager[None]:
    """Launches in this block run with PDL only where their kind is in `names` ('all', or
    kinds of KINDS separated by commas); the setting still decides whether and how."""
    return _holding(_kinds_state, "kinds", _kinds(names, "the PDL kinds"))


def using(name: str) -> contextlib.AbstractContextManager[None]:
    """Launches in this block run under PDL setting `name` (one of SETTINGS)."""
    return _holding(_state, "setting", _setting(name, "the PDL setting"))


@triton.jit
def enter(PDL: tl.constexpr):
    """With PDL, wait for the kernel before in the stream (its stores visible); mode `top`
    then lets the next one launch. Nothing that kernel writes may be read, and nothing it
    reads written, before this call."""
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()


@triton.jit
def leave(PDL: tl.constexpr):
    """Mode `late`: let the next kernel launch (after the kernel's main loop)."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the line at each of `ptrs` (a hint: nothing is loaded into registers)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
