"""The block kernel built with AddressSanitizer and UBSan and run over random shapes
(`blockq_sanitized.cpp`): no read or write outside its arrays, results as a float64
reference. The CPU kernels' counterpart of the GPU suite's compute-sanitizer run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from engine import cpu_kernels

HERE = Path(__file__).parent


@pytest.mark.skipif(not cpu_kernels.status().available,
                    reason=f"CPU kernels: {cpu_kernels.status().reason}")
def test_block_kernel_is_clean_under_address_sanitizer(tmp_path):
    compiler = os.environ.get("CXX") or "g++"
    binary = tmp_path / "blockq_sanitized"
    flags = [f for f in cpu_kernels.FLAGS if f not in ("-O3", "-shared", "-fPIC")]
    build = subprocess.run(
        [compiler, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         *flags, f"-I{cpu_kernels.SOURCES[0].parent}", str(HERE / "blockq_sanitized.cpp"),
         str(cpu_kernels.SOURCES[0]), "-o", str(binary)],
        capture_output=True, text=True, check=False)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"{compiler} cannot build with sanitizers: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, check=False,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert run.stdout.strip().endswith("fails 0")
