"""The matrix-vector kernel (engine/ops/gemv.py) against cuBLAS (F.linear), H200, bf16.

    python3 benchmarks/bench_gemv.py
    python3 benchmarks/bench_gemv.py --shapes smollm2_135m --dtype float32 --rows 1,13

Llama-3-8B's projection shapes (or SmolLM2-135M's) at 1, 2 and 4 rows (or `--rows`: a verify
pass of a 12-draft tree has 13). Each measurement replays a CUDA graph of calls over enough
distinct weight copies (>= 512 MB) that L2 holds none of them, as in a real decode step; the
time is one call's share, median of 10 replays (`gemv_problems.py`, which
bench_gemv_sweeps.py shares). GB/s counts the weight bytes. "all rows" is the kernel that
loads each weight tile once for every row (`gemv_policy.rows_config`); "op set" is the
product the model runs (`gemv.linear`: the package's launch, or cuBLAS's where it declines).
`--load-3d` (float32 rows, e.g. `--shapes smollm2_135m --dtype float32 --rows 8,13`) times
the all-rows launches a verify pass makes (norm + qkv, o_proj, norm + gate_up + SiLU*mul,
down) as the model launches them, with x and the weight tiles loaded flat (the default) and
in 3-d blocks (LOAD_3D, `ENGINE_ROWS_LOAD_3D=1`), with each one's error against float64.
The launch configurations swept (`--sweep [--wide]`, `--loop-stages`, `--sweep-verify`):
benchmarks/bench_gemv_sweeps.py.

    python3 benchmarks/bench_gemv.py --fused [--shapes smollm2_135m --dtype float32]
                                     [--max-weight-elements 33554432]

`--fused` times instead the products that follow a norm (qkv, gate_up: RMSNorm with the
residual add) or SiLU*mul (down): the op then `linear` (two launches) against the kernel
with the op inside it (`norm_gemv`, `silu_gemv`: one launch, as `linear_config` and, for the
one-row norm, `norm_config` launch it), where the kernel takes the product (in the all-rows
kernel, float32 rows: the norm, with SiLU*mul after gate_up, `norm_gemv_silu`, against the
norm then `linear_silu_mul`); and the gate_up product then SiLU*mul against the all-rows
kernel with SiLU*mul after its products (`gemv_silu`); and says which of the two the op set
runs (`norm_linear`, `silu_mul_linear`, `linear_silu_mul`, `norm_linear_silu_mul`).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
from gemv_problems import (  # benchmarks/, beside this script
    ROWS_VARIANTS,
    SHAPES,
    Compared,
    add_problem_arguments,
    compare,
    compared_table,
    shape_names,
    start,
    time_calls,
    verify_launch,
    weight_copies,
)

from engine.ops import gemv, gemv_policy
from engine.ops import triton as fused_ops

PROLOGUES = {"qkv": "norm", "gate_up": "norm", "down": "silu"}


def compare_fused(shapes: dict, dtype: torch.dtype, rows_list: list[int]) -> None:
    """The norm or SiLU*mul op then `linear` against the one-launch product, per shape where
    the kernel takes the product, and which of the two the op set runs."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    results = []
    for name, prologue in PROLOGUES.items():
        n, k = shapes[name]
        weights = weight_copies(n, k, dtype)
        norm_w = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        for rows in rows_list:
            config, label = gemv_policy.linear_config(rows, dtype, (n, k), sms), name
            if prologue == "norm":
                x = torch.randn(rows, k, device="cuda", dtype=dtype)
                residual = torch.randn(rows, k, device="cuda", dtype=dtype)

                def apart(x, w):
                    normed, _ = fused_ops.add_rms_norm(x, residual, norm_w, 1e-5)
                    return fused_ops.linear(normed, w)

                def one(x, w, c=config):
                    return gemv.norm_gemv(x, residual, norm_w, 1e-5, w, c)[0]

                runs: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None  # None: apart
                runs = fused_ops.norm_linear(x, residual, norm_w, 1e-5, weights[0])
            else:
                x = torch.randn(rows, 2 * k, device="cuda", dtype=dtype)

                def apart(x, w):
                    return fused_ops.linear(fused_ops.silu_mul(x), w)

                def one(x, w, c=config):
                    return gemv.silu_gemv(x, w, c)

                runs = fused_ops.silu_mul_linear(x, weights[0])
            all_rows = config is not None and config.get("all_rows")
            if all_rows and name == "gate_up":  # the model's launch: SiLU*mul after it too
                config = gemv_policy.rows_config(n // 2, sms, silu_mul=True)

                def apart(x, w):
                    normed, _ = fused_ops.add_rms_norm(x, residual, norm_w, 1e-5)
                    return fused_ops.linear_silu_mul(normed, w)

                def one(x, w, c=config):
                    return gemv.norm_gemv_silu(x, residual, norm_w, 1e-5, w, c)[0]

                runs = fused_ops.norm_linear_silu_mul(x, residual, norm_w, 1e-5, weights[0])
                label = f"{name} + {SILU_AFTER}"
            t_apart = time_calls(apart, weights, x)
            if config is None or (all_rows and prologue != "norm"):  # no op inside
                kernel = "cuBLAS" if config is None else "all rows"
                results.append(
                    Fused(prologue, label, rows, t_apart, None, None, f"apart ({kernel})")
                )
                continue
            expected = apart(x, weights[0]).float()
            assert torch.allclose(one(x, weights[0]).float(), expected, rtol=2e-2, atol=2e-2)
            chosen = "apart" if runs is None else "one launch"
            one_row_norm = prologue == "norm" and not all_rows
            launch = gemv_policy.norm_config(config, (n, k), sms) if one_row_norm else config
            unpipelined = dict(config, LOOP_STAGES=1)
            t_one, t_one1 = (
                time_calls(lambda a, w, c=c: one(a, w, c), weights, x)
                for c in (launch, unpipelined)
            )
            results.append(Fused(prologue, label, rows, t_apart, t_one, t_one1, chosen))
        del weights
        torch.cuda.empty_cache()
    results += silu_after(shapes, dtype, rows_list, sms)
    print(fused_table(results))


class Fused(NamedTuple):
    """One row of `--fused`: the op (a prologue of PROLOGUES, or SILU_AFTER) and the product,
    the two launches' time, the one launch's (None: none), unpipelined, and what the op set
    runs."""

    op: str
    product: str
    rows: int
    t_apart: float
    t_one: float | None
    t_one1: float | None
    chosen: str


SILU_AFTER = "silu after"  # SiLU*mul after the gate_up product, in the all-rows kernel


def fused_table(results: list[Fused]) -> str:
    """`--fused`'s markdown table; a row names the op first where it runs before the
    product, after it for SILU_AFTER."""
    lines = [
        "\n| product | rows | op + linear us | one launch us | apart / one | "
        "one launch, LOOP_STAGES=1 us | the op set runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        label = f"{r.product} + {r.op}" if r.op == SILU_AFTER else f"{r.op} + {r.product}"
        one_text = "" if r.t_one is None else f"{r.t_one * 1e6:.1f}"
        ratio = "" if r.t_one is None else f"{r.t_apart / r.t_one:.2f}x"
        one1_text = "" if r.t_one1 is None else f"{r.t_one1 * 1e6:.1f}"
        lines.append(
            f"| {label} | {r.rows} | {r.t_apart * 1e6:.1f} | {one_text} | "
            f"{ratio} | {one1_text} | {r.chosen} |"
        )
    return "\n".join(lines)


def silu_after(shapes: dict, dtype: torch.dtype, rows_list: list[int], sms: int) -> list:
    """The gate_up product then SiLU*mul (two launches) against the all-rows kernel with
    SiLU*mul after its products (`gemv_silu`), at the row counts it takes."""
    n, k = shapes["gate_up"]
    weights = weight_copies(n, k, dtype)
    results = []
    for rows in rows_list:
        config = gemv_policy.linear_config(rows, dtype, (n, k), sms)
        if config is None or not config.get("all_rows"):
            continue
        x = torch.randn(rows, k, device="cuda", dtype=dtype)

        def apart(x, w):
            return fused_ops.silu_mul(fused_ops.linear(x, w))

        one_config = gemv_policy.rows_config(n // 2, sms, silu_mul=True)

        def one(x, w, c=one_config):
            return gemv.gemv_silu(x, w, c)

        expected = apart(x, weights[0]).float()
        assert torch.allclose(one(x, weights[0]).float(), expected, rtol=2e-2, atol=2e-2)
        chosen = "apart" if fused_ops.linear_silu_mul(x, weights[0]) is None else "one launch"
        unpipelined = dict(one_config, LOOP_STAGES=1)
        t_apart, t_one, t_one1 = (
            time_calls(call, weights, x)
            for call in (apart, one, lambda a, w: one(a, w, unpipelined))
        )
        results.append(Fused(SILU_AFTER, "gate_up", rows, t_apart, t_one, t_one1, chosen))
    del weights
    torch.cuda.empty_cache()
    return results


def compare_load_3d(shapes: dict, rows_list: list[int]) -> None:
    """float32 rows in the all-rows kernel: each launch a verify pass makes, in each of
    ROWS_VARIANTS (the loads flat, the default; in 3-d blocks, LOAD_3D), with each one's
    time over the flat launch's and its error against float64."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    names = list(ROWS_VARIANTS)
    print(
        "\n| product | rows | "
        + " | ".join(f"{v} us" for v in names)
        + " | "
        + " | ".join(f"{v} / flat" for v in names[1:])
        + " | max rel err |"
    )
    print("|---|---|" + "---|" * (2 * len(names)))
    for name in ("qkv", "o_proj", "gate_up", "down"):
        n, k = shapes[name]
        weights = weight_copies(n, k)
        norm_w = torch.rand(k, device="cuda") + 0.5
        model, call, exact = verify_launch(name, n, sms, norm_w)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda")
            want = exact(x, weights[0])
            times, errors = [], []
            for overrides in ROWS_VARIANTS.values():
                c = dict(model, **overrides)
                got = call(x, weights[0], c).double()
                errors.append(((got - want).abs().max() / want.abs().max()).item())
                times.append(time_calls(lambda a, w, c=c: call(a, w, c), weights, x))
            print(
                f"| {name} {n} x {k} | {rows} | "
                + " | ".join(f"{t * 1e6:.1f}" for t in times)
                + " | "
                + " | ".join(f"{t / times[0]:.2f}" for t in times[1:])
                + f" | {max(errors):.1e} |",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--load-3d", action="store_true")
    add_problem_arguments(parser)
    args = parser.parse_args()
    if args.only and (args.fused or args.load_3d):
        parser.error("--only picks the shapes of the main table, not of --fused or --load-3d")
    if args.load_3d and args.dtype != "float32":
        parser.error("--load-3d times the all-rows kernel, which takes float32 rows")
    names = shape_names(parser, args)
    dtype, rows_list = start(parser, args)
    if args.fused:
        compare_fused(SHAPES[args.shapes], dtype, rows_list)
        return
    if args.load_3d:
        compare_load_3d(SHAPES[args.shapes], rows_list)
        return
    results: list[Compared] = []
    for name in names:
        n, k = SHAPES[args.shapes][name]
        weights = weight_copies(n, k, dtype)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            results.append(compare(name, x, weights))
        del weights
        torch.cuda.empty_cache()
    print(compared_table(results))


if __name__ == "__main__":
    main()
