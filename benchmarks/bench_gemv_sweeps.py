"""The matrix-vector kernels' launch configurations swept (engine/ops/gemv.py, `gemv_policy`).

    python3 benchmarks/bench_gemv_sweeps.py --sweep [--rows 1]
    python3 benchmarks/bench_gemv_sweeps.py --sweep --wide --only lm_head \\
        --shapes smollm2_135m --dtype float32 --rows 8,13
    python3 benchmarks/bench_gemv_sweeps.py --loop-stages [--shapes smollm2_135m --dtype float32]
    python3 benchmarks/bench_gemv_sweeps.py --sweep-verify --shapes smollm2_135m \\
        --dtype float32 --rows 8,13

Shapes and timing as bench_gemv.py's (`gemv_problems.py`): Llama-3-8B's projection shapes
(or SmolLM2-135M's) at 1, 2 and 4 rows (or `--rows`), each time one call's share of a CUDA
graph replaying it over enough distinct weight copies (>= 512 MB) that L2 holds none of them,
median of 10 replays. `--sweep` times bench_gemv.py's table (cuBLAS, the package's launch,
the all-rows kernel, the op set) and tries every launch configuration (`configs`) at each
shape (`--only` picks some) and row count: it prints the fastest five there, the table with
the fastest swept beside the rest, and the one configuration fastest in sum over every shape
and row count; with `--wide` the all-rows kernel's launches for a wide weight (`--only
lm_head`: the output layer), compiled in parallel first. `--loop-stages` times the launch the
model takes (`linear_config`) at 1-12 key steps in flight (LOOP_STAGES), beside cuBLAS.
`--sweep-verify` (float32 rows) times the all-rows launches a verify pass makes (norm + qkv,
o_proj, norm + gate_up + SiLU*mul, down; `verify_launch`) at every tile, warp count and key
steps in flight of `verify_space`, compiled in parallel first, and prints the fastest per
product and in sum over them. These studies were `bench_gemv.py --sweep`, `--loop-stages` and
`--sweep-verify` before they moved here, under the same flags.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
from gemv_problems import (  # benchmarks/, beside this script
    DTYPES,
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


def configs(rows: int, wide: bool = False):
    """The one-row kernel's launch configurations for one row, the all-rows kernel's for more
    (its accumulator holds rows x BLOCK_N x BLOCK_K products); `wide`: the all-rows kernel's
    for a wide weight (an output layer), tiles up to 256 columns by as few as 4 keys, loads
    flat and in 3-d blocks (LOAD_3D)."""
    if wide:
        tiles = ((8, 64), (16, 32), (32, 16), (32, 32), (64, 8), (64, 16), (128, 4), (128, 8))
        for (bn, bk), warps, stages, load_3d in itertools.product(
            tiles + ((256, 4),), (4, 8), (1, 4, 8), (False, True)
        ):
            yield dict(
                BLOCK_N=bn,
                BLOCK_K=bk,
                num_warps=warps,
                LOOP_STAGES=stages,
                LOAD_3D=load_3d,
                all_rows=True,
            )
        return
    if rows == 1:
        space = itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3, 4))
        limit, all_rows = 16384, False
    else:
        space = itertools.product((2, 4, 8, 16), (32, 64, 128), (4, 8), (2, 3, 4, 8))
        limit, all_rows = 1024, True
    for bn, bk, warps, stages in space:  # stages: key steps in flight (LOOP_STAGES)
        if bn * bk <= limit:
            yield dict(
                BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, LOOP_STAGES=stages, all_rows=all_rows
            )


def _compile(job: tuple[int, int, int, str, list[dict]]) -> None:
    """Run each of the job's configs once on a [rows, k] x [n, k] product (a process of the
    pool that `precompile` starts): Triton's cache then holds their code. A config the
    compiler refuses is skipped here; the sweep's own call reports it."""
    rows, n, k, dtype, configs = job
    x = torch.zeros(rows, k, device="cuda", dtype=DTYPES[dtype])
    w = torch.zeros(n, k, device="cuda", dtype=DTYPES[dtype])
    for config in configs:
        try:
            gemv.gemv(x, w, config)
        except Exception:  # reported by the sweep, which makes the same call
            continue
    torch.cuda.synchronize()


def _workers() -> int:
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def precompile(rows: int, n: int, k: int, dtype: str, space: list[dict]) -> None:
    """Compile every launch of `space` in parallel processes first, so that the sweep's own
    calls find their code in Triton's cache."""
    workers = _workers()
    chunks = [(rows, n, k, dtype, space[i::workers]) for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(_compile, chunks))


