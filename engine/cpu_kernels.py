"""The CPU kernels (`engine/csrc/*.cpp`, AVX-512 + OpenMP), built on first use and loaded
with ctypes.

The sources are compiled by the system C++ compiler (`$CXX`, else g++) into one shared
library in a cache folder (`ENGINE_CACHE_DIR`, default `~/.cache/engine`), named by a hash of
the sources and flags, so a changed source is rebuilt and concurrent builders leave one whole
file. The library links the process's libgomp (torch's, one thread pool); callers pass
`torch.get_num_threads()` with every call, because an OpenMP thread count set in one thread
does not reach another (the engine may run in a thread of its own). Where the CPU has no
AVX-512 or there is no compiler, `status()` says why and the callers keep their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
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
SIGNATURES = {  # name -> argument types; each kernel takes a thread count last
    "blockq_linear": (_P, _I, _P, _P, _I),
    "blockq_amx": (_I,),  # a setting, not a kernel
    "cpu_paged_attention": (
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        ctypes.c_float,
        _P,
        _I,
    ),
    "cpu_rms_norm": (_P, _P, _P, _I, _I, ctypes.c_float, _P, _P, _I),
    "cpu_rope_qkv_store": (_P, _I, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I),
    "cpu_silu_mul": (_P, _I, _I, _P, _I),
    "cpu_decoder_layer": (
        _P,
        _P,
        _I,
        _P,
        ctypes.c_float,
        _P,
        ctypes.c_float,
        _P,
        _P,
        _P,
        _I,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
        ctypes.c_float,
        _P,
        _P,
        _I,
    ),
}


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
