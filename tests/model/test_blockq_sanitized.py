"""The block kernel and the paged attention kernel built with AddressSanitizer and UBSan and
run over random shapes (`blockq_sanitized.cpp`, `attention_sanitized.cpp`): no read or write
outside their arrays, results as a float64 reference. The CPU kernels' counterpart of the GPU
suite's compute-sanitizer run."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from engine import cpu_kernels

HERE = Path(__file__).parent


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(("harness", "kernel"), [("blockq_sanitized.cpp", "blockq.cpp"),
                                                 ("attention_sanitized.cpp", "attention.cpp")])
def test_kernel_is_clean_under_address_sanitizer(harness, kernel, tmp_path):
    compiler = cpu_kernels.cxx()  # available kernels were built by it
    binary = tmp_path / harness.removesuffix(".cpp")
    flags = [f for f in (*cpu_kernels.FLAGS, *cpu_kernels.AMX_FLAGS)
             if f not in ("-O3", "-shared", "-fPIC")]
    source = cpu_kernels.SOURCES[0].parent / kernel
    build = subprocess.run(
        [compiler, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         *flags, f"-I{source.parent}", str(HERE / harness), str(source), "-o", str(binary)],
        capture_output=True, text=True, check=False)
    if build.returncode != 0:
        probe = subprocess.run([compiler, "-fsanitize=address,undefined", "-x", "c++", "-",
                                "-o", str(tmp_path / "probe")], input="int main() {}",
                               capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            pytest.skip(f"{compiler} cannot build with sanitizers: {probe.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, check=False,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert run.stdout.strip().endswith("fails 0")


@pytest.mark.cpu_kernels
def test_kernels_build_without_the_amx_path(tmp_path):
    """A compiler without -mamx-tile still builds the library (cpu_kernels retries without
    the AMX flags), and blockq_amx then says 0."""
    library = tmp_path / "without_amx.so"
    build = subprocess.run([cpu_kernels.cxx(), *cpu_kernels.FLAGS,
                            *map(str, cpu_kernels.SOURCES), "-o", str(library)],
                           capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    lib = ctypes.CDLL(str(library))
    lib.blockq_amx.restype, lib.blockq_amx.argtypes = ctypes.c_int64, [ctypes.c_int64]
    assert lib.blockq_amx(1) == 0 and lib.blockq_amx(-1) == 0