def sweep(
    shapes: dict, names: list[str], dtype_name: str, rows_list: list[int], wide: bool
) -> None:
    """bench_gemv.py's table at each shape of `names` and row count, with every launch of
    `configs` (`wide`: the wide-weight space past one row, compiled in parallel first): the
    fastest five there, the fastest beside the table's launches, and the one launch fastest
    in sum over every shape and row count."""
    dtype = DTYPES[dtype_name]
    results: list[Compared] = []
    best_times: list[float] = []
    totals: dict[str, list[float]] = {}  # a swept config's times, one per (shape, rows)
    for name in names:
        n, k = shapes[name]
        weights = weight_copies(n, k, dtype)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            row = compare(name, x, weights)
            best: tuple[float, dict | str] = (row.t_ours, "default")
            space = list(configs(rows, wide and rows > 1))
            if wide:
                precompile(rows, n, k, dtype_name, space)
            timed = []
            for config in space:
                try:
                    t = time_calls(lambda a, w, c=config: gemv.gemv(a, w, c), weights, x)
                except Exception as exc:  # a config the compiler refuses
                    print(name, rows, config, type(exc).__name__)
                    continue
                timed.append((t, config))
                totals.setdefault(json.dumps(config, sort_keys=True), []).append(t)
                if t < best[0]:
                    best = (t, config)
            print(f"{name} rows={rows}: best {best[0] * 1e6:.1f} us {best[1]}", flush=True)
            for t, config in sorted(timed, key=lambda entry: entry[0])[:5]:
                print(f"    {t * 1e6:.1f} us {config}", flush=True)
            results.append(row)
            best_times.append(best[0])
        del weights
        torch.cuda.empty_cache()
    print(compared_table(results, best_times))
    if totals:  # the config fastest in sum over every shape and row count
        timings = max(len(times) for times in totals.values())
        config, times = min(
            ((c, t) for c, t in totals.items() if len(t) == timings), key=lambda e: sum(e[1])
        )
        print(f"\nfastest in all: {' '.join(f'{t * 1e6:.1f}' for t in times)} us")
        print(f"swept-best {config}")


