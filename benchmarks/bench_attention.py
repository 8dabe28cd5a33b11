"""Attention benchmark (issue 3): copy ceiling, torch SDPA on contiguous KV, and our kernels.

Shapes: 32 q / 8 kv heads, head_dim 128, bf16. Each time is one problem's share of a CUDA-graph
replay that runs enough independent copies of it (>= 256 MB of KV in all) to keep L2 cold;
median of the replays after warm-up. "eager" is one launch timed by do_bench (L2 flushed).
Run: python3 benchmarks/bench_attention.py [--quick | --decode | --fused-merge | --pdl |
--short | --extend]
(the extend configurations' grid and those timed in turns: benchmarks/bench_extend.py; the
decode and verify launch policies' sweeps: benchmarks/bench_decode_launches.py)
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
from attention_problems import (  # benchmarks/, beside this script
    HQ,
    VERIFY,
    D,
    Problem,
    attention_row,
    ceiling_fraction,
    copy_ceiling_gbs,
    copy_time_us,
    decode_like_problem,
    extend_rows,
    graph_time_us,
    ours_decode,
    sdpa,
)

from engine import pdl
from engine.backends import triton_decode, triton_extend, triton_index, triton_merge
from engine.backends.torch_backend import build_kv_indices
from engine.backends.triton_index import launch_kv_indices

DECODE = [(1, 8192), (16, 4096), (64, 2048), (64, 8192), (256, 1024)]
# --fused-merge also times these decode shapes, which split 2-16 ways (B x kv heads >= 32)
FEW_SPLITS = [(4, 8192), (8, 4096), (16, 1024), (16, 2048), (32, 1024), (32, 2048)]
# --short: decode where B x kv heads >= 128 at short contexts, against SDPA and a copy of as
# many bytes
SHORT = [(16, 1024), (16, 2048), (32, 1024), (32, 2048), (64, 1024), (16, 4096)]
KV_INDEX = [(64, 2048), (256, 4096)]
# overrides of the defaults (DECODE_CONFIG, the chosen VERIFY_CONFIGS entry, EXTEND_CONFIG)
DECODE_SWEEP: list[dict[str, Any]] = [
    {"BLOCK_N": 64, "num_stages": 3},
    {"BLOCK_N": 32, "num_stages": 4},
    {"num_stages": 2},
    {"BLOCK_N": 128, "num_stages": 2},
    {"BLOCK_N": 128, "num_stages": 3},
    {"num_warps": 8},
    {"num_warps": 2},
    {"num_warps": 4},  # beside 2: the two sides of `choose_decode_warps`
    {"num_warps": 2, "num_stages": 4},
    {"num_warps": 2, "BLOCK_N": 32, "num_stages": 4},
    {"num_warps": 2, "BLOCK_N": 128, "num_stages": 2},
    # each whole block's K/V loaded before the products of the block before it (PREFETCH;
    # at 64 keys and 2 warps it spills, compiled for sm_90: 32 keys, or 4 warps)
    {"PREFETCH": True, "BLOCK_N": 32},
    {"PREFETCH": True, "BLOCK_N": 32, "num_warps": 2},
    {"PREFETCH": True, "num_warps": 4},
    {"FUSED_MERGE": False},
    {"FUSED_MERGE": True},
    {"SKIP_MERGE": True, "FUSED_MERGE": False},
]  # the last leaves the merge out: what the merge costs
EXTEND_SWEEP: list[dict[str, Any]] = [
    {"TMA": False},
    {"TMA": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True},
    # the grid's axis orders (by default `extend_policy.grid_order` chooses one)
    *({"GRID_ORDER": order} for order in ("qrh", "hqr", "hrq", "qhr", "rqh", "rhq")),
]


def decode_like_rows(mode: str, shapes: list, quick: bool) -> list:
    rows = []
    for batch, length in shapes:
        p, prefix, new, nbytes = decode_like_problem(mode, batch, length)
        keys = prefix + new
        variants = {"default": ours_decode(p)}
        if not quick:
            variants.update({f"splits x{s}": ours_decode(p, None, s) for s in (0.5, 2.0)})
            variants.update({str(c): ours_decode(p, c) for c in DECODE_SWEEP})
        flops = 4.0 * batch * new * HQ * keys * D
        rows.append(
            attention_row(
                mode, f"B={batch} L={length}", p, mode, prefix, new, nbytes, flops, variants
            )
        )
        del p
        torch.cuda.empty_cache()
    return rows


def fused_merge_table(ceiling: float) -> None:
    """Decode and verify at each of their shapes with the merge fused into the split kernel
    and as a second launch, at the plan's split count (one split: the same single launch)."""
    print(f"\nfused merge against two launches (copy ceiling {ceiling:.0f} GB/s)")
    print(
        "| kind | shape | splits | two-launch us | fused us | fused / two-launch | "
        "two-launch frac | fused frac | max abs diff |"
    )
    print("|" + "---|" * 9)
    for mode, shapes in (("decode", DECODE + FEW_SPLITS), ("verify", VERIFY)):
        for batch, length in shapes:
            p, _, _, nbytes = decode_like_problem(mode, batch, length)
            times, outs = {}, {}
            for fused in (False, True):
                fns = ours_decode(p, {"FUSED_MERGE": fused})
                times[fused] = graph_time_us(fns)
                fns[0]()
                outs[fused] = p.out[0].float().clone()
            frac = functools.partial(ceiling_fraction, nbytes, ceiling_gbs=ceiling)
            print(
                f"| {mode} | B={batch} L={length} | {p.metas[0].extra['num_splits']} | "
                f"{times[False]:.1f} | {times[True]:.1f} | {times[True] / times[False]:.2f} | "
                f"{frac(times[False]):.2f} | {frac(times[True]):.2f} | "
                f"{(outs[True] - outs[False]).abs().max().item():.1e} |",
                flush=True,
            )
            del p
            torch.cuda.empty_cache()


