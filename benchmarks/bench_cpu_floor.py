"""The matrix products of one pass of the default model on this CPU, at 1-240 rows (decode,
batches, a verify tree, prefills): the time no scheduler can go below (fp32), and what it
allows in tokens/s; where the CPU has AMX tiles, the tiles' time over the FMAs'.

    python benchmarks/bench_cpu_floor.py [--threads N]

SmolLM2-135M's shapes (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
plus the 49152x576 lm_head), with distinct random weights per layer so they stream from
memory as in a real step. "F.linear" is MKL on dense fp32 weights (the engine's column-major
layout); "MKL packed" is MKL's pre-packed GEMM (`torch.ops.mkl._mkl_linear`), which serves only
the one row count it was packed for. "blocks" is the engine's block kernel
(`engine.ops.blockq`) on the default file's formats, Q4_1 layers and a Q8_0 lm_head: the
same fp32-accurate arithmetic on weights kept in their GGUF blocks (what the engine runs on an
AVX-512 CPU), on AVX-512 FMAs and, where the CPU has them, on AMX tiles (the engine's default
there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch
import torch.nn.functional as F
from gguf.quants import quantize

from engine import cpu_kernels
from engine.ops.blockq import BlockWeight

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def per_step(run, repeats: int = 8) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_pass(blocks: list[BlockWeight] | None, xs: dict[int, torch.Tensor], path: str) -> float:
    """One pass of products through the block kernel on one of its paths (NaN without it)."""
    if blocks is None:
        return float("nan")
    before = cpu_kernels.amx()
    try:
        cpu_kernels.amx(path == "AMX")
        return per_step(lambda: [w.linear(xs[w.shape[1]]) for w in blocks])
    finally:
        cpu_kernels.amx(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = [[torch.randn(k, n).t() for n, k in SHAPES] for _ in range(LAYERS)]  # column-major
    head = torch.randn(HIDDEN, VOCAB).t()
    weights = [w for layer in layers for w in layer] + [head]
    blocks = None
    if cpu_kernels.status().available:

        def block(weight: torch.Tensor, kind: str) -> BlockWeight:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            return BlockWeight.from_gguf(quantize(weight.contiguous().numpy() * 0.05, qtype), kind)

        blocks = [block(w, "Q4_1") for layer in layers for w in layer] + [block(head, "Q8_0")]
    paths = ["FMAs"]  # the block kernel's paths this CPU has
    if blocks is not None and cpu_kernels.amx():
        paths.append("AMX")
    rows = []
    for m in (1, 2, 4, 6, 8, 13, 64, 240):  # decode, batches, a verify tree, prefills
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        plain = per_step(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        packed_weights = [
            torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), m) for w in weights
        ]
        packed = per_step(
            lambda: [
                torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m)
                for w, p in zip(weights, packed_weights, strict=True)
            ]
        )
        del packed_weights
        in_blocks = {path: block_pass(blocks, xs, path) for path in paths}
        flops = 2 * m * sum(w.numel() for w in weights)
        rows.append((m, plain, packed, in_blocks, flops))
    weight_bytes = sum(w.numel() for w in weights) * 4
    read = torch.ones(weight_bytes // 4)  # written: untouched pages all map to one zero page
    plain_read = per_step(lambda: read.sum())  # the same bytes, streamed once
    print(
        f"\n{torch.get_num_threads()} thread(s); matrix products of one pass, "
        f"{weight_bytes / 2**20:.0f} MiB of fp32 weights; a plain read of as many bytes: "
        f"{weight_bytes / plain_read / 1e9:.0f} GB/s"
    )
    if blocks is None:
        print(f"(no block kernel: {cpu_kernels.status().reason})")
    else:
        held = sum(w.num_bytes() for w in blocks)
        print(
            f"the same weights in blocks: {held / 2**20:.0f} MiB "
            f"({weight_bytes / held:.1f}x fewer bytes)"
        )
    heads = "".join(f" blocks, {path} ms | GFLOP/s |" for path in paths)
    tails = "".join(f" max tokens/s, blocks {path} |" for path in paths)
    both = len(paths) == 2  # then the tiles' time over the FMAs' (where they start to win)
    print(
        f"| rows | F.linear ms | GFLOP/s | weights GB/s | MKL packed ms | GFLOP/s |{heads} "
        f"max tokens/s, dense |{tails}{' AMX / FMAs time |' if both else ''}"
    )
    print("|---" * (7 + 3 * len(paths) + both) + "|")
    for m, plain, packed, in_blocks, flops in rows:
        cells = "".join(
            f" {in_blocks[path] * 1e3:.1f} | {flops / in_blocks[path] / 1e9:.0f} |"
            for path in paths
        )
        tokens = "".join(f" {m / in_blocks[path]:.0f} |" for path in paths)
        print(
            f"| {m} | {plain * 1e3:.1f} | {flops / plain / 1e9:.0f} | "
            f"{weight_bytes / plain / 1e9:.0f} | {packed * 1e3:.1f} | "
            f"{flops / packed / 1e9:.0f} |{cells} {m / min(plain, packed):.0f} |{tokens}"
            + (f" {in_blocks['AMX'] / in_blocks['FMAs']:.2f} |" if both else "")
        )


if __name__ == "__main__":
    main()