def compare_loop_stages(shapes: dict, dtype: torch.dtype, rows_list: list[int]) -> None:
    """The launch `linear_config` picks, at each LOOP_STAGES (key steps in flight)."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    stages = (1, 2, 3, 4, 6, 8, 12)
    print(f"\n| shape | rows | cuBLAS us | {' | '.join(f'LOOP_STAGES={s} us' for s in stages)} |")
    print("|---|---|---|" + "---|" * len(stages))
    for name, (n, k) in shapes.items():
        weights = weight_copies(n, k, dtype)
        for rows in rows_list:
            config = gemv_policy.linear_config(rows, dtype, (n, k), sms)
            if config is None:
                continue
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            times = []
            for s in stages:
                c = dict(config, LOOP_STAGES=s)
                got = gemv.gemv(x, weights[0], c).float()
                assert torch.allclose(got, F.linear(x, weights[0]).float(), rtol=2e-2, atol=2e-2)
                times.append(time_calls(lambda a, w, c=c: gemv.gemv(a, w, c), weights, x))
            t_cublas = time_calls(F.linear, weights, x)
            cells = " | ".join(f"{t * 1e6:.1f}" for t in times)
            print(f"| {name} {n} x {k} | {rows} | {t_cublas * 1e6:.1f} | {cells} |", flush=True)
        del weights
        torch.cuda.empty_cache()


# `--sweep-verify`'s space: tiles of 128-1024 products a row a key step, 4 or 8 warps, 4-12
# key steps in flight
VERIFY_TILES = (
    (2, 64),
    (2, 128),
    (4, 32),
    (4, 64),
    (4, 128),
    (8, 16),
    (8, 32),
    (8, 64),
    (8, 128),
    (16, 16),
    (16, 32),
    (16, 64),
    (32, 16),
    (32, 32),
)


def verify_space(model: dict) -> list[dict]:
    """The all-rows launches `--sweep-verify` times for a product whose model launch is
    `model` (`rows_config`'s: its LOAD_3D and num_stages kept)."""
    return [
        dict(model, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, LOOP_STAGES=stages)
        for (bn, bk), warps, stages in itertools.product(VERIFY_TILES, (4, 8), (4, 8, 12))
    ]


def _compile_verify(job: tuple[str, int, int, int, list[dict]]) -> None:
    """Run each config once as the verify pass launches the product `name` (a process of
    `sweep_verify`'s pool): Triton's cache then holds their code."""
    name, rows, n, k, space = job
    sms = torch.cuda.get_device_properties().multi_processor_count
    _, call, _ = verify_launch(name, n, sms, torch.ones(k, device="cuda"))
    x, w = torch.zeros(rows, k, device="cuda"), torch.zeros(n, k, device="cuda")
    for config in space:
        try:
            call(x, w, config)
        except Exception:  # reported by the sweep, which makes the same call
            continue
    torch.cuda.synchronize()


def sweep_verify(shapes: dict, rows_list: list[int]) -> None:
    """float32 rows: each launch a verify pass makes (`verify_launch`: the norm inside qkv,
    the norm and SiLU*mul around gate_up, plain o_proj and down) at every launch of
    `verify_space`, compiled in parallel first; per product and row count the model's launch
    and the five fastest, then per row count the launch fastest in sum over the products
    (with SiLU*mul, `silu` apart: gate_up's launch has its own columns a program)."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    names = ("qkv", "o_proj", "gate_up", "down")
    launches = {  # the norms' weights random: the sweep checks each launch against float64
        name: verify_launch(
            name, shapes[name][0], sms, torch.rand(shapes[name][1], device="cuda") + 0.5
        )
        for name in names
    }
    jobs = [
        (name, rows, *shapes[name], chunk)
        for name in names
        for rows in rows_list
        for chunk in (verify_space(launches[name][0])[i::4] for i in range(4))
    ]
    with ProcessPoolExecutor(_workers(), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_verify, jobs))
    totals: dict[tuple[int, str], dict[str, float]] = {}  # (rows, plain|silu) -> config -> us
    summary = []
    for name in names:
        n, k = shapes[name]
        weights = weight_copies(n, k)
        model, call, exact = launches[name]
        group = "silu" if name == "gate_up" else "plain"
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda")
            want = exact(x, weights[0])
            t_model = time_calls(lambda a, w: call(a, w, model), weights, x)
            timed = []
            for config in verify_space(model):
                try:
                    got = call(x, weights[0], config).double()
                except Exception as exc:  # a config the compiler refuses
                    print(name, rows, config, type(exc).__name__)
                    continue
                error = ((got - want).abs().max() / want.abs().max()).item()
                assert error < 1e-4, (name, rows, config, error)
                t = time_calls(lambda a, w, c=config: call(a, w, c), weights, x)
                timed.append((t, config))
                key = json.dumps(config, sort_keys=True)
                totals.setdefault((rows, group), {}).setdefault(key, 0.0)
                totals[(rows, group)][key] += t
            timed.sort(key=lambda entry: entry[0])
            print(f"{name} {n} x {k}, {rows} rows: model's launch {t_model * 1e6:.2f} us")
            for t, config in timed[:5]:
                print(f"    {t * 1e6:.2f} us {_launch_text(config)}", flush=True)
            summary.append((name, rows, t_model, timed[0]))
        del weights
        torch.cuda.empty_cache()
    print("\n| product | rows | model's launch us | fastest swept us | its launch |")
    print("|---|---|---|---|---|")
    for name, rows, t_model, (t, config) in summary:
        print(f"| {name} | {rows} | {t_model * 1e6:.2f} | {t * 1e6:.2f} | {_launch_text(config)} |")
    for (rows, group), times in sorted(totals.items()):
        key, total = min(times.items(), key=lambda entry: entry[1])
        models = sum(
            t for name, r, t, _ in summary if r == rows and (name == "gate_up") == (group == "silu")
        )
        print(
            f"{rows} rows, {group}: fastest in sum {total * 1e6:.2f} us (the model's "
            f"{models * 1e6:.2f}): {_launch_text(json.loads(key))}"
        )


def _launch_text(config: dict) -> str:
    return (
        f"{config['BLOCK_N']} x {config['BLOCK_K']}, {config['num_warps']} warps, "
        f"{config['LOOP_STAGES']} steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study = parser.add_mutually_exclusive_group(required=True)
    study.add_argument(
        "--sweep",
        action="store_true",
        help="bench_gemv.py's table with every launch configuration tried at each shape and "
        "row count",
    )
    study.add_argument(
        "--loop-stages",
        action="store_true",
        help="the launch the model takes at 1-12 key steps in flight (LOOP_STAGES)",
    )
    study.add_argument(
        "--sweep-verify",
        action="store_true",
        help="float32 rows: the all-rows launches a verify pass makes, each at every launch "
        "of a space of tiles, warps and key steps in flight (compiled in parallel first)",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="with --sweep: the all-rows kernel's wide-weight space (`configs(wide=True)`) "
        "at every row count, compiled in parallel first",
    )
    add_problem_arguments(parser)
    args = parser.parse_args()
    if args.wide and not args.sweep:
        parser.error("--wide widens --sweep's space; give --sweep too")
    if args.only and not args.sweep:
        parser.error("--only picks the shapes of --sweep, not of --loop-stages or --sweep-verify")
    if args.sweep_verify and args.dtype != "float32":
        parser.error("--sweep-verify times the all-rows kernel, which takes float32 rows")
    names = shape_names(parser, args)
    dtype, rows_list = start(parser, args)
    if args.sweep_verify:
        sweep_verify(SHAPES[args.shapes], rows_list)
    elif args.loop_stages:
        compare_loop_stages(SHAPES[args.shapes], dtype, rows_list)
    else:
        sweep(SHAPES[args.shapes], names, args.dtype, rows_list, args.wide)


if __name__ == "__main__":
    main()