def short_table(ceiling: float) -> None:
    """Decode at short contexts (SHORT): ours (the plan's splits, as the engine launches it),
    SDPA on contiguous KV, and a plain copy moving the same bytes, each timed the same way:
    how much of a short call's shortfall a copy of its size shares, and the time each takes
    past the copy's (a fixed cost where it holds across sizes)."""
    print(f"\nshort contexts (copy ceiling {ceiling:.0f} GB/s; frac: of that ceiling)")
    print(
        "| shape | splits | ours us | ours frac | SDPA us | SDPA frac | same-bytes copy us | "
        "copy frac | ours / copy | SDPA / copy | ours / SDPA | ours - copy us | SDPA - copy us |"
    )
    print("|" + "---|" * 13)
    for batch, length in SHORT:
        p, prefix, new, nbytes = decode_like_problem("decode", batch, length)
        ours = graph_time_us(ours_decode(p))
        theirs = graph_time_us(sdpa(p, "decode", prefix, new)[0])
        copy = copy_time_us(nbytes)
        frac = functools.partial(ceiling_fraction, nbytes, ceiling_gbs=ceiling)
        print(
            f"| B={batch} L={length} | {p.metas[0].extra['num_splits']} | {ours:.1f} | "
            f"{frac(ours):.2f} | {theirs:.1f} | {frac(theirs):.2f} | {copy:.1f} | "
            f"{frac(copy):.2f} | {ours / copy:.2f} | {theirs / copy:.2f} | "
            f"{ours / theirs:.2f} | {ours - copy:.1f} | {theirs - copy:.1f} |",
            flush=True,
        )
        del p
        torch.cuda.empty_cache()


def pdl_table(ceiling: float) -> None:
    """Decode and verify at each of their shapes with PDL off and in each mode, at the plan's
    split count: consecutive copies overlap as consecutive kernels of a pass would."""
    print(f"\nPDL modes (fraction of the copy ceiling, {ceiling:.0f} GB/s)")
    print("| kind | shape | splits | off us | " + " | ".join(pdl.MODES) + " | best / off |")
    print("|" + "---|" * (len(pdl.MODES) + 5))
    for mode, shapes in (("decode", DECODE + FEW_SPLITS), ("verify", VERIFY)):
        for batch, length in shapes:
            p, _, _, nbytes = decode_like_problem(mode, batch, length)
            times = []
            for setting in pdl.MODES:
                with pdl.using(setting):
                    times.append(graph_time_us(ours_decode(p)))
            frac = functools.partial(ceiling_fraction, nbytes, ceiling_gbs=ceiling)
            print(
                f"| {mode} | B={batch} L={length} | {p.metas[0].extra['num_splits']} | "
                f"{times[0]:.1f} | "
                + " | ".join(f"{frac(t):.2f}" for t in times)
                + f" | {min(times) / times[0]:.2f} |",
                flush=True,
            )
            del p
            torch.cuda.empty_cache()


def kv_index_rows() -> list:
    rows = []
    for batch, length in KV_INDEX:
        p = Problem("decode", batch, length - 1, 1, batch * length * 8, kv_heads=1, head_dim=16)
        m0, rows_t = (
            p.metas[0],
            [torch.arange(c * batch, (c + 1) * batch, device="cuda") for c in range(p.copies)],
        )
        bufs = [torch.empty_like(m.kv_indices) for m in p.metas]
        ours = [
            lambda i=i: launch_kv_indices(
                p.pool.req_to_token,
                rows_t[i],
                m0.prefix_lens,
                m0.kv_indptr,
                m0.qo_indptr,
                p.metas[i].out_slots,
                bufs[i],
                bufs[i].numel(),
                length,
            )
            for i in range(p.copies)
        ]
        ref = [
            lambda i=i: build_kv_indices(
                p.pool.req_to_token,
                rows_t[i],
                m0.prefix_lens,
                m0.kv_indptr,
                m0.qo_indptr,
                p.metas[i].out_slots,
                batch * length,
            )
            for i in range(p.copies)
        ]
        row = dict(
            kind="kv-index",
            shape=f"B={batch} L={length}",
            bytes=batch * length * 8.0,
            flops=0.0,
            sdpa_us=graph_time_us(ref),
            ours_us=graph_time_us(ours),
        )
        row["best_us"], row["best_cfg"] = row["ours_us"], "default"
        row["err"] = float(not torch.equal(bufs[0], ref[0]()))
        rows.append(row)
        del p
        torch.cuda.empty_cache()
    return rows


