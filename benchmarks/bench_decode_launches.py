"""The decode and verify attention's launch policies (`decode_policy`) against the launches
they do not choose: three studies, one a call.

    python3 benchmarks/bench_decode_launches.py --split-grid       # split counts, 46 shapes
    python3 benchmarks/bench_decode_launches.py --verify-configs   # verify launches by wave
    python3 benchmarks/bench_decode_launches.py --short [--shapes 16x1024,32x1024] [--top 8]

Shapes and timing as bench_attention.py's (`attention_problems.py`): group 4, head_dim 128,
bf16, slots in random order, each launch one problem's share of a CUDA-graph replay of enough
independent copies (>= 256 MB of KV in all) to keep L2 cold.

- `--split-grid`: decode at a grid of shapes (B 1-256, L 1024-16384, 2 / 8 / 32 kv heads),
  timed at every split count in SPLIT_COUNTS: per shape the best count and its fraction of
  the copy ceiling against `choose_num_splits`' count, then one `split-grid` JSON line a
  shape (for fitting the policy).
- `--verify-configs`: verify (12-node trees) at VERIFY's and VERIFY_MORE's shapes with each
  `VERIFY_CONFIGS` launch, captured once and timed in turns (`turns_time_us`), beside the
  one `choose_verify_config` takes.
- `--short`: decode at the short contexts where the engine's launch reads under 0.85 of the
  copy ceiling (`bench_attention.py --short`): every launch of SPLITS x LAUNCHES (settings
  laid over the engine's, `decode_policy.decode_launch`) captured once and all timed in turns
  beside the engine's own; a table a shape: the fastest `--top` launches and the engine's,
  each with its time, its fraction of the copy ceiling and its time over the engine's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any

import torch
from attention_problems import (  # benchmarks/, beside this script
    GROUP,
    HKV,
    VERIFY,
    D,
    Problem,
    captured,
    ceiling_fraction,
    copy_ceiling_gbs,
    decode_like_problem,
    graph_time_us,
    kv_bytes,
    ours_decode,
    pass_bytes,
    turns_time_us,
)

from engine.backends import decode_policy
from engine.backends.decode_policy import choose_num_splits

# --verify-configs also times these verify shapes: from 64 programs (one request, 8 splits) to
# several waves
VERIFY_MORE = [(1, 1024), (1, 8192), (4, 2048), (16, 1024), (32, 1024)]

SPLITS = (1, 2, 4, 8)  # --short
# Over the engine's settings (DECODE_CONFIG, `choose_decode_warps`' warps, the merge fused
# up to 16 splits): more warps, more key blocks in flight, other key blocks, the merge apart.
LAUNCHES: list[dict[str, Any]] = [
    {},
    {"num_warps": 4},
    {"num_stages": 4},
    {"num_warps": 4, "num_stages": 4},
    {"num_warps": 4, "num_stages": 5},
    {"num_warps": 8, "num_stages": 4},
    {"BLOCK_N": 32, "num_stages": 4},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 6},
    {"BLOCK_N": 128, "num_stages": 2},
    {"FUSED_MERGE": False},
]


def shape_table(batch: int, length: int, ceiling: float, top: int) -> None:
    """The launches at one shape, timed in turns: the fastest `top` and the engine's."""
    p, _, _, nbytes = decode_like_problem("decode", batch, length)
    engine_splits = p.metas[0].extra["num_splits"]
    runs = {"engine": captured(ours_decode(p))}
    for splits in SPLITS:
        for launch in LAUNCHES:
            runs[f"{splits} splits, {launch}"] = captured(ours_decode(p, launch, splits=splits))
    times = turns_time_us(runs)
    frac = functools.partial(ceiling_fraction, nbytes, ceiling_gbs=ceiling)
    engine = times["engine"]
    print(f"\nB={batch} L={length} ({nbytes / 1e6:.0f} MB; the engine: {engine_splits} splits)")
    print("| launch | us | frac of the ceiling | over the engine's |")
    print("|---|---|---|---|")
    ranked = sorted(times, key=lambda name: times[name])
    for name in [*ranked[:top], *(["engine"] if "engine" not in ranked[:top] else [])]:
        us = times[name]
        print(f"| {name} | {us:.1f} | {frac(us):.2f} | {us / engine:.2f} |", flush=True)
    del p, runs
    torch.cuda.empty_cache()


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
                kv = kv_bytes(batch, length - 1, 1, kv_heads)
                if kv > SPLIT_GRID_MAX_BYTES:
                    continue
                q_heads = GROUP * kv_heads
                p = Problem("decode", batch, length - 1, 1, kv, kv_heads, D, q_heads)
                nbytes = pass_bytes(batch, length - 1, 1, kv_heads, q_heads)
                times = {}
                for splits in SPLIT_COUNTS:
                    times[splits] = graph_time_us(ours_decode(p, splits=splits))
                policy = choose_num_splits(batch, kv_heads, length, sms)
                if policy not in times:
                    times[policy] = graph_time_us(ours_decode(p, splits=policy))
                best = min(times, key=times.__getitem__)
                frac = functools.partial(ceiling_fraction, nbytes, ceiling_gbs=ceiling)
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
        frac = functools.partial(ceiling_fraction, nbytes, ceiling_gbs=ceiling)
        cells = [f"{times[n]:.1f} ({frac(times[n]):.2f})" for n in names]
        print(
            f"| B={batch} L={length} | {programs} | {chosen['BLOCK_N']} keys | "
            + " | ".join(cells)
            + f" | {times[str(chosen)] / min(times.values()):.2f} |",
            flush=True,
        )
        del p
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study = parser.add_mutually_exclusive_group(required=True)
    study.add_argument(
        "--split-grid",
        action="store_true",
        help="decode at a grid of shapes, timed at every split count against the policy",
    )
    study.add_argument(
        "--verify-configs",
        action="store_true",
        help="verify, timed in turns with each VERIFY_CONFIGS launch beside the policy's",
    )
    study.add_argument(
        "--short",
        action="store_true",
        help="decode at short contexts: split counts by settings, timed in turns",
    )
    parser.add_argument("--shapes", default="16x1024,16x2048,32x1024", help="--short: BxL,...")
    parser.add_argument("--top", type=int, default=8, help="--short: launches a table shows")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes takes BxL pairs, e.g. 16x1024,32x1024; got {args.shapes!r}")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        parser.error(f"--shapes takes BxL pairs of positive numbers; got {args.shapes!r}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device to time the decode kernels; torch sees none")
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs()
    print(f"copy ceiling {ceiling:.0f} GB/s ({torch.cuda.get_device_name()})")
    if args.split_grid:
        split_grid(ceiling)
    elif args.verify_configs:
        verify_configs_table(ceiling)
    else:
        for batch, length in shapes:
            shape_table(batch, length, ceiling, args.top)


if __name__ == "__main__":
    main()
