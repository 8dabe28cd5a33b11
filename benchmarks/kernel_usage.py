"""The GPU launches' resources without a GPU: each configuration compiled for sm_90 (H100,
H200), with its registers a thread, local memory a thread (spills), shared memory a program,
and the programs an SM can hold by each.

    .venv/bin/python benchmarks/kernel_usage.py [--only extend,decode,verify,rows] [--mix]

The engine's own launch functions make each launch on CPU tensors of the GPU's shapes (bf16
at Llama-3-8B's heads for attention; float32 at the default model's widths, 13 rows, for the
all-rows matrix kernel); the launches are recorded as the JIT would specialise them on a
Hopper GPU and not run (`tests/kernel_launches.py`), then compiled by Triton's compiler, and
`cuobjdump` (shipped with Triton) reads each cubin. A device reports the same figures for the
same launch (`bench_attention.py` prints them for the launches it times). An SM of sm_90 has
65536 registers (allocated 8 a thread at a time), 233472 bytes of shared memory (1024 of
them reserved a program) and 64 warps. The all-rows launches are listed with their loads
flat (the default) and in 3-d blocks (`LOAD_3D`).

`--mix` also prints each launch's SASS by kind of instruction (`kernel_launches.sass_mix`):
the instructions in its code, its multiply-adds (FFMA) and matrix instructions (HMMA, HGMMA),
shuffles, copies (LDGSTS: asynchronous, into shared memory; LDG: into registers), special
functions (MUFU: exp2, rcp), and its waits for every outstanding copy, each kernel's code as
a thread runs it once through (a loop's body counted once).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tests/kernel_launches.py, imported from tests/ as main() does
    from kernel_launches import Launch

ROOT = Path(__file__).resolve().parents[1]
SM_REGISTERS, SM_SHARED, SM_WARPS, RESERVED_SHARED = 65536, 233472, 64, 1024
KINDS = ("extend", "decode", "verify", "rows")


def per_sm(registers: int, shared: int, warps: int) -> tuple[int, int, int]:
    """Programs an SM holds by its registers, by its shared memory, and in all (warps too)."""
    by_registers = SM_REGISTERS // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = SM_SHARED // (shared + RESERVED_SHARED)
    return by_registers, by_shared, min(by_registers, by_shared, SM_WARPS // warps)


def attention_launches(kind: str) -> list[tuple[str, dict]]:
    """(label, config) for each configuration of `kind` the table shows."""
    from engine.backends import decode_policy, extend_policy

    if kind == "extend":
        tiles = [
            (f"{m} x {n}, {w} warps, {st} stages", dict(extend_policy.EXTEND_CONFIG, **c))
            for m in (64, 128)
            for n in (32, 64, 128)
            if m % n == 0
            for w in (4, 8)
            for st in (2, 3, 4)
            for c in [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, TMA=True)]
        ]
        heads = [  # HEADS q heads a program, sharing each K/V block
            (
                f"{m} x {n}, {h} heads, {w} warps, {st} stages",
                dict(extend_policy.EXTEND_CONFIG, **c),
            )
            for m, n, h in ((64, 64, 2), (32, 32, 2), (32, 32, 4), (32, 64, 2), (16, 64, 4))
            for w in (4, 8)
            for st in (2, 3)
            for c in [dict(BLOCK_M=m, BLOCK_N=n, HEADS=h, num_warps=w, num_stages=st, TMA=True)]
        ]
        diagonal_apart = [  # the diagonal key blocks in a loop of their own, after the rest
            (f"{label}, diagonal apart", dict(extend_policy.EXTEND_CONFIG, **c))
            for label, c in (
                ("64 x 64, 4 warps, 3 stages", {}),
                ("32 x 32, 2 heads, 4 warps, 3 stages", {"BLOCK_M": 32, "BLOCK_N": 32, "HEADS": 2}),
            )
            for c in [dict(c, DIAGONAL_IN_LOOP=False, TMA=True)]
        ]
        return tiles + heads + diagonal_apart
    if kind == "decode":
        grid = [
            (f"{n} keys, {w} warps, {st} stages, merge {merge}", c)
            for n in (32, 64, 128)
            for w in (2, 4)
            for st in (2, 3, 4)
            for merge in ("fused", "apart")
            for c in [dict(BLOCK_N=n, num_warps=w, num_stages=st, FUSED_MERGE=merge == "fused")]
        ]
        deeper = [  # bench_decode_launches.py --short's launches beyond the grid
            (f"{n} keys, {w} warps, {st} stages, merge fused", c)
            for n, w, st in ((64, 4, 5), (64, 8, 4), (32, 4, 6))
            for c in [dict(BLOCK_N=n, num_warps=w, num_stages=st, FUSED_MERGE=True)]
        ]
        prefetch = [  # the whole blocks loaded a block ahead (PREFETCH)
            (f"{n} keys, {w} warps, 3 stages, merge fused, prefetch", c)
            for n, w in ((32, 2), (64, 2), (64, 4))
            for c in [dict(BLOCK_N=n, num_warps=w, num_stages=3, FUSED_MERGE=True, PREFETCH=True)]
        ]
        return grid + deeper + prefetch
    return [
        (f"{c['BLOCK_N']} keys, {c['num_warps']} warps, {c['num_stages']} stages", c)
        for c, _ in decode_policy.VERIFY_CONFIGS
    ]


def _recorded(kernel_launches, launch) -> Launch:
    """The one launch of the main kernel that `launch()` makes, recorded and not run."""
    recorder = kernel_launches.Recorder(execute=False)
    with recorder:
        launch()
    main = [lc for lc in recorder.launches.values() if "merge" not in lc.name]
    assert len(main) == 1, [lc.name for lc in recorder.launches.values()]
    return main[0]


def attention(
    kind: str, kernel_launches, configs: list[tuple[str, dict]] | None = None, splits: int = 4
) -> list[tuple[str, Launch]]:
    """(label, launch) for `kind` at each of its configurations (`configs`: these instead);
    decode and verify split each request's keys `splits` ways (1: no merge)."""
    import torch

    from engine.backends import triton_decode, triton_extend, triton_merge

    q_heads, kv_heads, dim, dtype = 32, 8, 128, torch.bfloat16
    requests, context, nodes = 4, 1024, 13
    new = {"extend": 512, "decode": 1, "verify": nodes}[kind]
    tokens = requests * new
    per_request = context + (new if kind != "extend" else 0)
    k_cache = torch.zeros(requests * (context + new), kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = torch.zeros(tokens, q_heads, dim, dtype=dtype)
    k, v = (torch.zeros(tokens, kv_heads, dim, dtype=dtype) for _ in range(2))
    out = torch.zeros_like(q)
    kv_indptr = torch.arange(requests + 1, dtype=torch.int32) * per_request
    kv_indices = torch.arange(requests * per_request, dtype=torch.int32)
    qo_indptr = torch.arange(requests + 1, dtype=torch.int32) * new
    prefix_lens = torch.full((requests,), context, dtype=torch.int32)
    bits = torch.ones(tokens, dtype=torch.int64) if kind == "verify" else None
    counters = triton_merge.merge_counters(requests, kv_heads, torch.device("cpu"))
    max_q = triton_decode.triton.next_power_of_2(new)  # as the backend plans a pass
    triton_extend.tma_ready = lambda *tensors: True  # as Hopper reads these tensors

    def launch(config: dict) -> None:
        if kind == "extend":
            triton_extend.extend_attention(
                q, k, v, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, prefix_lens,
                out, new, context + new, dim**-0.5, config=config,
            )  # fmt: skip
        else:
            triton_decode.decode_attention(
                q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, prefix_lens, bits,
                out, splits, max_q, dim**-0.5, config=config, counters=counters,
            )  # fmt: skip

    return [
        (label, _recorded(kernel_launches, lambda c=config: launch(c)))
        for label, config in (attention_launches(kind) if configs is None else configs)
    ]


def rows(kernel_launches, variant: str | None = None) -> list[tuple[str, Launch]]:
    """(label, launch) for the all-rows kernel at the default model's widths, 13 float32
    rows, as a verify pass launches it (`gemv_problems.verify_launch`: `rows_config`, with the
    norm or SiLU*mul where a verify pass runs them; the output layer's `linear_config`, the
    wide launch); `variant` (a key of `gemv_problems.ROWS_VARIANTS`: flat, 3-d loads)
    overrides its LOAD_3D."""
    import torch
    from gemv_problems import ROWS_VARIANTS, SHAPES, verify_launch  # benchmarks/, beside this

    from engine.ops import gemv, gemv_policy

    extra = {} if variant is None else ROWS_VARIANTS[variant]
    labels = {
        "qkv": "norm + qkv",
        "o_proj": "o_proj",
        "gate_up": "norm + gate_up",
        "down": "down",
    }
    launches: dict[str, Callable[[], object]] = {}
    for name, label in labels.items():
        n, k = SHAPES["smollm2_135m"][name]
        model, call, _ = verify_launch(name, n, 132, torch.ones(k))
        config, x, w = dict(model, **extra), torch.zeros(13, k), torch.zeros(n, k)
        silu = " + SiLU*mul" if name == "gate_up" else ""
        launches[f"{label} {n} x {k}{silu}"] = functools.partial(call, x, w, config)
    n, k = SHAPES["smollm2_135m"]["lm_head"]  # the output layer: `gemv_policy.ROWS_WIDE_CONFIG`
    wide = gemv_policy.linear_config(13, torch.float32, (n, k), 132)
    assert wide is not None  # the wide launch (`gemv_policy.ROWS_WIDE_CONFIG`) takes it
    config = dict(wide, **extra)
    x, w = torch.zeros(13, k), torch.zeros(n, k)
    launches[f"output layer {n} x {k}"] = functools.partial(gemv.gemv, x, w, config)
    suffix = "" if variant in (None, "flat") else f", {variant}"
    return [(label + suffix, _recorded(kernel_launches, fn)) for label, fn in launches.items()]


MIX = ("all", "FFMA", "HMMA", "HGMMA", "SHFL", "LDGSTS", "LDG", "MUFU", "wait all")


def mix_table(labelled: list, compiled: list) -> str:
    """Each launch's instructions by kind (`MIX`, from `Compiled.mix`) as a table."""
    lines = [
        "| launch | instructions | FFMA | HMMA | HGMMA | SHFL | LDGSTS | LDG | MUFU | "
        "waits for all copies |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, _), result in zip(labelled, compiled, strict=True):
        cells = " | ".join(str(result.mix.get(kind, 0)) for kind in MIX)
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--mix", action="store_true", help="also the SASS by instruction kind")
    args = parser.parse_args()
    kinds = args.only.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"--only takes {', '.join(KINDS)}; got {', '.join(sorted(unknown))}")
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels as interpreted functions, to record
    sys.path.insert(0, str(ROOT / "tests"))
    import kernel_launches
    import torch
    from gemv_problems import ROWS_VARIANTS  # benchmarks/, beside this script

    torch.set_num_threads(1)
    recorded = {  # every kind before the first compile takes the interpreter away
        kind: [launch for variant in ROWS_VARIANTS for launch in rows(kernel_launches, variant)]
        if kind == "rows"
        else attention(kind, kernel_launches)
        for kind in kinds
    }
    for kind, labelled in recorded.items():
        launches = [launch for _, launch in labelled]
        compiled = kernel_launches.compile_all(launches, args.workers, usage=True, mix=args.mix)
        print(f"\n{kind}:\n")
        print("| launch | warps | registers | local B | shared B | programs an SM: "
              "by registers, by shared, in all |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for (label, launch), result in zip(labelled, compiled, strict=True):
            warps = dict(launch.options)["num_warps"]
            if result.error:
                print(f"| {label} | {warps} | {result.error} | | | |")
                continue
            counts = per_sm(result.registers, result.shared, warps)
            print(
                f"| {label} | {warps} | {result.registers} | {result.spilled} | "
                f"{result.shared} | {counts[0]}, {counts[1]}, {counts[2]} |"
            )
        if args.mix:
            print(f"\n{kind}, SASS:\n\n{mix_table(labelled, compiled)}")


if __name__ == "__main__":
    main()
