"""The CPU kernels (`engine/csrc/*.cpp`, AVX-512 + OpenMP), built on first use and loaded
with ctypes.

The sources are compiled by the system C++ compiler (`$CXX`, else g++) into one shared
library in a cache folder (`ENGINE_CACHE_DIR`, default `~/.cache/engine`), named by a hash of
the sources and flags, so a changed source is rebuilt and concurrent builders leave one whole
file. The library links the process's libgomp (torch's, one thread pool); callers pass
`torch.get_num_threads()` with every call, because an OpenMP thread count set in one thread
does not reach another (the engine may run in a thread of its own). Where the CPU has no
AVX-512 or there is no compiler, `status()` says why and the callers keep their torch paths.

`ThreadGovernor` chooses that count pass by pass from the CPUs the process may use less the
CPU time others take on them: OpenMP threads spin at their barriers (libgomp's default), so
one thread too many, descheduled behind a busy neighbour, stalls every barrier of the pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in ("blockq.cpp", "attention.cpp", "ops.cpp", "layer.cpp")
)
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("simd.h", "kernels.h"))
# -ffp-contract=off: a*b + c*d is rounded as written (as torch rounds it), never fused
FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mfma",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
# the block kernel's AMX path: built where the compiler knows these (GCC 11+; build_flags
# probes), used where the CPU and the OS allow it; without them the library has no AMX path
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
_P, _I = ctypes.c_void_p, ctypes.c_int64
# one kernel's argument types a line or two, as in its C signature
# fmt: off
SIGNATURES = {  # name -> argument types; each kernel takes a thread count last
    "blockq_linear": (_P, _I, _P, _P, _I),
    "blockq_amx": (_I,),  # a setting, not a kernel
    "cpu_paged_attention": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I,
                            ctypes.c_float, _P, _I),
    "cpu_rms_norm": (_P, _P, _P, _I, _I, ctypes.c_float, _P, _P, _I),
    "cpu_rope_qkv_store": (_P, _I, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I),
    "cpu_silu_mul": (_P, _I, _I, _P, _I),
    "cpu_decoder_layer": (_P, _P, _I, _P, ctypes.c_float, _P, ctypes.c_float, _P, _P, _P, _I,
                          _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_float,
                          _P, _P, _P, ctypes.c_float, _P, _P, _I),
}
# fmt: on


RETURNS = {"blockq_amx": ctypes.c_int64}  # the rest return nothing


@dataclass(frozen=True)
class KernelStatus:
    available: bool
    reason: str  # where the library came from, or why there is none


def cache_dir() -> Path:
    return Path(os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine")


def cxx() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++ or c++ on PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@functools.cache
def build_flags(compiler: str) -> tuple[str, ...]:
    """FLAGS, with AMX_FLAGS where the compiler takes them (an empty file built with them)."""
    probe = subprocess.run(
        [compiler, *AMX_FLAGS, "-x", "c++", "-fsyntax-only", "-"],
        input="",
        capture_output=True,
        text=True,
        check=False,
    )
    return (*FLAGS, *AMX_FLAGS) if probe.returncode == 0 else FLAGS


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, KernelStatus]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return None, KernelStatus(False, f"this CPU has no AVX-512 (torch reports {capability})")
    compiler = cxx()
    if compiler is None:
        return None, KernelStatus(False, "no C++ compiler (g++ or $CXX) on PATH")
    digest = hashlib.sha256(" ".join((compiler, *FLAGS, *AMX_FLAGS)).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    target = cache_dir() / f"engine-cpu-{digest.hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                result = subprocess.run(
                    [compiler, *build_flags(compiler), *map(str, SOURCES), "-o", str(built)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if result.returncode != 0:
                    return None, KernelStatus(
                        False, f"{compiler} failed on engine/csrc: {result.stderr.strip()[-500:]}"
                    )
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
        for name, argtypes in SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = RETURNS.get(name), list(argtypes)
    except (OSError, AttributeError) as error:  # unwritable cache, a damaged library file
        return None, KernelStatus(False, f"cannot build or load {target}: {error}")
    return lib, KernelStatus(True, f"built into {target}")


def status() -> KernelStatus:
    return _build()[1]


def usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype run on the CPU kernels (fp32 CPU, and the
    library built); the one test every caller makes."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and status().available


def library() -> ctypes.CDLL:
    lib, built = _build()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not available: {built.reason}")
    return lib


def amx(want: bool | None = None) -> bool:
    """Whether the block kernel multiplies on the AMX tile unit (else AVX-512 FMAs); `want`
    chooses (True only where the CPU and the OS allow it). The default is AMX where allowed,
    unless ENGINE_CPU_AMX is 0, false, off or no. The setting is the process's: a change
    reaches every engine's next pass. Both paths are fp32-accurate and each gives a row the
    same result in any batch, but they differ from each other in the last bits: choose
    before a model runs, not between its passes."""
    return bool(library().blockq_amx(-1 if want is None else int(want)))


def threads_for(requested: int, cpus: int, others: float) -> int:
    """The thread count a pass should use: `requested` (torch's count), at most the `cpus`
    the process may run on, less the CPUs that `others` (CPU seconds per second that other
    processes, and this process's other Python threads, took on them) keep busy, rounded
    (half a CPU taken counts as one); at least 1. Spinning OpenMP threads share a CPU badly:
    on 2 CPUs with one busy neighbour, 2 threads decode at a tenth of 1 thread's speed."""
    return max(1, min(requested, cpus - int(others + 0.5)))


def _busy_seconds(cpus: set[int]) -> float:
    """CPU seconds spent on `cpus` since boot, idle and iowait aside (steal counted: a
    hypervisor's other guest takes the CPU as a neighbour would)."""
    total = 0
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if not line.startswith(b"cpu"):
                break
            name, *fields = line.split()
            if name != b"cpu" and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                total += user + nice + system + irq + softirq + steal
    return total / os.sysconf("SC_CLK_TCK")


def _own_compute_seconds() -> float:
    """CPU seconds of this process, less its Python threads other than the caller's: the
    caller's thread and the native threads (the OpenMP pool) that run its passes. A server's
    HTTP thread is one of the others. The others' clocks are read first: another thread
    that runs between the reads (the interpreter may hand it the GIL there) adds to the
    caller's time, never takes from it."""
    others = 0.0
    me = threading.get_ident()
    for thread in threading.enumerate():
        if thread.ident is not None and thread.ident != me:
            try:
                others += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, ProcessLookupError):  # it ended in the meantime
                pass
    return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID) - others


