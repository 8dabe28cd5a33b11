"""Decode at short contexts: the split kernel's launches (split count x warps x key block x
pipeline depth) timed in turns against the one the engine takes, at the contexts where that
reads under 0.85 of the copy ceiling (`bench_attention.py --short`).

    python3 benchmarks/bench_decode_short.py [--shapes 16x1024,16x2048,32x1024] [--top 8]

Shapes and timing as bench_attention.py's (`attention_problems.py`): 32 q / 8 kv heads,
head_dim 128, bf16, slots in random order, each launch one problem's share of a CUDA-graph
replay of enough independent copies (>= 256 MB of KV in all) to keep L2 cold. Every launch
of SPLITS x LAUNCHES (settings laid over the engine's, `decode_policy.decode_launch`) is
captured once and all are timed in turns (`turns_time_us`), the engine's own launch among
them. A table a shape: the fastest `--top` launches and the engine's, each with its time,
its fraction of the copy ceiling and its time over the engine's.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from attention_problems import (  # benchmarks/, beside this script
    captured,
    copy_ceiling_gbs,
    decode_like_problem,
    ours_decode,
    turns_time_us,
)

SPLITS = (1, 2, 4, 8)
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
    frac = lambda us: nbytes / (us * 1e-6) / 1e9 / ceiling  # noqa: E731
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x1024,16x2048,32x1024", help="BxL,...")
    parser.add_argument("--top", type=int, default=8, help="launches a table shows")
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
    for batch, length in shapes:
        shape_table(batch, length, ceiling, args.top)


if __name__ == "__main__":
    main()
