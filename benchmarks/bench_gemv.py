"""The matrix-vector kernel (engine/ops/gemv.py) against cuBLAS (F.linear), H200, bf16.

    python3 benchmarks/bench_gemv.py [--sweep]
    python3 benchmarks/bench_gemv.py --shapes smollm2_135m --dtype float32 --rows 1,13

Llama-3-8B's projection shapes (or SmolLM2-135M's) at 1, 2 and 4 rows (or `--rows`: a verify
pass of a 12-draft tree has 13). Each measurement replays a CUDA graph of calls over enough
distinct weight copies (>= 512 MB) that L2 holds none of them, as in a real decode step; the
time is one call's share, median of 10 replays. GB/s counts the weight bytes. "all rows" is the
kernel that loads each weight tile once for every row (`gemv.rows_config`).
`--sweep` also tries every launch configuration and prints the fastest per shape.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from engine.ops import gemv

SHAPES = {
    "llama3_8b": {
        "qkv": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "smollm2_135m": {
        "qkv": (960, 576),
        "o_proj": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def time_calls(call, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Seconds per call, from a graph replaying `call(x, w)` over every weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            call(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(x, w)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    return statistics.median(times[2:])


def configs(rows: int):
    """The one-row kernel's launch configurations for one row, the all-rows kernel's for more
    (its accumulator holds rows x BLOCK_N x BLOCK_K products)."""
    if rows == 1:
        space = itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3, 4))
        limit, all_rows = 16384, False
    else:
        space = itertools.product((2, 4, 8, 16), (32, 64, 128), (4, 8), (2, 3, 4))
        limit, all_rows = 1024, True
    for bn, bk, warps, stages in space:
        if bn * bk <= limit:
            yield dict(
                BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, all_rows=all_rows
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama3_8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.shapes} shapes, {args.dtype}")
    results = []
    for name, (n, k) in SHAPES[args.shapes].items():
        nbytes = n * k * dtype.itemsize
        copies = max(2, -(-512 * 2**20 // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            ref = F.linear(x, weights[0])
            err = (
                (gemv.gemv(x, weights[0]).float() - ref.float()).norm() / ref.float().norm()
            ).item()
            t_cublas = time_calls(F.linear, weights, x)
            t_ours = time_calls(gemv.gemv, weights, x)
            rows_config = gemv.rows_config(
                n, torch.cuda.get_device_properties().multi_processor_count
            )
            t_rows = time_calls(lambda a, w: gemv.gemv(a, w, rows_config), weights, x)
            best = (t_ours, "default")
            if args.sweep:
                for config in configs(rows):
                    try:
                        t = time_calls(lambda a, w, c=config: gemv.gemv(a, w, c), weights, x)
                    except Exception as exc:  # a config the compiler refuses
                        print(name, rows, config, type(exc).__name__)
                        continue
                    if t < best[0]:
                        best = (t, config)
                print(f"{name} rows={rows}: best {best[0] * 1e6:.1f} us {best[1]}", flush=True)
            results.append((name, rows, t_cublas, t_ours, t_rows, best, nbytes, err))
        del weights
        torch.cuda.empty_cache()
    print(
        "\n| shape | rows | cuBLAS us | cuBLAS GB/s | ours us | ours GB/s | ours/cuBLAS | "
        "all rows us | best swept us | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, tc, to, tr, best, nbytes, err in results:
        print(
            f"| {name} | {rows} | {tc * 1e6:.1f} | {nbytes / tc / 1e9:.0f} | {to * 1e6:.1f} | "
            f"{nbytes / to / 1e9:.0f} | {tc / to:.2f}x | {tr * 1e6:.1f} | "
            f"{best[0] * 1e6:.1f} | {err:.1e} |"
        )


if __name__ == "__main__":
    main()