@dataclass
class _Sample:
    at: float  # monotonic seconds
    busy: float  # _busy_seconds of the CPUs
    own: float  # _own_compute_seconds
    cpus: frozenset[int]


class ThreadGovernor:
    """The thread count for the caller's next CPU pass, from the load of the last
    `interval` seconds or more: `threads()` around each step sets torch's count (which the
    kernels are passed) to `threads_for(torch's count, CPUs of the affinity mask, others'
    CPU use on them)`, and back afterwards. Sampling costs a read of /proc/stat once an
    interval; the first step (no sample yet) takes the affinity mask alone; where there is no
    /proc/stat or affinity mask (not Linux) it keeps torch's count. Use it from one thread
    (the engine's)."""

    def __init__(
        self,
        interval: float = 0.25,
        *,
        clock: Callable[[], float] = time.monotonic,
        busy: Callable[[set[int]], float] = _busy_seconds,
        own: Callable[[], float] = _own_compute_seconds,
        affinity: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
    ) -> None:
        self.interval = interval
        self._clock, self._busy, self._own, self._affinity = clock, busy, own, affinity
        self._sample: _Sample | None = None
        self.others = 0.0  # CPUs' worth that others took in the last window
        self.blind = False  # no /proc/stat or affinity mask here (not Linux): torch's count
        try:
            self.cpus = len(self._affinity())
        except (AttributeError, OSError):
            self.blind, self.cpus = True, os.cpu_count() or 1

    def _take(self) -> _Sample:
        cpus = frozenset(self._affinity())
        return _Sample(self._clock(), self._busy(set(cpus)), self._own(), cpus)

    def choose(self, requested: int) -> int:
        """The count for the next pass (sampling the load when an interval has passed)."""
        if self.blind:
            return requested
        now = self._clock()
        try:
            if self._sample is None:
                self._sample = self._take()
                self.cpus = len(self._sample.cpus)
                return threads_for(requested, self.cpus, self.others)
            if now - self._sample.at < self.interval:
                return threads_for(requested, self.cpus, self.others)
            last, self._sample = self._sample, self._take()
        except (AttributeError, OSError, ValueError):
            self.blind = True
            return requested
        if last.cpus == self._sample.cpus:  # else the counters measured other CPUs
            elapsed = self._sample.at - last.at
            taken = (self._sample.busy - last.busy) - (self._sample.own - last.own)
            self.others = max(0.0, taken / elapsed)
        self.cpus = len(self._sample.cpus)
        return threads_for(requested, self.cpus, self.others)

    @contextlib.contextmanager
    def threads(self) -> Iterator[int]:
        """torch's thread count (the kernels' too) set to `choose(torch's count)` within."""
        requested = torch.get_num_threads()
        chosen = self.choose(requested)
        if chosen == requested:
            yield chosen
            return
        torch.set_num_threads(chosen)
        try:
            yield chosen
        finally:
            torch.set_num_threads(requested)