def print_resources() -> None:
    """The compiler's resource report for every kernel variant compiled in this run."""
    kernels = (
        triton_decode._decode_split_kernel,
        triton_merge._merge_splits_kernel,
        triton_extend._extend_kernel,
        triton_index._kv_indices_kernel,
    )
    print("\ncompiled kernels: name | constexprs | warps | stages | regs | spills | shared B")
    for fn in kernels:
        for caches in fn.device_caches.values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                consts = {
                    k[0] if isinstance(k, tuple) else k: v
                    for k, v in getattr(compiled.src, "constants", {}).items()
                    if isinstance(v, (int, bool))
                }
                print(
                    f"  {fn.__name__} | {consts} | {meta.num_warps} | {meta.num_stages} | "
                    f"{compiled.n_regs} | {compiled.n_spills} | {meta.shared}"
                )


def print_table(rows: list, ceiling: float) -> None:
    print(f"\ncopy ceiling: {ceiling:.0f} GB/s (device-to-device, read + write)")
    print(
        "| kind | shape | torch us | torch GB/s | torch frac | torch TFLOP/s | ours us | "
        "ours GB/s | ours frac | ours TFLOP/s | best us (cfg) | rel err | ours eager us |"
    )
    print("|" + "---|" * 13)
    for r in rows:

        def stats(us):
            if us is None:
                return "n/a | n/a | n/a | n/a"
            gbs = r["bytes"] / (us * 1e-6) / 1e9
            return f"{us:.1f} | {gbs:.0f} | {gbs / ceiling:.2f} | {r['flops'] / us / 1e6:.1f}"

        err = f"{r['err']:.1e}" if r.get("err") is not None else "n/a"
        best = f"{r['best_us']:.1f}" if r.get("best_us") else "n/a"
        print(
            f"| {r['kind']} | {r['shape']} | {stats(r.get('sdpa_us'))} | "
            f"{stats(r.get('ours_us'))} | {best} ({r['best_cfg']}) | {err} | "
            f"{r.get('eager_us', float('nan')):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="defaults only, no sweep")
    parser.add_argument(
        "--extend",
        action="store_true",
        help="only extend: the default configuration and EXTEND_SWEEP's, against SDPA",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="only decode (DECODE and SHORT shapes): the default configuration and "
        "DECODE_SWEEP's, against SDPA",
    )
    parser.add_argument(
        "--fused-merge",
        action="store_true",
        help="only decode and verify: the merge fused into the split kernel against two launches",
    )
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="only decode and verify, with PDL off and in each mode",
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="only decode at short contexts, against SDPA and a copy of the same bytes",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs()
    if args.fused_merge:
        fused_merge_table(ceiling)
        return
    if args.pdl:
        pdl_table(ceiling)
        return
    if args.short:
        short_table(ceiling)
        return
    if args.extend:
        print_table(extend_rows(EXTEND_SWEEP), ceiling)
        return
    if args.decode:  # the short contexts too (SHORT), each with the sweep
        shapes = DECODE + [s for s in SHORT if s not in DECODE]
        print_table(decode_like_rows("decode", shapes, False), ceiling)
        return
    rows = decode_like_rows("decode", DECODE, args.quick)
    decode_at = {(b, length): r for (b, length), r in zip(DECODE, rows, strict=True)}
    verify_rows = decode_like_rows("verify", VERIFY, args.quick)
    same = decode_like_rows("decode", [s for s in VERIFY if s not in decode_at], True)
    decode_at.update(zip([s for s in VERIFY if s not in decode_at], same, strict=True))
    for shape, row in zip(VERIFY, verify_rows, strict=True):
        if row.get("ours_us") and decode_at[shape].get("ours_us"):
            row["best_cfg"] += f"; {row['ours_us'] / decode_at[shape]['ours_us']:.2f}x decode"
    rows += verify_rows + extend_rows([] if args.quick else EXTEND_SWEEP) + kv_index_rows()
    try:
        print_resources()
    except (AttributeError, KeyError, TypeError) as error:  # Triton internals move; keep going
        print(f"resource report unavailable: {error!r}")
    print_table(rows, ceiling)


if __name__ == "__main__":
    main()
