"""benchmarks/bench_gluon_extend.py: its Gluon prefill kernel compiled for sm_90 without a GPU
(every variant: no spills, and ptxas keeps its matrix products asynchronous), its refusals,
and on a Hopper GPU its output against SDPA's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


# Run without the CPU interpreter (the suite's processes have it on, which turns a Gluon
# kernel into an interpreted function): the variant's launch at 32 q / 8 kv heads compiled
# for sm_90, printed as JSON (its resources and ptxas's report of its PTX).
COMPILE = """
import json, subprocess, sys, tempfile
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root / "benchmarks"), str(root / "tests")]
import bench_gluon_extend as bench
import kernel_launches
import triton
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource

block_m, block_n, stages, warps, ws, maxnreg = bench.VARIANTS[sys.argv[2]]

def desc(rows):
    return f"tensordesc<bf16[{rows}, 128],{bench.shared_layout([rows, 128])}>"

names = ["q_desc", "k_desc", "v_desc", "out", "qo_indptr", "sm_scale_log2", "stride_ot",
         "stride_oh", "GROUP", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "STAGES", "WS", "REGS",
         "num_warps"]
q_rows = block_m // bench.warpgroups(ws)
types = [desc(q_rows), desc(block_n), desc(block_n), "*bf16", "*i32", "fp32", "i32", "i32"]
signature = dict(zip(names, types + ["constexpr"] * 8))
values = (4, block_m, block_n, 128, stages, ws, bench.turn_regs(ws, maxnreg), warps)
constexprs = {(8 + i,): value for i, value in enumerate(values)}
options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
kernel = triton.compile(GluonASTSource(bench.prefill_kernel, signature, constexprs, {}),
                        target=kernel_launches._target(), options=options)
with tempfile.TemporaryDirectory() as tmp:
    ptx = Path(tmp) / "kernel.ptx"
    ptx.write_text(kernel.asm["ptx"])
    done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o",
                           str(Path(tmp) / "kernel.o")], capture_output=True, text=True)
print(json.dumps({**kernel_launches._usage(kernel.asm["cubin"]),
                  "shared": kernel.metadata.shared, "ptxas": done.stdout + done.stderr}))
"""


def _compile(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(root), name],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", ["64 x 64, 3 slots", "64 x 64, 3 slots, WS",
                                  "128 x 64, 2 slots, 8 warps, WS",
                                  "128 x 64, 3 slots, 2 warpgroups in turn",
                                  "128 x 64, 3 slots, 2 warpgroups"])  # fmt: skip
def test_variant_compiles_for_sm90_with_products_in_flight(name) -> None:
    """Each variant compiles for sm_90 without spills, within an SM's shared memory, and
    ptxas does not serialize its wgmma products (which it does where a register copy reads a
    product still in flight: the overlap would be lost)."""
    import kernel_launches

    found = _compile(name)
    assert found["spilled"] == 0, found
    assert found["shared"] <= kernel_launches.MAX_SHARED
    assert "ptxas info" in found["ptxas"]
    assert "serialized" not in found["ptxas"], found["ptxas"]


def test_shapes_are_refused_by_name(bench_script) -> None:
    gluon_bench = bench_script("bench_gluon_extend")
    assert gluon_bench.parse_shapes("4x2048,1x1024") == [(4, 2048), (1, 1024)]
    for bad in ("4x", "4x2048x2", "0x512", "ax1"):
        with pytest.raises(ValueError, match=f"{bad!r} is not REQUESTSxTOKENS"):
            gluon_bench.parse_shapes(bad)


def test_variants_are_picked_by_name(bench_script) -> None:
    gluon_bench = bench_script("bench_gluon_extend")
    first, second = list(gluon_bench.VARIANTS)[:2]
    assert list(gluon_bench.pick_variants(f"{second}; {first}")) == [second, first]
    for bad in ("64 x 64", f"{first};nope"):
        with pytest.raises(ValueError, match="--only: unknown variant"):
            gluon_bench.pick_variants(bad)
    with pytest.raises(ValueError, match="--only: no variant named"):
        gluon_bench.pick_variants(";")


def test_two_warpgroups_in_turn_share_the_ctas_registers(bench_script) -> None:
    """Two compute warpgroups and the load warp's group (12 warps at maxnreg each at launch):
    the load group keeps 24 registers a thread and the compute groups split the rest, no
    more than the 256 a thread may have; the variants without turns take none."""
    gluon_bench = bench_script("bench_gluon_extend")
    assert gluon_bench.turn_regs(2, 168) == gluon_bench.turn_regs(3, 168) == 240
    # 168 x 384 = 2 x 240 x 128 + 24 x 128
    assert gluon_bench.turn_regs(2, 224) == 256
    assert gluon_bench.turn_regs(1, 128) == gluon_bench.turn_regs(0, None) == 0
    with pytest.raises(ValueError, match="need maxnreg"):
        gluon_bench.turn_regs(2, None)
    for name, (_, _, _, _, ws, maxnreg) in gluon_bench.VARIANTS.items():
        if ws >= 2:
            assert 12 * 32 * maxnreg <= 65536, name  # one CTA an SM can launch


def test_needs_a_hopper_gpu(bench_refusal) -> None:
    assert "needs a Hopper GPU" in bench_refusal("bench_gluon_extend", [], False)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="a Hopper GPU",
)
def test_every_variant_gives_sdpas_output(bench_script) -> None:
    """Ragged requests (one token, block edges, lengths past a tile) against float32 SDPA."""
    gluon_bench = bench_script("bench_gluon_extend")
    results = gluon_bench.check(gluon_bench.VARIANTS)
    assert len(results) == len(gluon_bench.CHECK_LENGTHS) * len(gluon_bench.VARIANTS)
    assert [r for r in results if not r[2] < gluon_bench.MAX_ERR] == [], results
