"""The launch policy of the Triton matrix-vector kernels (`engine.ops.gemv`): which products
go to them rather than to cuBLAS (`kernel_takes`), and each one's launch: the one-row
kernel's (GEMV_CONFIG, `linear_config`), the all-rows kernel's (`rows_config`,
ROWS_WIDE_CONFIG past ROWS_MAX_WEIGHT_ELEMENTS), with the norm inside the product
(`norm_config`), and how many key steps are in flight by the programs an SM. Pure functions
of the rows, the dtype, the weight's shape and the SM count, and the measured constants they
read (`engine.ops.gemv` reads them at each call, so a test or a benchmark may set them here);
the launches take what these choose.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

MAX_ROWS = 16  # x rows the kernel accepts (a verify pass of a 12-draft tree has 13)
# `gemv.linear` takes the kernel for one row and weights up to MAX_WEIGHT_ELEMENTS: every
# weight measured. At one row (`bench_gemv.py --rows 1 --max-weight-elements 1073741824`,
# docs/benchmarks.md) Llama-3-8B's products run at 0.98-1.16x cuBLAS's speed on an H100 (the
# output layer, 525M elements, 1.06x), and a batch-1 decode pass of that shape whose products
# all run in the kernel takes 0.96-0.97 of its time with gate_up and down on cuBLAS (two
# H100s; the norm and SiLU*mul inside the products, no split-K reduce launch; PDL off:
# `pdl.for_pass`). At 2 and 4 rows the one-row kernel re-reads the weights per row and falls
# to 0.24-0.74x, so bf16 rows stay with cuBLAS.
LINEAR_ROWS = 1
MAX_WEIGHT_ELEMENTS = 2**30
# float32 products of 2..MAX_ROWS rows (a small model's verify pass: 13) go to the all-rows
# kernel up to ROWS_MAX_WEIGHT_ELEMENTS: cuBLAS runs them on SIMT tiles with a split-K reduce.
# On the H200 at SmolLM2-135M's shapes and 13 rows (`bench_gemv.py --shapes smollm2_135m
# --dtype float32 --rows 13`) `rows_config`'s launches took 4.6-7.5 us against cuBLAS's
# 10.0-13.4 us for qkv, o_proj, gate_up and down (0.55M-1.8M elements), but 98.5 us against
# 65.1 us for the 28M-element output layer (a launch of the rule before).
ROWS_MAX_WEIGHT_ELEMENTS = 4 * 2**20
# The all-rows launch (`rows_config`): 512 products a row per key step, 8 key steps in flight,
# BLOCK_N 8 x BLOCK_K 64, or 16 x 32 with SiLU*mul after the products (two weight tiles a
# step). Swept on the H200 at SmolLM2-135M's shapes and 13 rows, these fewer, wider programs
# with deeper pipelines beat the launches before (the widest BLOCK_N keeping 1.75 programs an
# SM, 256 products, 4 steps). `bench_gemv_sweeps.py --loop-stages` and `bench_gemv.py --fused`
# (`--shapes smollm2_135m --dtype float32 --rows 13`, docs/benchmarks.md): qkv 4.8, o_proj
# 4.6, down 7.1 us, gate_up with SiLU*mul 7.4, against 4.9, 5.1, 7.0 and 8.6 before; the
# verify pass 4% faster.
ROWS_BLOCK_N = 8
ROWS_SILU_BLOCK_N = 16
ROWS_PRODUCTS = 512
ROWS_LOOP_STAGES = 8
# float32 rows on a wider weight, past ROWS_MAX_WEIGHT_ELEMENTS up to ROWS_WIDE_MAX_WEIGHT_ELEMENTS
# (a small model's output layer: SmolLM2-135M's 49152 x 576), take the all-rows kernel with
# ROWS_WIDE_CONFIG (None: cuBLAS's product). Swept on an H100 at that shape
# (`bench_gemv_sweeps.py --shapes smollm2_135m --dtype float32 --rows 8,13 --only lm_head
# --sweep --wide`, 108 launches: tiles of 8-256 columns by 4-64 keys, 4 or 8 warps, 1-8 key
# steps in flight, loads flat or in 3-d blocks): 16 columns by 32 keys, 8 steps in flight,
# was the fastest at 8 rows (45.6 us against cuBLAS's 68.4) and in sum over 8 and 13 (59.2
# against 66.3; the fastest there, 64 x 16 with 4 steps, 57.0). The launches of `rows_config`
# took 65.3 and 116.3 us: its 6144 programs run unpipelined.
ROWS_WIDE_CONFIG: dict | None = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, LOOP_STAGES=8)
ROWS_WIDE_MAX_WEIGHT_ELEMENTS = 32 * 2**20  # the widest weight timed so is 28M elements


LOAD_3D_MODES = {"": "off", "0": "off", "1": "all", "plain": "plain"}


def _load_3d_mode(name: str) -> str:
    """The environment variable `name` as a LOAD_3D_MODES mode: unset, "" or "0" off, "1" all,
    "plain"; anything else refused."""
    value = os.environ.get(name, "")
    if value not in LOAD_3D_MODES:
        raise ValueError(f"{name} must be 0, 1 or plain (or unset); got {value!r}")
    return LOAD_3D_MODES[value]


# ENGINE_ROWS_LOAD_3D: the all-rows launches load x's rows and the weight tiles as 3-d
# blocks (`gemv_rows_kernel`'s LOAD_3D), whose accumulator holds a few keys a thread: "1"
# every launch, "plain" those without SiLU*mul (qkv, o_proj, down), else none. Compiled for
# sm_90 at a verify pass's 13 rows, the sum over the keys after the loop shrinks from 322
# shuffles a thread to 64 (o_proj; its code 1224 instructions long against 608), for 115
# registers against 96 (one program an SM either way). Off: timed on an H100, the narrow
# products shorten (0.75-0.92x), gate_up lengthens (1.11-1.29x) and a verify pass of the default
# model's shapes runs 1.04-1.14x slower with every launch so (docs/benchmarks.md, "The opt-in
# variants timed").
ROWS_LOAD_3D = _load_3d_mode("ENGINE_ROWS_LOAD_3D")


# The NORM prologue needs no pass over the row before the products: RMSNorm(x) . w =
# (x * norm_w) . w / RMS(x), so the key loop sums x's squares beside the products and each
# sum is scaled by 1 / RMS at the end. `gemv.norm_linear` and `gemv.silu_mul_linear` fuse
# one-row products, in the row-at-a-time kernel. Measured on the H200 (`bench_gemv.py --fused`): at
# one row the one launch is 1.08x (Llama-3-8B's norm + qkv, bf16, K 4096) to 1.38x
# (SmolLM2-135M's, fp32, K 576) as fast as the op and the product apart.
# SiLU*mul *after* its gate_up product repeats nothing (the program that sums a gate column
# sums its up column): `linear_silu_mul`, 1.05x the two launches at 13 rows.
# The all-rows kernel takes the NORM prologue too (`norm_linear` for float32 rows, and with
# SiLU*mul after the gate_up product `norm_linear_silu_mul`): each program redoes the norm's
# loads and sums over all of x, which costs about what the norm's own launch did. At
# SmolLM2-135M's shapes and 13 rows (`bench_gemv.py --fused`): norm + qkv 6.0 against 6.6 us
# apart, norm + gate_up + SiLU*mul 9.3 against 9.3, with `rows_config`'s launches (a sweep of
# launches with the norm inside found none worth its own); the verify pass 1.7% faster
# (`bench_steps.py`). SiLU*mul *before* a product (the down product) stays a one-row prologue:
# at 13 rows a variant of it ran at 0.52x the two launches.
FUSED_ROWS = 1
# The norm prologue's loads and its row's sum of squares take registers. Where the key loop
# has two steps or fewer and the launch two or more programs an SM, pipelining them cost more
# than it hid: SmolLM2-135M's norm + gate_up (K 576, 384 programs on the H200's 132 SMs)
# took 5.9 us with 3 key steps in flight against 5.1 with none (`bench_gemv.py --fused`),
# while its norm + qkv (120 programs) took 3.5 against 3.8 and Llama-3-8B's (K 4096) 16.7
# against 19.2.
NORM_SHORT_STEPS = 2
NORM_PIPELINE_MAX_PROGRAMS_PER_SM = 2

# Launch parameters: the fastest of the swept configurations for qkv and o_proj at one row on
# the H200 (`benchmarks/bench_gemv_sweeps.py --sweep`).
# LOOP_STAGES: key steps in flight in the loop (`tl.range`'s software pipelining of loads that
# feed no dot; the kernel's num_stages pipelines only those that do). Measured on the H200
# (`bench_gemv_sweeps.py --loop-stages`), 3 against 1: one-row products of at most 5.8
# programs an SM take 15-28% less time (Llama-3-8B's bf16 qkv and o_proj, SmolLM2-135M's fp32
# qkv, o_proj and down; gate_up the same), 13-row fp32 ones 6-20% less; at 46 programs an SM
# (SmolLM2's output layer, one row) 19% more: resident programs hide the latency there
# already, and the pipeline's buffers cost occupancy. So 1 from PIPELINE_MAX_PROGRAMS_PER_SM on.
GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3, LOOP_STAGES=3)
PIPELINE_MAX_PROGRAMS_PER_SM = 16


def _loop_stages(stages: int, programs: int, num_sms: int) -> int:
    """`stages` below PIPELINE_MAX_PROGRAMS_PER_SM programs an SM, else 1."""
    return stages if programs < PIPELINE_MAX_PROGRAMS_PER_SM * num_sms else 1


def rows_config(columns: int, num_sms: int, silu_mul: bool = False) -> dict:
    """The all-rows kernel's launch for a weight of `columns` output columns (with
    `silu_mul`: columns of SiLU*mul's output, each reading a gate and an up row) on `num_sms`
    SMs: ROWS_BLOCK_N columns a program (ROWS_SILU_BLOCK_N with `silu_mul`), ROWS_PRODUCTS
    products a row per key step, ROWS_LOOP_STAGES key steps in flight (none from
    PIPELINE_MAX_PROGRAMS_PER_SM programs an SM on), loads in 3-d blocks where ROWS_LOAD_3D says."""
    block_n = ROWS_SILU_BLOCK_N if silu_mul else ROWS_BLOCK_N
    return dict(
        BLOCK_N=block_n,
        BLOCK_K=ROWS_PRODUCTS // block_n,
        num_warps=4,
        num_stages=3,
        LOOP_STAGES=_loop_stages(ROWS_LOOP_STAGES, triton.cdiv(columns, block_n), num_sms),
        LOAD_3D=ROWS_LOAD_3D == "all" or (ROWS_LOAD_3D == "plain" and not silu_mul),
        all_rows=True,
    )


def kernel_takes(rows: int, dtype: torch.dtype, weight_shape: tuple[int, ...]) -> bool:
    """Whether a product of `rows` x rows of `dtype` with a weight of `weight_shape` (N, K)
    runs in the package's kernels on CUDA (`linear_config` gives it a launch): one row of any
    dtype with weights up to MAX_WEIGHT_ELEMENTS, or float32 up to MAX_ROWS rows with weights
    up to ROWS_MAX_WEIGHT_ELEMENTS (ROWS_WIDE_MAX_WEIGHT_ELEMENTS with ROWS_WIDE_CONFIG); cuBLAS's
    elsewhere."""
    elements = weight_shape[0] * weight_shape[1]
    if rows == LINEAR_ROWS:
        return elements <= MAX_WEIGHT_ELEMENTS
    wide = ROWS_WIDE_CONFIG is not None and elements <= ROWS_WIDE_MAX_WEIGHT_ELEMENTS
    return (
        dtype == torch.float32
        and LINEAR_ROWS < rows <= MAX_ROWS
        and (elements <= ROWS_MAX_WEIGHT_ELEMENTS or wide)
    )


@functools.lru_cache(maxsize=1024)
def linear_config(
    rows: int, dtype: torch.dtype, weight_shape: tuple[int, int], num_sms: int
) -> dict | None:
    """The kernel's launch for an x of `rows` rows against a weight of `weight_shape` (N, K)
    (GEMV_CONFIG, `rows_config`, ROWS_WIDE_CONFIG past ROWS_MAX_WEIGHT_ELEMENTS; LOOP_STAGES
    by the programs an SM), or None where cuBLAS is the faster (`kernel_takes`). Cached
    (every product of a pass asks); the caller must not change the dict."""
    if not kernel_takes(rows, dtype, weight_shape):
        return None
    if rows == LINEAR_ROWS:
        programs = triton.cdiv(weight_shape[0], GEMV_CONFIG["BLOCK_N"])
        stages = _loop_stages(GEMV_CONFIG["LOOP_STAGES"], programs, num_sms)
        return dict(GEMV_CONFIG, LOOP_STAGES=stages)
    if weight_shape[0] * weight_shape[1] > ROWS_MAX_WEIGHT_ELEMENTS:
        assert ROWS_WIDE_CONFIG is not None  # `kernel_takes` takes a wide weight only with it
        return dict(ROWS_WIDE_CONFIG, all_rows=True)
    return rows_config(weight_shape[0], num_sms)


def norm_config(config: dict, weight_shape: tuple[int, int], num_sms: int) -> dict:
    """The one-row launch `config` (`linear_config`'s) for the product with the norm as its
    prologue: its key steps not pipelined where there are NORM_SHORT_STEPS or fewer and the
    launch has NORM_PIPELINE_MAX_PROGRAMS_PER_SM or more programs an SM."""
    programs = triton.cdiv(weight_shape[0], config["BLOCK_N"])
    short = weight_shape[1] <= NORM_SHORT_STEPS * config["BLOCK_K"]
    if short and programs >= NORM_PIPELINE_MAX_PROGRAMS_PER_SM * num_sms:
        return dict(config, LOOP_STAGES=1)
    return config
