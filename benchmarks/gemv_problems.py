"""The matrix-vector benchmarks' problems and their timing (`bench_gemv.py`,
`bench_gemv_sweeps.py`; `kernel_usage.py` compiles the verify launches): the model shapes
(SHAPES), enough distinct weight copies (>= 512 MB) that L2 holds none of them, one call's
share of a CUDA graph replaying it over every copy; the main table's row (cuBLAS, the
package's launch, the all-rows kernel, the op set) and its markdown; the all-rows launches a
verify pass makes (`verify_launch`) and their variants (ROWS_VARIANTS); the options the
scripts share."""

from __future__ import annotations

import argparse
import statistics
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from engine.ops import gemv, gemv_policy

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
COLD_BYTES = 512 * 2**20  # the weight copies a graph replays: more than L2 holds


def weight_copies(n: int, k: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Random [n, k] weights, enough distinct copies (>= COLD_BYTES, at least two) that L2
    holds none of them."""
    copies = max(2, -(-COLD_BYTES // (n * k * dtype.itemsize)))
    return [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]


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


class Compared(NamedTuple):
    """One row of the main table: a product's seconds a call in cuBLAS, in the package's
    launch (`gemv.gemv`), in the all-rows kernel (`rows_config`) and in the op set
    (`gemv.linear`); the weight's bytes; the package's error against cuBLAS."""

    name: str
    rows: int
    t_cublas: float
    t_ours: float
    t_rows: float
    t_linear: float
    nbytes: int
    err: float


def compare(name: str, x: torch.Tensor, weights: list[torch.Tensor]) -> Compared:
    """The main table's row for the product of `x` and each of `weights`."""
    ref = F.linear(x, weights[0])
    err = ((gemv.gemv(x, weights[0]).float() - ref.float()).norm() / ref.float().norm()).item()
    t_cublas = time_calls(F.linear, weights, x)
    t_ours = time_calls(gemv.gemv, weights, x)
    n = weights[0].shape[0]
    rows_config = gemv_policy.rows_config(
        n, torch.cuda.get_device_properties().multi_processor_count
    )
    t_rows = time_calls(lambda a, w: gemv.gemv(a, w, rows_config), weights, x)
    t_linear = time_calls(gemv.linear, weights, x)
    nbytes = weights[0].numel() * weights[0].element_size()
    return Compared(name, x.shape[0], t_cublas, t_ours, t_rows, t_linear, nbytes, err)


def compared_table(results: list[Compared], best: list[float] | None = None) -> str:
    """The main table's markdown; with `best` (seconds, one a row) a column of the fastest
    swept launch."""
    best_head, best_rule = ("best swept us | ", "---|") if best is not None else ("", "")
    lines = [
        "\n| shape | rows | cuBLAS us | cuBLAS GB/s | ours us | ours GB/s | ours/cuBLAS | "
        f"all rows us | op set us | {best_head}rel err |",
        "|---|---|---|---|---|---|---|---|---|" + best_rule + "---|",
    ]
    for i, (name, rows, tc, to, tr, tl, nbytes, err) in enumerate(results):
        best_cell = "" if best is None else f"{best[i] * 1e6:.1f} | "
        lines.append(
            f"| {name} | {rows} | {tc * 1e6:.1f} | {nbytes / tc / 1e9:.0f} | {to * 1e6:.1f} | "
            f"{nbytes / to / 1e9:.0f} | {tc / to:.2f}x | {tr * 1e6:.1f} | {tl * 1e6:.1f} | "
            f"{best_cell}{err:.1e} |"
        )
    return "\n".join(lines)


def verify_launch(name: str, n: int, sms: int, norm_w: torch.Tensor):
    """(the model's all-rows launch, the call as a verify pass makes it, its float64 value)
    for the product `name` of weight [n, K]: the norm inside qkv, the norm and SiLU*mul
    around gate_up, plain o_proj and down."""
    eps = 1e-5

    def normed(a):
        a = a.double()
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()

    if name == "gate_up":

        def silu_after(a, w):
            gate = F.linear(normed(a), w[: n // 2].double())
            return F.silu(gate) * F.linear(normed(a), w[n // 2 :].double())

        return (
            gemv_policy.rows_config(n // 2, sms, silu_mul=True),
            lambda a, w, c: gemv.norm_gemv_silu(a, None, norm_w, eps, w, c)[0],
            silu_after,
        )
    if name == "qkv":
        return (
            gemv_policy.rows_config(n, sms),
            lambda a, w, c: gemv.norm_gemv(a, None, norm_w, eps, w, c)[0],
            lambda a, w: F.linear(normed(a), w.double()),
        )
    return gemv_policy.rows_config(n, sms), gemv.gemv, lambda a, w: F.linear(a.double(), w.double())


# the all-rows launch's variants `bench_gemv.py --load-3d` times (and `kernel_usage.py`
# compiles): its overrides
ROWS_VARIANTS: dict[str, dict[str, Any]] = {
    "flat": {"LOAD_3D": False},
    "3-d": {"LOAD_3D": True},
}


def add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both scripts take: the shapes, the rows, the dtype, the one-row kernel's
    weight limit, and `--only`."""
    parser.add_argument("--only", default=None, help="shape names, comma-separated (lm_head)")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama3_8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--max-weight-elements",
        type=int,
        default=gemv_policy.MAX_WEIGHT_ELEMENTS,
        help="the largest weight the one-row kernel takes (gemv_policy.MAX_WEIGHT_ELEMENTS): lower "
        "it to time the op set with cuBLAS's products on the weights above it",
    )


def shape_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The shapes `--only` names (every shape of `--shapes` without it); an unknown one is
    refused."""
    names = args.only.split(",") if args.only else list(SHAPES[args.shapes])
    if unknown := set(names) - set(SHAPES[args.shapes]):
        parser.error(f"--only: no shapes {sorted(unknown)}; they are {list(SHAPES[args.shapes])}")
    return names


def start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.dtype, list]:
    """A run's set-up, after its own checks: refused without a CUDA device; the one-row
    kernel's weight limit set, torch seeded, the device and shapes printed. (The dtype, the
    row counts.)"""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device to time the matrix-vector kernels; torch sees none")
    gemv_policy.MAX_WEIGHT_ELEMENTS = args.max_weight_elements
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.shapes} shapes, {args.dtype}")
    return DTYPES[args.dtype], [int(r) for r in args.rows.split(",")]
