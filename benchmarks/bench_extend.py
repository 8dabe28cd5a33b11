"""The extend attention's launch configurations against SDPA's flash kernel.

    python3 benchmarks/bench_extend.py --grid     # every configuration of EXTEND_GRID
    python3 benchmarks/bench_extend.py --turns    # the policy's launch and EXTEND_TURNS', in turns

Shapes and timing as bench_attention.py's (`attention_problems.py`): 32 q / 8 kv heads,
head_dim 128, bf16, slots in random order, each time one problem's share of a CUDA-graph replay
of enough independent copies of it (>= 256 MB of KV in all) to keep L2 cold. `--grid` times
each configuration of EXTEND_GRID (tiles, warps, pipeline depth, tensor-memory loads) at the
extend shapes (EXTEND), the median of 20 replays each, and prints its time over the best at
each shape and their geometric mean. `--turns` captures SDPA, the policy's launch ("default")
and EXTEND_TURNS' configurations once each and times them in turns (`turns_time_us`), at
EXTEND's shapes and EXTEND_MORE's: us, then SDPA's time over each one's.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from attention_problems import (  # benchmarks/, beside this script
    EXTEND,
    Problem,
    captured,
    extend_rows,
    kv_bytes,
    ours_extend,
    sdpa,
    turns_time_us,
)

# --turns: the policy's extend launch ("default": `choose_extend_config` over EXTEND_CONFIG)
# and these, with SDPA, timed in turns at EXTEND's shapes and EXTEND_MORE's (shorter prompts,
# more of them). Here EXTEND_CONFIG alone, with the diagonal blocks in a loop of their own
# (its earlier default), the short prompts' launch at every shape, and 128 x 128 tiles of 8
# warps in 3 stages (the fastest at one prompt of 4096 tokens in --grid, before the diagonal
# joined the loop). Earlier lists (2 and 4 stages, 64 x 32 tiles, 128 x 64 tiles, 128 x 128
# in 2 stages, other HEADS launches, tiles shorter than their key blocks, the grid in bands
# of q blocks, persistent programs, exponentials shared with the FMA pipes) are timed in
# docs/benchmarks.md.
EXTEND_MORE = [(4, 0, 2048), (16, 0, 512)]
EXTEND_TURNS: list[dict[str, Any]] = [
    {},
    {"DIAGONAL_IN_LOOP": False},
    {"BLOCK_M": 32, "BLOCK_N": 32, "HEADS": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
]

EXTEND_GRID = [  # --grid: tiles, warps, pipeline depth, tensor-memory loads
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st, "TMA": tma}
    for m in (64, 128)
    for n in (32, 64, 128)
    if m % n == 0
    for w in (4, 8)
    for st in (2, 3, 4)
    for tma in (False, True)
]


def extend_grid() -> None:
    """Every extend configuration of `EXTEND_GRID` at each extend shape, against SDPA flash:
    per configuration its time over the best at each shape, and its geometric mean."""
    rows = extend_rows(EXTEND_GRID)
    names = [n for n in rows[0]["times"] if all(n in r["times"] for r in rows)]
    print("\n| configuration | " + " | ".join(r["shape"] for r in rows) + " | geomean / best |")
    print("|---|" + "---|" * (len(rows) + 1))
    scored = []
    for name in names:
        ratios = [r["times"][name] / min(r["times"].values()) for r in rows]
        scored.append((math.prod(ratios) ** (1 / len(ratios)), name))
    for geomean, name in sorted(scored):
        cells = [
            f"{r['times'][name]:.1f} us ({r['sdpa_us'] / r['times'][name]:.2f} of SDPA)"
            if r.get("sdpa_us")
            else f"{r['times'][name]:.1f} us"
            for r in rows
        ]
        print(f"| {name} | " + " | ".join(cells) + f" | {geomean:.3f} |")


def extend_turns_table() -> None:
    """The default extend configuration and EXTEND_TURNS' against SDPA's flash kernel, each
    captured once and timed in turns (`turns_time_us`), at EXTEND's and EXTEND_MORE's
    shapes: us, then each one's speed as a fraction of SDPA's."""
    names = ["default"] + [str(c) for c in EXTEND_TURNS]
    print("\nextend, timed in turns: us (SDPA's time over ours)")
    print("| shape | SDPA us | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 2))
    for batch, prefix, new in EXTEND + EXTEND_MORE:
        p = Problem("extend", batch, prefix, new, kv_bytes(batch, prefix, new))
        runs = {"SDPA": captured(sdpa(p, "extend", prefix, new)[0])}
        runs["default"] = captured(ours_extend(p))
        runs.update({str(c): captured(ours_extend(p, c)) for c in EXTEND_TURNS})
        times = turns_time_us(runs)
        cells = [f"{times[n]:.1f} ({times['SDPA'] / times[n]:.2f})" for n in names]
        print(
            f"| B={batch} prefix={prefix} new={new} | {times['SDPA']:.1f} | "
            + " | ".join(cells)
            + " |",
            flush=True,
        )
        del p, runs
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study = parser.add_mutually_exclusive_group(required=True)
    study.add_argument(
        "--grid",
        action="store_true",
        help="every configuration of EXTEND_GRID at each extend shape, against SDPA",
    )
    study.add_argument(
        "--turns",
        action="store_true",
        help="the policy's launch and EXTEND_TURNS', with SDPA, timed in turns at EXTEND's "
        "and EXTEND_MORE's shapes",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device to time the extend kernels; torch sees none")
    torch.manual_seed(0)
    if args.grid:
        extend_grid()
    else:
        extend_turns_table()


if __name__ == "__main__":
    main()
