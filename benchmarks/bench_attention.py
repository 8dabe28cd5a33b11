"""Attention benchmark (issue 3): copy ceiling, torch SDPA on contiguous KV, and our kernels.

Shapes: 32 q / 8 kv heads, head_dim 128, bf16. Each time is one problem's share of a CUDA-graph
replay that runs enough independent copies of it (>= 256 MB of KV in all) to keep L2 cold;
median of the replays after warm-up. "eager" is one launch timed by do_bench (L2 flushed).
Run: python3 benchmarks/bench_attention.py [--quick | --decode | --fused-merge | --pdl |
--short | --extend | --split-grid | --verify-configs]
(the extend configurations' grid and those timed in turns: benchmarks/bench_extend.py)
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from attention_problems import (  # benchmarks/, beside this script
    GROUP,
    HKV,
    HQ,
    D,
    Problem,
    attention_row,
    captured,
    copy_ceiling_gbs,
    copy_time_us,
    decode_like_problem,
    extend_rows,
    graph_time_us,
    ours_decode,
    sdpa,
    turns_time_us,
)

from engine import pdl
from engine.backends import decode_policy, triton_decode, triton_extend, triton_index, triton_merge
from engine.backends.decode_policy import choose_num_splits
from engine.backends.torch_backend import build_kv_indices
from engine.backends.triton_index import launch_kv_indices

DECODE = [(1, 8192), (16, 4096), (64, 2048), (64, 8192), (256, 1024)]
VERIFY = [(1, 4096), (48, 1024), (64, 2048)]
# --verify-configs also times these verify shapes: from 64 programs (one request, 8 splits) to
# several waves
VERIFY_MORE = [(1, 1024), (1, 8192), (4, 2048), (16, 1024), (32, 1024)]
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
            frac = lambda us: nbytes / (us * 1e-6) / 1e9 / ceiling  # noqa: E731
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
    how much of a short call's shortfall a copy of its size shares."""
    print(f"\nshort contexts (copy ceiling {ceiling:.0f} GB/s; frac: of that ceiling)")
    print(
        "| shape | splits | ours us | ours frac | SDPA us | SDPA frac | same-bytes copy us | "
        "copy frac | ours / copy | SDPA / copy | ours / SDPA |"
    )
    print("|" + "---|" * 11)
    for batch, length in SHORT:
        p, prefix, new, nbytes = decode_like_problem("decode", batch, length)
        ours = graph_time_us(ours_decode(p))
        theirs = graph_time_us(sdpa(p, "decode", prefix, new)[0])
        copy = copy_time_us(nbytes)
        frac = lambda us: nbytes / (us * 1e-6) / 1e9 / ceiling  # noqa: E731
        print(
            f"| B={batch} L={length} | {p.metas[0].extra['num_splits']} | {ours:.1f} | "
            f"{frac(ours):.2f} | {theirs:.1f} | {frac(theirs):.2f} | {copy:.1f} | "
            f"{frac(copy):.2f} | {ours / copy:.2f} | {theirs / copy:.2f} | "
            f"{ours / theirs:.2f} |",
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
            frac = lambda us: nbytes / (us * 1e-6) / 1e9 / ceiling  # noqa: E731
            print(
                f"| {mode} | B={batch} L={length} | {p.metas[0].extra['num_splits']} | "
                f"{times[0]:.1f} | "
                + " | ".join(f"{frac(t):.2f}" for t in times)
                + f" | {min(times) / times[0]:.2f} |",
                flush=True,
            )
            del p
            torch.cuda.empty_cache()


def verify_configs_table(ceiling: float) -> None:
    """Verify at VERIFY's and VERIFY_MORE's shapes with each `VERIFY_CONFIGS` launch, each
    captured once and timed in turns (`turns_time_us`), beside the one the policy chooses
    (`choose_verify_config`): us, then the fraction of the copy ceiling."""
    configs = [config for config, _ in decode_policy.VERIFY_CONFIGS]
    names = [str(config) for config in configs]
    print(f"\nverify launches in turns: us (fraction of the copy ceiling, {ceiling:.0f} GB/s)")
    print("| shape | programs | policy's | " + " | ".join(names) + " | policy / best |")
    print("|" + "---|" * (len(names) + 4))
    for batch, length in VERIFY + VERIFY_MORE:
        p, _, _, nbytes = decode_like_problem("verify", batch, length)
        programs = batch * HKV * p.metas[0].extra["num_splits"]
        sms, rows = decode_policy.num_sms(p.q[0].device), p.q[0].shape[0]
        chosen = decode_policy.choose_verify_config(programs, sms, rows)
        times = turns_time_us(
            {n: captured(ours_decode(p, c)) for n, c in zip(names, configs, strict=True)}
        )
        frac = lambda us: nbytes / (us * 1e-6) / 1e9 / ceiling  # noqa: E731
        cells = [f"{times[n]:.1f} ({frac(times[n]):.2f})" for n in names]
        print(
            f"| B={batch} L={length} | {programs} | {chosen['BLOCK_N']} keys | "
            + " | ".join(cells)
            + f" | {times[str(chosen)] / min(times.values()):.2f} |",
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


SPLIT_GRID_BATCHES = (1, 4, 16, 64, 256)
SPLIT_GRID_LENGTHS = (1024, 2048, 4096, 8192, 16384)
SPLIT_GRID_HEADS = {
    8: None,
    2: ((1, 4, 16, 64), (1024, 4096, 16384)),
    32: ((1, 4, 16), (1024, 4096, 16384)),
}
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
SPLIT_GRID_MAX_BYTES = 20 << 30


def split_grid(ceiling: float) -> None:
    """Decode at a grid of shapes (group 4, head_dim 128, bf16), timed at every split count
    in SPLIT_COUNTS: per shape the best count and its fraction of the copy ceiling, against
    the engine's choice (`choose_num_splits`). One `split-grid` JSON line per shape follows
    the table (for fitting the policy)."""
    import json

    sms = decode_policy.num_sms(torch.device("cuda"))
    print(f"\nsplit grid: {sms} SMs, copy ceiling {ceiling:.0f} GB/s")
    print(
        "| B | L | Hkv | " + " | ".join(f"s={s} us" for s in SPLIT_COUNTS) + " | best | "
        "best frac | policy | policy frac | policy/best time |"
    )
    print("|" + "---|" * (len(SPLIT_COUNTS) + 8))
    records: list[dict[str, Any]] = []
    for kv_heads, subset in SPLIT_GRID_HEADS.items():
        batches, lengths = subset or (SPLIT_GRID_BATCHES, SPLIT_GRID_LENGTHS)
        for batch in batches:
            for length in lengths:
                kv_bytes = batch * length * kv_heads * D * 2 * 2
                if kv_bytes > SPLIT_GRID_MAX_BYTES:
                    continue
                q_heads = GROUP * kv_heads
                p = Problem("decode", batch, length - 1, 1, kv_bytes, kv_heads, D, q_heads)
                nbytes = kv_bytes + 2 * batch * q_heads * D * 2
                times = {}
                for splits in SPLIT_COUNTS:
                    times[splits] = graph_time_us(ours_decode(p, splits=splits))
                policy = choose_num_splits(batch, kv_heads, length, sms)
                if policy not in times:
                    times[policy] = graph_time_us(ours_decode(p, splits=policy))
                best = min(times, key=times.__getitem__)
                frac = lambda us: nbytes / (us * 1e-6) / 1e9 / ceiling  # noqa: E731
                cells = " | ".join(f"{times[s]:.1f}" for s in SPLIT_COUNTS)
                print(
                    f"| {batch} | {length} | {kv_heads} | {cells} | {best} | "
                    f"{frac(times[best]):.2f} | {policy} | {frac(times[policy]):.2f} | "
                    f"{times[policy] / times[best]:.2f} |",
                    flush=True,
                )
                records.append(
                    dict(
                        batch=batch,
                        length=length,
                        kv_heads=kv_heads,
                        bytes=nbytes,
                        times={str(k): v for k, v in times.items()},
                        best=best,
                        policy=policy,
                    )
                )
                del p
                torch.cuda.empty_cache()
    ratios = [r["times"][str(r["policy"])] / r["times"][str(r["best"])] for r in records]
    print(
        f"policy/best time over {len(ratios)} shapes: geomean "
        f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, worst {max(ratios):.2f}"
    )
    for record in records:
        print("split-grid " + json.dumps(record))


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
        "--split-grid",
        action="store_true",
        help="only decode at a grid of shapes, timed at every split count against the policy",
    )
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
    parser.add_argument(
        "--verify-configs",
        action="store_true",
        help="only verify, timed in turns with each VERIFY_CONFIGS launch beside the policy's",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs()
    if args.split_grid:
        split_grid(ceiling)
        return
    if args.verify_configs:
        verify_configs_table(ceiling)
        return
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
