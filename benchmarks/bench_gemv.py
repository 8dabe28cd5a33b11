"""The matrix-vector kernel (engine/ops/gemv.py) against cuBLAS (F.linear), H200, bf16.

    python3 benchmarks/bench_gemv.py [--sweep]
    python3 benchmarks/bench_gemv.py --shapes smollm2_135m --dtype float32 --rows 1,13

Llama-3-8B's projection shapes (or SmolLM2-135M's) at 1, 2 and 4 rows (or `--rows`: a verify
pass of a 12-draft tree has 13). Each measurement replays a CUDA graph of calls over enough
distinct weight copies (>= 512 MB) that L2 holds none of them, as in a real decode step; the
time is one call's share, median of 10 replays. GB/s counts the weight bytes. "all rows" is the
kernel that loads each weight tile once for every row (`gemv_policy.rows_config`); "op set" is the
product the model runs (`gemv.linear`: the package's launch, or cuBLAS's where it declines).
`--sweep` also tries every launch configuration and prints the fastest per shape, and the
one fastest in sum over every shape and row count; with `--wide` the all-rows kernel's
launches for a wide weight (`--only lm_head`: the output layer), compiled in parallel first;
`--loop-stages` times the launch the model takes at 1-4 key steps in flight (LOOP_STAGES).
`--load-3d` (float32 rows, e.g. `--shapes smollm2_135m --dtype float32 --rows 8,13`) times
the all-rows launches a verify pass makes (norm + qkv, o_proj, norm + gate_up + SiLU*mul,
down) as the model launches them, with x and the weight tiles loaded flat (the default) and
in 3-d blocks (LOAD_3D, `ENGINE_ROWS_LOAD_3D=1`), with each one's error against float64.
`--sweep-verify` (float32 rows) times those launches at every tile, warp count and key steps
in flight of `verify_space`, and prints the fastest per product and in sum over them.

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
import itertools
import json
import statistics
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from engine.ops import gemv, gemv_policy
from engine.ops import triton as fused_ops

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


def precompile(rows: int, n: int, k: int, dtype: str, space: list[dict]) -> None:
    """Compile every launch of `space` in parallel processes first, so that the sweep's own
    calls find their code in Triton's cache."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    chunks = [(rows, n, k, dtype, space[i::workers]) for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(_compile, chunks))


PROLOGUES = {"qkv": "norm", "gate_up": "norm", "down": "silu"}


