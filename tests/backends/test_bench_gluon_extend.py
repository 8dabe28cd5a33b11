"""benchmarks/bench_gluon_extend.py and its Gluon prefill kernel (benchmarks/gluon_prefill.py):
each variant compiled for sm_90 without a GPU (no spills, and ptxas keeps its matrix products
asynchronous), the script's refusals and its SASS reading, and on a Hopper GPU each variant's
output against SDPA's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


def _compile(name: str) -> dict:
    """The script's `--sass-one` (`sm90_report`), run without the CPU interpreter (the
    suite's processes have it on, which turns a Gluon kernel into an interpreted function)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gluon_extend.py"
    done = subprocess.run(
        [sys.executable, str(script), "--sass-one", name],
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
    assert found["waits"], "no key step with its product in flight past the scores' wait"


SASS = """
        /*1200*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR12], RZ, !UPT ;
        /*1210*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1220*/                   MUFU.EX2 R23, R16 ;
        /*1230*/                   FFMA R93, R93, UR45, -R158 ;
        /*1240*/                   MUFU.EX2 R10, R10 ;
        /*1250*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1260*/                   MUFU.EX2 R12, R12 ;
        /*1270*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1280*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1290*/                   MUFU.EX2 R14, R14 ;
        /*12a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_product_waits_count_the_softmax_between_the_two_waits(bench_script) -> None:
    """Exponentials after a scores' wait and before the product's wait that follows, a count
    per scores' wait; those after the product's wait, and a product's wait with no scores'
    wait before it, count for none."""
    assert bench_script("bench_gluon_extend").product_waits(SASS) == [2, 0]


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
    gluon_prefill = bench_script("gluon_prefill")
    assert gluon_prefill.turn_regs(2, 168) == gluon_prefill.turn_regs(3, 168) == 240
    # 168 x 384 = 2 x 240 x 128 + 24 x 128
    assert gluon_prefill.turn_regs(2, 224) == 256
    assert gluon_prefill.turn_regs(1, 128) == gluon_prefill.turn_regs(0, None) == 0
    with pytest.raises(ValueError, match="need maxnreg"):
        gluon_prefill.turn_regs(2, None)
    for name, (_, _, _, _, ws, maxnreg) in gluon_prefill.VARIANTS.items():
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
