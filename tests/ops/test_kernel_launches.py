"""tests/kernel_launches.py: launches recorded in the interpreter compile for sm_90 on this
machine, and a launch the compiler refuses is reported with its kernel and the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kernel_launches
import pytest
import torch
import triton
import triton.language as tl
from kernel_launches import Recorder

from engine import pdl
from engine.ops import gemv, gemv_policy

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records the interpreter's launches"
)

SCRIPT = Path(__file__).parents[1] / "kernel_launches.py"


@triton.jit
def _flag_kernel(out, FLAG: tl.constexpr):
    if FLAG:  # the compiler takes a bool or an int here, the interpreter anything
        tl.store(out, 1.0)


def _compile(directory: Path, *options: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(directory), "--workers", "1", *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_the_all_rows_launches_compile_for_hopper(tmp_path):
    """The all-rows kernel plain and with the norm and SiLU*mul: it once branched on a
    string constexpr (DOT=""), which the interpreter ran and the compiler refused."""
    x = torch.randn(13, 64)
    weight = torch.randn(48, 64)
    with Recorder() as recorder:
        gemv.gemv(x, weight, gemv_policy.rows_config(48, 2))
        config = gemv_policy.rows_config(24, 2, silu_mul=True)
        gemv.norm_gemv_silu(x, None, torch.ones(64), 1e-5, weight, config)
    assert len(recorder.launches) == 2
    recorder.save(tmp_path / "main.pickle")
    result = _compile(tmp_path, "--usage")
    assert result.returncode == 0, result.stdout + result.stderr
    # and the first in each PDL mode (top, late, exit)
    assert "5 launches of 1 kernels compiled for sm_90: 0 failed" in result.stdout
    # --usage: registers, spilled bytes and shared memory, as the device reports them
    rows = [line for line in result.stdout.splitlines() if line.startswith("| gemv_rows_kernel")]
    assert len(rows) == 5
    for row in rows:
        registers, spilled, shared = (int(cell) for cell in row.strip("| ").split(" | ")[-3:])
        assert 0 < registers <= 255 and spilled == 0 and 0 < shared <= 232448


def test_a_launch_the_compiler_refuses_is_named_with_its_reason(tmp_path):
    out = torch.zeros(1)
    with Recorder() as recorder:
        _flag_kernel[(1,)](out, FLAG=True)
        _flag_kernel[(1,)](out, FLAG="on")  # runs in the interpreter
        _flag_kernel[(1,)](out, FLAG=True, NUM_WARPS=4)  # a keyword no parameter takes
    assert out.item() == 1.0
    recorder.save(tmp_path / "main.pickle")
    result = _compile(tmp_path)
    assert result.returncode == 1
    assert "3 launches of 1 kernels compiled for sm_90: 2 failed" in result.stdout  # no PDL
    assert "_flag_kernel(FLAG='on')" in result.stdout
    assert "`if` conditionals can only accept values of type" in result.stdout
    assert "Keyword argument NUM_WARPS was specified but unrecognised" in result.stdout


def test_a_launch_past_the_shared_memory_of_an_sm_90_block_is_named(tmp_path):
    """A tile the compiler takes but no sm_90 block can hold: 8 key steps in flight of 64 x
    512 float32 weights (a launch would fail for resources)."""
    x = torch.randn(2, 64)
    with Recorder() as recorder:
        gemv.gemv(
            x, torch.randn(64, 64), dict(gemv_policy.rows_config(64, 2), BLOCK_N=64, BLOCK_K=512)
        )
    recorder.save(tmp_path / "main.pickle")
    result = _compile(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bytes of shared memory; sm_90 has 232448" in result.stdout


def test_the_matrix_launches_with_pdl_and_their_prefetch_compile(tmp_path, monkeypatch):
    """With PDL the matrix kernels prefetch their weights into L2 before their wait
    (PREFETCH_K > 0), a path the interpreter cannot run: recorded without running, as a
    Hopper GPU would launch them (the default model's shapes: one row, with the norm, and
    13 rows with the norm and SiLU*mul after)."""
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    x, one = torch.randn(13, 576), torch.randn(1, 576)
    norm = torch.ones(576)
    with Recorder(execute=False) as recorder, pdl.using("top"):
        gemv.gemv(one, torch.randn(960, 576), gemv_policy.GEMV_CONFIG)
        gemv.norm_gemv(one, None, norm, 1e-5, torch.randn(960, 576), gemv_policy.GEMV_CONFIG)
        config = gemv_policy.rows_config(1536, 132, silu_mul=True)
        gemv.norm_gemv_silu(x, None, norm, 1e-5, torch.randn(3072, 576), config)
    launches = list(recorder.launches.values())
    assert len(launches) == 3
    for launch in launches:
        constexprs = {launch.signature[p[0]][0]: v for p, v in launch.constexprs}
        assert constexprs["PDL"] == 1 and constexprs["PREFETCH_K"] > 0
        assert dict(launch.options)["launch_pdl"]
    recorder.save(tmp_path / "main.pickle")
    result = _compile(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_usage_counts_the_registers_a_launch_spills(tmp_path):
    """A launch held to 40 registers (the compiler option `maxnreg`) spills its 13 rows'
    sums to the stack, which `--usage` counts as the device does."""
    with Recorder() as recorder:
        config = dict(gemv_policy.rows_config(960, 132), maxnreg=40)
        gemv.gemv(torch.randn(13, 576), torch.randn(960, 576), config)
    recorder.save(tmp_path / "main.pickle")
    result = _compile(tmp_path, "--usage")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| gemv_rows_kernel")]
    assert rows
    for row in rows:
        registers, spilled, _ = (int(cell) for cell in row.strip("| ").split(" | ")[-3:])
        assert registers == 40 and spilled > 0


def test_an_empty_record_fails(tmp_path):
    result = _compile(tmp_path)
    assert result.returncode == 1
    assert "no launches recorded" in result.stderr


def test_a_recorder_inside_another_keeps_its_launches_from_it():
    out = torch.zeros(1)
    with Recorder() as outer:
        with Recorder() as inner:
            _flag_kernel[(1,)](out, FLAG="on")
        _flag_kernel[(1,)](out, FLAG=True)
    assert [launch.constexprs for launch in inner.launches.values()] == [(((1,), "on"),)]
    assert [launch.constexprs for launch in outer.launches.values()] == [(((1,), True),)]


def test_one_launch_a_kernel_is_added_in_each_pdl_mode():
    x = torch.randn(13, 64)
    with Recorder() as recorder:
        gemv.gemv(x, torch.randn(48, 64), gemv_policy.rows_config(48, 2))
        gemv.gemv(x, torch.randn(48, 64), dict(gemv_policy.rows_config(48, 2), LOOP_STAGES=1))
        _flag_kernel[(1,)](torch.zeros(1), FLAG=True)  # no PDL parameter
    launches = list(recorder.launches.values())
    variants = kernel_launches.with_pdl(launches)
    pdl_index = [name for name, _ in launches[0].signature].index("PDL")
    assert [dict(v.constexprs)[(pdl_index,)] for v in variants] == [1, 2, 3]
    assert all(dict(v.options)["launch_pdl"] for v in variants)
    assert not dict(launches[0].options)["launch_pdl"]
    for variant in variants:  # the first launch of the kernel but for its PDL
        assert variant.name == "gemv_rows_kernel"
        assert dict(variant.constexprs) | {(pdl_index,): 0} == dict(launches[0].constexprs)


def test_kernel_usage_counts_the_programs_an_sm_holds(bench_script):
    """`benchmarks/kernel_usage.py`'s occupancy: the verify configurations' compiler reports
    as `decode_policy.VERIFY_CONFIGS` reads them (148 registers and 49 KB -> 3 programs an
    SM; 218 registers and 83 KB -> 2), and each limit on its own."""
    kernel_usage = bench_script("kernel_usage")

    assert kernel_usage.per_sm(148, 49280, 4) == (3, 4, 3)
    assert kernel_usage.per_sm(218, 82944, 4) == (2, 2, 2)
    assert kernel_usage.per_sm(32, 0, 32) == (2, 228, 2)  # warps: 64 an SM
    assert kernel_usage.per_sm(255, 0, 4)[0] == 2  # 256 a thread, allocated 8 at a time


def test_the_engines_launches_hold_what_their_policies_assume(monkeypatch, bench_script):
    """The attention kernels at the engine's GPU configurations and the all-rows matrix
    kernel at a verify pass's launches, compiled for sm_90 (`benchmarks/kernel_usage.py`):
    none spills to local memory; each verify configuration holds the programs an SM that
    `VERIFY_CONFIGS` sizes its waves by; a decode program, at either warp count
    `choose_decode_warps` gives, leaves room for the PROGRAMS_PER_SM the split policy
    streams with. A kernel change that costs registers or shared memory past these fails
    here rather than as a slower pass on a device."""
    from engine.backends import decode_policy, triton_extend

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # compile_all takes it out; back after
    monkeypatch.setattr(triton_extend, "tma_ready", triton_extend.tma_ready)  # kernel_usage's
    kernel_usage = bench_script("kernel_usage")

    # as `choose_decode_warps` gives them: 2 warps at one wave of split programs (the merge
    # fused), 4 beyond it, where the split policy no longer splits
    one_wave = dict(decode_policy.DECODE_CONFIG, num_warps=decode_policy.ONE_WAVE_WARPS)
    beyond = dict(decode_policy.DECODE_CONFIG)  # 4 warps (the grid here is one wave)
    decode = [("decode, split, merge fused", one_wave), ("decode, one split", beyond)]
    verify = [(f"verify, {c['BLOCK_N']} keys", c) for c, _ in decode_policy.VERIFY_CONFIGS]
    labelled = [
        *kernel_usage.attention("decode", kernel_launches, decode[:1], splits=4),
        *kernel_usage.attention("decode", kernel_launches, decode[1:], splits=1),
        *kernel_usage.attention("verify", kernel_launches, verify),
        *kernel_usage.attention("extend", kernel_launches, [("extend", {})]),
        *kernel_usage.rows(kernel_launches),
    ]
    compiled = kernel_launches.compile_all([launch for _, launch in labelled], 2, usage=True)
    held = {}
    for (label, launch), result in zip(labelled, compiled, strict=True):
        assert not result.error, f"{label}: {result.error}"
        assert result.spilled == 0, f"{label} spills {result.spilled} bytes a thread"
        warps = dict(launch.options)["num_warps"]
        held[label] = kernel_usage.per_sm(result.registers, result.shared, warps)[2]
    for (_, programs), (label, _) in zip(decode_policy.VERIFY_CONFIGS, verify, strict=True):
        assert held[label] == programs, (label, held[label], programs)
    for label, _ in decode:
        assert held[label] >= decode_policy.PROGRAMS_PER_SM, (label, held[label])


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*10c0*/                   DEPBAR.LE SB0, 0xc ;                   /* 0x000083000000791a */
        /*10d0*/                   DEPBAR.LE SB0, 0x0 ;                   /* 0x000080000000791a */
        /*1170*/                   FFMA R10, R27, R29.reuse, R10 ;        /* 0x0000001d1b0a7223 */
        /*1180*/                   FFMA R11, R26, R29, R11 ;              /* 0x0000001d1a0b7223 */
        /*1190*/                   SHFL.BFLY PT, R27, R16, 0x10, 0x1f ;   /* 0x0e001f0010177f89 */
        /*1790*/              @!P3 BRA 0x10c0 ;                           /* 0xfffffff80048b947 */
        /*17a0*/               @P0 LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R4.64] ;
        /*4bb0*/              @!P0 EXIT ;                                 /* 0x000000000000894d */
"""


def test_sass_mix_counts_instructions_by_opcode():
    """`sass_mix` counts `cuobjdump -sass` lines by opcode (modifiers and predicates
    dropped), all of them, and the waits for every outstanding copy (DEPBAR.LE SB0, 0x0;
    not a wait that leaves some in flight)."""
    mix = kernel_launches.sass_mix(SASS)
    assert mix["all"] == 9
    assert (mix["FFMA"], mix["SHFL"], mix["DEPBAR"], mix["LDGSTS"]) == (2, 1, 2, 1)
    assert (mix["BRA"], mix["EXIT"], mix["LDC"]) == (1, 1, 1)
    assert mix["wait all"] == 1
