"""Causal prefill written in Gluon (`gluon_prefill.py`) on Hopper, beside SDPA's flash kernel
and the package's extend kernel: whether what Triton's pipeliner does not do closes the extend
gap (docs/benchmarks.md, "ncu_attention.py").

    python3 benchmarks/bench_gluon_extend.py                  # check, then time in turns
    python3 benchmarks/bench_gluon_extend.py --check          # against float32 SDPA only
    python3 benchmarks/bench_gluon_extend.py --shapes 4x2048,8x1024
    python3 benchmarks/bench_gluon_extend.py --only "64 x 64, 3 slots;64 x 64, 3 slots, WS"
    python3 benchmarks/bench_gluon_extend.py --sass  # compiled for sm_90, no GPU needed

Each variant of `gluon_prefill.VARIANTS` is checked against float32 SDPA on ragged requests,
then timed. Shapes and timing as bench_extend.py's `--turns` (`attention_problems.py`): SDPA,
the package's policy launch and each variant captured once and timed in turns; each cell is
us (SDPA's time over it; the variant's relative error against SDPA's output). `--sass`
compiles each variant for sm_90 on any machine (run without TRITON_INTERPRET) and prints its
registers, spills and shared memory, whether ptxas serializes its products, and how many of
a block's exponentials the SASS places between the wait for its scores and the wait for its
values' product (the softmax that overlaps the product; `product_waits`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
import triton
from gluon_prefill import (  # benchmarks/, beside this script
    VARIANTS,
    prefill,
    prefill_kernel,
    shared_layout,
    turn_regs,
    warpgroups,
)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4, 2048), (8, 1024), (16, 512), (1, 4096), (1, 1024)]  # (requests, new tokens)
MAX_ERR = 1e-2  # relative error against float32 SDPA past which a variant is wrong
CHECK_LENGTHS = ([1024], [130, 257, 64, 1], [700, 2048], [63, 65, 129, 200])


def sm90_report(variant: tuple) -> dict:
    """`variant`'s launch at 32 q / 8 kv heads compiled for sm_90 without a GPU (in a process
    without TRITON_INTERPRET, under which a Gluon kernel is interpreted): its registers and
    spilled bytes a thread, shared memory, ptxas's report of its PTX (`-v`: C7514 where it
    serializes the products) and `product_waits` of its SASS."""
    sys.path.insert(0, str(ROOT / "tests"))
    import kernel_launches
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    block_m, block_n, stages, warps, ws, maxnreg = variant

    def desc(rows: int) -> str:
        return f"tensordesc<bf16[{rows}, 128],{shared_layout([rows, 128])}>"

    names = prefill_kernel.arg_names  # the kernel's parameters, in order
    values = {
        "GROUP": 4,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD_DIM": 128,
        "STAGES": stages,
        "WS": ws,
        "REGS": turn_regs(ws, maxnreg),
        "num_warps": warps,
    }
    types = [desc(block_m // warpgroups(ws)), desc(block_n), desc(block_n), "*bf16", "*i32"]
    types += ["fp32", "i32", "i32"] + ["constexpr"] * len(values)
    constexprs = {(names.index(name),): value for name, value in values.items()}
    source = GluonASTSource(prefill_kernel, dict(zip(names, types, strict=True)), constexprs, {})
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(source, target=kernel_launches._target(), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    sass = kernel_launches._cuobjdump(kernel.asm["cubin"], "-sass")
    return {
        **kernel_launches._usage(kernel.asm["cubin"]),
        "shared": kernel.metadata.shared,
        "ptxas": done.stdout + done.stderr,
        "waits": product_waits(sass),
    }


def product_waits(sass: str) -> list[int]:
    """For each wait for a block's scores in `sass` (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: the
    values' product still in flight), the exponentials (`MUFU.EX2`) before the wait for that
    product (`WARPGROUP.DEPBAR.LE gsb0, 0x0`): the softmax that runs beside the product."""
    counts: list[int] = []
    between = None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            between = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and between is not None:
            counts.append(between)
            between = None
        elif "MUFU.EX2" in line and between is not None:
            between += 1
    return counts


def sass_table(variants: dict) -> None:
    """`sm90_report` of each variant, a row each, each compiled in a process without
    TRITON_INTERPRET (under it this module's kernel is an interpreted function)."""
    print("| variant | registers | spilled bytes | shared KB | products serialized | "
          "exponentials a block | between the two waits |")  # fmt: skip
    print("|" + "---|" * 7)
    for name, (block_m, block_n, _, warps, ws, _) in variants.items():
        done = subprocess.run(
            [sys.executable, __file__, "--sass-one", name], capture_output=True, text=True,
            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, check=True,
        )  # fmt: skip
        found = json.loads(done.stdout.splitlines()[-1])
        # a compute thread's, of a block: a warpgroup's rows (all, without two) by the block
        per_block = block_m // warpgroups(ws) * block_n // (32 * warps)
        print(
            f"| {name} | {found['registers']} | {found['spilled']} | "
            f"{found['shared'] / 1024:.0f} | {'C7514' in found['ptxas']} | {per_block} | "
            f"{', '.join(map(str, found['waits']))} |",
            flush=True,
        )


def check(variants: dict) -> list[tuple[list[int], str, float]]:
    """Each variant against float32 SDPA on ragged requests (32 q / 8 kv heads): (lengths,
    variant, relative error) for each."""
    from attention_problems import rel_err  # benchmarks/, beside this script

    torch.manual_seed(0)
    hq, hkv, d = 32, 8, 128
    results = []
    for lens in CHECK_LENGTHS:
        offsets = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
        tokens = int(offsets[-1])
        q = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        ref = torch.empty(tokens, hq, d, device="cuda")
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            qh, kh, vh = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
            ref[a:b] = F.scaled_dot_product_attention(
                qh, kh.repeat_interleave(hq // hkv, 0), vh.repeat_interleave(hq // hkv, 0),
                is_causal=True,
            ).transpose(0, 1)  # fmt: skip
        for name, variant in variants.items():
            out = torch.full_like(q, float("nan"))
            prefill(q, k, v, out, offsets, max(lens), d**-0.5, variant)
            err = rel_err(out, ref)
            results.append((lens, name, err))
    return results


def timing(variants: dict, shapes: list[tuple[int, int]]) -> None:
    from attention_problems import (  # benchmarks/, beside this script
        SCALE,
        Problem,
        captured,
        kv_bytes,
        ours_extend,
        rel_err,
        sdpa,
        turns_time_us,
    )

    print("| shape | SDPA us | package | " + " | ".join(variants) + " |")
    print("|" + "---|" * (len(variants) + 3))
    for batch, new in shapes:
        p = Problem("extend", batch, 0, new, kv_bytes(batch, 0, new))
        fns, ref = sdpa(p, "extend", 0, new)
        runs = {"SDPA": captured(fns), "package": captured(ours_extend(p))}
        errs = {}
        for name, variant in variants.items():
            copies = [
                lambda i=i, m=p.metas[i], cu=p.metas[i].qo_indptr.to(torch.int32): prefill(
                    p.q[i], p.k[i], p.v[i], p.out[i], cu, m.max_new_len, SCALE, variant
                )
                for i in range(p.copies)
            ]
            copies[0]()
            errs[name] = rel_err(p.out[0], ref)
            runs[name] = captured(copies)
        times = turns_time_us(runs)
        cells = [f"{times['package']:.1f} ({times['SDPA'] / times['package']:.2f})"] + [
            f"{times[n]:.1f} ({times['SDPA'] / times[n]:.2f}; {errs[n]:.0e})" for n in variants
        ]
        print(f"| B={batch} new={new} | {times['SDPA']:.1f} | " + " | ".join(cells) + " |",
              flush=True)  # fmt: skip
        del p, runs
        torch.cuda.empty_cache()


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'4x2048,8x1024' -> [(4, 2048), (8, 1024)]; ValueError naming a malformed one."""
    shapes = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"--shapes: {item!r} is not REQUESTSxTOKENS (e.g. 4x2048)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def pick_variants(text: str) -> dict:
    """'a;b' -> VARIANTS' entries a and b; ValueError naming an unknown one."""
    names = [name.strip() for name in text.split(";") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        what = f"unknown variant(s) {unknown}" if unknown else "no variant named"
        raise ValueError(f"--only: {what}; known: {list(VARIANTS)}")
    return {name: VARIANTS[name] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only the check against SDPA")
    parser.add_argument("--shapes", help=f"REQUESTSxTOKENS,... (default: {SHAPES})")
    parser.add_argument("--only", help="variants by name, separated by ';' (default: all)")
    parser.add_argument("--sass", action="store_true", help="compiled for sm_90: no GPU needed")
    parser.add_argument("--sass-one", help=argparse.SUPPRESS)  # a variant's report, as JSON
    args = parser.parse_args()
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
        variants = pick_variants(args.only) if args.only else VARIANTS
    except ValueError as exc:
        parser.error(str(exc))
    if args.sass_one:
        print(json.dumps(sm90_report(VARIANTS[args.sass_one])))
        return
    if args.sass:
        sass_table(variants)
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        seen = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        parser.error(f"needs a Hopper GPU (sm_90: wgmma, TMA); torch sees {seen}")
    results = check(variants)
    for lens, name, err in results:
        print(f"{lens} {name}: {err:.2e}{'' if err < MAX_ERR else ' WRONG'}", flush=True)
    wrong = {name for _, name, err in results if not err < MAX_ERR}
    if wrong:
        print(f"not timed (wrong output): {', '.join(sorted(wrong))}", flush=True)
    right = {name: v for name, v in variants.items() if name not in wrong}
    if not args.check and right:
        timing(right, shapes)
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
