"""The block kernel and the paged attention kernel built with AddressSanitizer and UBSan and
run over random shapes (`blockq_sanitized.cpp`, `attention_sanitized.cpp`): no read or write
outside their arrays, results as a float64 reference. The CPU kernels' counterpart of the GPU
suite's compute-sanitizer run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from engine import cpu_kernels

HERE = Path(__file__).parent


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(
    ("harness", "kernel"),
    [("blockq_sanitized.cpp", "blockq.cpp"), ("attention_sanitized.cpp", "attention.cpp")],
)
def test_kernel_is_clean_under_address_sanitizer(harness, kernel, tmp_path):
    compiler = cpu_kernels.cxx()  # available kernels were built by it
    binary = tmp_path / harness.removesuffix(".cpp")
    flags = [f for f in cpu_kernels.build_flags(compiler) if f not in ("-O3", "-shared", "-fPIC")]
    source = cpu_kernels.SOURCES[0].parent / kernel
    # ASan does not see tile loads and stores: tile_check.h checks each (blockq.cpp only)
    checks = (
        ["-include", str(HERE / "tile_check.h")]
        if kernel == "blockq.cpp" and ("-mamx-tile" in flags)
        else []
    )
    # the harness, then the kernel with the checks force-included (they apply to it alone)
    build = subprocess.run(
        [
            compiler,
            "-O1",
            "-g",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            *flags,
            f"-I{source.parent}",
            str(HERE / harness),
            *checks,
            str(source),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if build.returncode != 0:
        probe = subprocess.run(
            [
                compiler,
                "-fsanitize=address,undefined",
                "-x",
                "c++",
                "-",
                "-o",
                str(tmp_path / "probe"),
            ],
            input="int main() {}",
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            pytest.skip(f"{compiler} cannot build with sanitizers: {probe.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run(
        [str(binary)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"},
        timeout=300,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert run.stdout.strip().endswith("fails 0")
    if checks and "amx 1" in run.stdout:  # the tile path ran, and its accesses were checked
        assert int(run.stdout.split("tile accesses checked ")[1].split()[0]) > 0


@pytest.mark.cpu_kernels
def test_kernels_build_without_the_amx_path(tmp_path, monkeypatch):
    """Where the compiler takes no AMX flags (a made-up flag stands in for them here), the
    library builds without the AMX path, and blockq_amx says 0 whatever is asked."""
    monkeypatch.setattr(cpu_kernels, "AMX_FLAGS", ("-mno-such-amx-flag",))
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    cpu_kernels.build_flags.cache_clear()
    cpu_kernels._build.cache_clear()
    try:
        assert cpu_kernels.build_flags(cpu_kernels.cxx()) == cpu_kernels.FLAGS
        assert cpu_kernels.status().available, cpu_kernels.status().reason
        assert str(tmp_path) in cpu_kernels.status().reason
        assert cpu_kernels.library().blockq_amx(1) == 0 and cpu_kernels.amx() is False
    finally:  # the next caller loads the session's library again
        cpu_kernels.build_flags.cache_clear()
        cpu_kernels._build.cache_clear()
