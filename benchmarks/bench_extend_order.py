"""The extend kernel's grid in each order of its axes, at more shapes than bench_attention.py's.

    python3 benchmarks/bench_extend_order.py

The grid's axes are q blocks (q), requests (r) and q heads (h), the fastest-varying first
(`EXTEND_CONFIG["GRID_ORDER"]`; q blocks always run from the longest). Each shape is timed
as bench_attention.py times it (a CUDA graph of independent copies, >= 256 MB of KV, slots in
random order, 32 q / 8 kv heads, head_dim 128, bf16), in all six orders one after the other,
and printed against "qrh" (the order of several requests), with the order `grid_order`
chooses for the shape.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_problems import Problem, graph_time_us, kv_bytes, ours_extend  # noqa: E402

from engine.backends import extend_policy  # noqa: E402

SHAPES = [  # (requests, cached prefix, new tokens a request)
    (1, 0, 1024),
    (1, 0, 4096),
    (1, 2048, 512),
    (1, 4096, 1024),
    (2, 0, 2048),
    (4, 0, 1024),
    (4, 0, 2048),
    (8, 0, 512),
    (8, 0, 1024),
    (16, 0, 512),
    (8, 2048, 512),
]
ORDERS = ["".join(axes) for axes in itertools.permutations(extend_policy.GRID_AXES)]
BEFORE = "qrh"  # the baseline: the order of several requests


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
    print(f"{torch.cuda.get_device_name()}; us, and / {BEFORE!r}")
    print("\n| shape | " + " | ".join(ORDERS) + " | chosen | chosen / qrh |")
    print("|---|" + "---|" * (len(ORDERS) + 2))
    for batch, prefix, new in SHAPES:
        problem = Problem("extend", batch, prefix, new, kv_bytes(batch, prefix, new))
        times = {o: graph_time_us(ours_extend(problem, {"GRID_ORDER": o})) for o in ORDERS}
        cells = [f"{times[o]:.1f} ({times[o] / times[BEFORE]:.2f})" for o in ORDERS]
        chosen = extend_policy.grid_order(batch)
        ratio = times[chosen] / times[BEFORE]
        print(
            f"| B={batch} prefix={prefix} new={new} | "
            + " | ".join(cells)
            + f" | {chosen} | {ratio:.2f} |"
        )
        del problem
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