def compare_fused(shapes: dict, dtype: torch.dtype, rows_list: list[int]) -> None:
    """The norm or SiLU*mul op then `linear` against the one-launch product, per shape where
    the kernel takes the product, and which of the two the op set runs."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    results = []
    for name, prologue in PROLOGUES.items():
        n, k = shapes[name]
        copies = max(2, -(-512 * 2**20 // (n * k * dtype.itemsize)))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
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
    copies = max(2, -(-512 * 2**20 // (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
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


def compare_loop_stages(shapes: dict, dtype: torch.dtype, rows_list: list[int]) -> None:
    """The launch `linear_config` picks, at each LOOP_STAGES (key steps in flight)."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    stages = (1, 2, 3, 4, 6, 8, 12)
    print(f"\n| shape | rows | cuBLAS us | {' | '.join(f'LOOP_STAGES={s} us' for s in stages)} |")
    print("|---|---|---|" + "---|" * len(stages))
    for name, (n, k) in shapes.items():
        copies = max(2, -(-512 * 2**20 // (n * k * dtype.itemsize)))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
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


# the all-rows launch's variants `--load-3d` times: its overrides
ROWS_VARIANTS: dict[str, dict[str, Any]] = {
    "flat": {"LOAD_3D": False},
    "3-d": {"LOAD_3D": True},
}


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
        copies = max(2, -(-512 * 2**20 // (n * k * 4)))
        weights = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies)]
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
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

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
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_verify, jobs))
    totals: dict[tuple[int, str], dict[str, float]] = {}  # (rows, plain|silu) -> config -> us
    summary = []
    for name in names:
        n, k = shapes[name]
        copies = max(2, -(-512 * 2**20 // (n * k * 4)))
        weights = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies)]
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--wide",
        action="store_true",
        help="with --sweep: the all-rows kernel's wide-weight space (`configs(wide=True)`) "
        "at every row count, compiled in parallel first",
    )
    parser.add_argument("--only", default=None, help="shape names, comma-separated (lm_head)")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--loop-stages", action="store_true")
    parser.add_argument("--load-3d", action="store_true")
    parser.add_argument(
        "--sweep-verify",
        action="store_true",
        help="float32 rows: the all-rows launches a verify pass makes, each at every launch "
        "of a space of tiles, warps and key steps in flight (compiled in parallel first)",
    )
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
    args = parser.parse_args()
    if args.wide and not args.sweep:
        parser.error("--wide widens --sweep's space; give --sweep too")
    if args.only and (args.fused or args.load_3d or args.loop_stages or args.sweep_verify):
        parser.error(
            "--only picks the shapes of the main table and --sweep, not of --fused, "
            "--load-3d, --loop-stages or --sweep-verify"
        )
    for mode in ("load_3d", "sweep_verify"):
        if getattr(args, mode) and args.dtype != "float32":
            flag = "--" + mode.replace("_", "-")
            parser.error(f"{flag} times the all-rows kernel, which takes float32 rows")
    names = args.only.split(",") if args.only else list(SHAPES[args.shapes])
    if unknown := set(names) - set(SHAPES[args.shapes]):
        parser.error(f"--only: no shapes {sorted(unknown)}; they are {list(SHAPES[args.shapes])}")
    gemv_policy.MAX_WEIGHT_ELEMENTS = args.max_weight_elements
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.shapes} shapes, {args.dtype}")
    if args.fused:
        compare_fused(SHAPES[args.shapes], dtype, [int(r) for r in args.rows.split(",")])
        return
    if args.load_3d:
        compare_load_3d(SHAPES[args.shapes], [int(r) for r in args.rows.split(",")])
        return
    if args.sweep_verify:
        sweep_verify(SHAPES[args.shapes], [int(r) for r in args.rows.split(",")])
        return
    if args.loop_stages:
        compare_loop_stages(SHAPES[args.shapes], dtype, [int(r) for r in args.rows.split(",")])
        return
    results = []
    totals: dict[str, list[float]] = {}  # a swept config's times, one per (shape, rows)
    for name in names:
        n, k = SHAPES[args.shapes][name]
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
            rows_config = gemv_policy.rows_config(
                n, torch.cuda.get_device_properties().multi_processor_count
            )
            t_rows = time_calls(lambda a, w: gemv.gemv(a, w, rows_config), weights, x)
            t_linear = time_calls(gemv.linear, weights, x)
            best = (t_ours, "default")
            if args.sweep:
                space = list(configs(rows, args.wide and rows > 1))
                if args.wide:
                    precompile(rows, n, k, args.dtype, space)
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
            results.append((name, rows, t_cublas, t_ours, t_rows, t_linear, best, nbytes, err))
        del weights
        torch.cuda.empty_cache()
    print(
        "\n| shape | rows | cuBLAS us | cuBLAS GB/s | ours us | ours GB/s | ours/cuBLAS | "
        "all rows us | op set us | best swept us | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, tc, to, tr, tl, best, nbytes, err in results:
        print(
            f"| {name} | {rows} | {tc * 1e6:.1f} | {nbytes / tc / 1e9:.0f} | {to * 1e6:.1f} | "
            f"{nbytes / to / 1e9:.0f} | {tc / to:.2f}x | {tr * 1e6:.1f} | {tl * 1e6:.1f} | "
            f"{best[0] * 1e6:.1f} | {err:.1e} |"
        )
    if args.sweep and totals:  # the config fastest in sum over every shape and row count
        timings = max(len(times) for times in totals.values())
        config, times = min(
            ((c, t) for c, t in totals.items() if len(t) == timings), key=lambda e: sum(e[1])
        )
        print(f"\nfastest in all: {' '.join(f'{t * 1e6:.1f}' for t in times)} us")
        print(f"swept-best {config}")


if __name__ == "__main__":
    main()
