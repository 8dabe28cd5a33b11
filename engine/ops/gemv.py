"""Which matrix products go to the Triton matrix-vector kernels (`engine.ops.gemv_kernels`),
their launch configurations, and the launches: the linear layers of batch-1 decode, and fp32
passes of a few rows (a small model's verify pass).

At batch 1 a decode step's projections are matrix-vector products: all the time is spent
streaming the weight matrix once. cuBLAS picks split-K GEMM tiles for the narrower of them
(qkv and o_proj at Llama-3-8B's shape ran at 3.2 and 2.7 TB/s on an H200, plus a split-K
reduce launch), against ~4.2 TB/s for a copy. The one-row kernel streams whole weight rows
once: one launch, no reduction pass, fp32 accumulation.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from engine import pdl
from engine.ops.gemv_kernels import NORM, PLAIN, SILU, gemv_kernel, gemv_rows_kernel

MAX_ROWS = 16  # x rows the kernel accepts (a verify pass of a 12-draft tree has 13)
# `linear` takes the kernel for one row and weights up to MAX_WEIGHT_ELEMENTS: every weight
# measured. At one row (`bench_gemv.py --rows 1 --max-weight-elements 1073741824`,
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
# SM, 256 products, 4 steps). `bench_gemv.py --loop-stages` and `--fused` (`--shapes
# smollm2_135m --dtype float32 --rows 13`, docs/benchmarks.md): qkv 4.8, o_proj 4.6, down
# 7.1 us, gate_up with SiLU*mul 7.4, against 4.9, 5.1, 7.0 and 8.6 before; the verify pass
# 4% faster.
ROWS_BLOCK_N = 8
ROWS_SILU_BLOCK_N = 16
ROWS_PRODUCTS = 512
ROWS_LOOP_STAGES = 8
# float32 rows on a wider weight, past ROWS_MAX_WEIGHT_ELEMENTS up to ROWS_WIDE_MAX_WEIGHT_ELEMENTS
# (a small model's output layer: SmolLM2-135M's 49152 x 576), take the all-rows kernel with
# ROWS_WIDE_CONFIG (None: cuBLAS's product). Swept on an H100 at that shape (`bench_gemv.py
# --shapes smollm2_135m --dtype float32 --rows 8,13 --only lm_head --sweep --wide`, 108
# launches: tiles of 8-256 columns by 4-64 keys, 4 or 8 warps, 1-8 key steps in flight, loads
# flat or in 3-d blocks): 16 columns by 32 keys, 8 steps in flight, was the fastest at 8
# rows (45.6 us against cuBLAS's 68.4) and in sum over 8 and 13 (59.2 against 66.3; the
# fastest there, 64 x 16 with 4 steps, 57.0). The launches of `rows_config` took 65.3 and
# 116.3 us: its 6144 programs run unpipelined.
ROWS_WIDE_CONFIG: dict | None = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, LOOP_STAGES=8)
ROWS_WIDE_MAX_WEIGHT_ELEMENTS = 32 * 2**20  # the widest weight timed so is 28M elements


def _switch(name: str) -> bool:
    """An on/off environment variable: unset, "" or "0" off, "1" on; anything else refused."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset); got {value!r}")
    return value == "1"


# ENGINE_ROWS_LOAD_3D=1: the all-rows launches load x's rows and the weight tiles as 3-d
# blocks (`gemv_rows_kernel`'s LOAD_3D), whose accumulator holds a few keys a thread. Compiled
# for sm_90 at a verify pass's 13 rows, the sum over the keys after the loop shrinks from 322
# shuffles a thread to 64 (o_proj; its code 1224 instructions long against 608), for 115
# registers against 96 (one program an SM either way). Off: timed on an H100, the narrow
# products shorten (0.75-0.92x), gate_up lengthens (1.11-1.29x) and a verify pass of the default
# model's shapes runs 1.04-1.14x slower (docs/benchmarks.md, "The opt-in variants timed").
ROWS_LOAD_3D = _switch("ENGINE_ROWS_LOAD_3D")


# The NORM prologue needs no pass over the row before the products: RMSNorm(x) . w =
# (x * norm_w) . w / RMS(x), so the key loop sums x's squares beside the products and each
# sum is scaled by 1 / RMS at the end. `norm_linear` and `silu_mul_linear` fuse one-row
# products, in the row-at-a-time kernel. Measured on the H200 (`bench_gemv.py --fused`): at
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
# With PDL (`engine.pdl`) a launch prefetches the first columns of its weight rows into
# L2 while the kernel before it runs, at most PREFETCH_BYTES of them (ENGINE_PREFETCH_BYTES
# sets it for a process; 0: none).
PREFETCH_BYTES = int(os.environ.get("ENGINE_PREFETCH_BYTES", 16 * 2**20))


GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3, LOOP_STAGES=3)
PIPELINE_MAX_PROGRAMS_PER_SM = 16


def _loop_stages(stages: int, programs: int, num_sms: int) -> int:
    """`stages` below PIPELINE_MAX_PROGRAMS_PER_SM programs an SM, else 1."""
    return stages if programs < PIPELINE_MAX_PROGRAMS_PER_SM * num_sms else 1


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"{what} needs x [M, K] and weight [N, K] with K = {k}; got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{what} serves 1 to {MAX_ROWS} rows; got {x.shape[0]} (use F.linear)")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"{what} needs unit stride along K; got x strides {x.stride()}, "
            f"weight strides {weight.stride()}"
        )


def _pdl_params(weight: torch.Tensor) -> dict:
    """The launch's PDL arguments (`pdl.launch`) and, with PDL, its weight prefetch."""
    launch = pdl.launch(weight.device, "products")
    if not launch["PDL"]:
        return {**launch, **_NO_PREFETCH}
    return {**launch, **_prefetch(tuple(weight.shape), weight.element_size())}


_NO_PREFETCH = {"PREFETCH_K": 0, "LINE": 1}


@functools.lru_cache(maxsize=256)
def _prefetch(shape: tuple[int, int], element_size: int) -> dict:
    """The prefetch arguments for a weight of `shape`: the first PREFETCH_K columns of each
    row prefetched before the wait (a power of two, at most PREFETCH_BYTES in all)."""
    (n, k), line = shape, pdl.LINE_BYTES // element_size
    budget = max(PREFETCH_BYTES // (n * element_size), 1)
    cols = min(triton.next_power_of_2(k), 1 << budget.bit_length() - 1)
    return {"PREFETCH_K": cols if cols >= line else 0, "LINE": line}


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    config: dict | None,
    prologue: int = PLAIN,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x' @ weight^T, the residual stream written by the NORM prologue or None)."""
    rows, n = x.shape[0], weight.shape[0]
    params = dict(GEMV_CONFIG, **(config or {}))
    if params.pop("all_rows", False):
        if prologue == SILU:
            raise ValueError(
                "the all-rows kernel (config all_rows) takes no SiLU*mul before its "
                "products; that prologue runs in the row-at-a-time kernel (config None)"
            )
        return _launch_rows(x, weight, params, silu_mul=False, norm=norm)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, params["BLOCK_N"]),)
    residual_out, pointers, eps, norm_strides = _norm_args(x, norm)
    gemv_kernel[grid](
        x,
        weight,
        out,
        *pointers,
        rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *norm_strides,
        BLOCK_M=triton.next_power_of_2(rows),
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual_out is not None,
        **params,
        **_pdl_params(weight),
    )
    return out, residual_out


def _norm_args(
    x: torch.Tensor, norm: tuple[torch.Tensor | None, torch.Tensor, float] | None
) -> tuple[torch.Tensor | None, tuple, float, tuple[int, int]]:
    """What a launch passes for `norm` (residual or None, norm weight, eps; None: a launch
    without the NORM prologue): (the residual stream's new tensor, None without a residual;
    the residual, norm weight and stream pointers, x for those the kernel never reads; eps;
    the residual's and the stream's row strides)."""
    residual, norm_w, eps = norm if norm is not None else (None, x, 0.0)
    residual_out = torch.empty_like(x) if residual is not None else None
    pointers = (
        x if residual is None else residual,
        norm_w,
        x if residual_out is None else residual_out,
    )
    strides = (
        0 if residual is None else residual.stride(0),
        0 if residual_out is None else residual_out.stride(0),
    )
    return residual_out, pointers, eps, strides


def _launch_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    params: dict,
    silu_mul: bool,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the all-rows kernel's output: x' @ weight^T [rows, N], or (silu_mul) SiLU*mul of the
    products with weight's first half of rows and its second [rows, N / 2]; the residual
    stream the NORM prologue wrote, or None). x' is x, or with `norm` (residual or None,
    norm weight, eps) RMSNorm(x + residual)."""
    (rows, k), n = x.shape, weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    residual_out, pointers, eps, norm_strides = _norm_args(x, norm)
    gemv_rows_kernel[(triton.cdiv(n, params["BLOCK_N"]),)](
        x,
        weight,
        out,
        *pointers,
        rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *norm_strides,
        BLOCK_M=triton.next_power_of_2(rows),
        WITH_NORM=norm is not None,
        HAS_RESIDUAL=residual_out is not None,
        SILU_MUL=silu_mul,
        **params,
        **_pdl_params(weight),
    )
    return out, residual_out


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS (as F.linear
    without bias). `config` overrides the launch parameters (benchmarks)."""
    k = x.shape[-1]
    _check(x, weight, k, "gemv")
    return _launch(x, weight, k, config)[0]


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight^T, x + residual) in one launch (residual None:
    RMSNorm(x), and x is the stream), in either kernel (`config` all_rows: the all-rows
    kernel). The stream is rounded as the RMSNorm op rounds it; the product scales x's row
    by 1 / RMS after the sum, not before, so it differs from the op and `gemv` in rounding
    only."""
    k = x.shape[-1]
    _check(x, weight, k, "norm_gemv")
    _check_norm(x, residual, norm_weight, k, "norm_gemv")
    out, residual_out = _launch(x, weight, k, config, NORM, (residual, norm_weight, eps))
    return out, x if residual_out is None else residual_out


def _check_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, k: int, what: str
) -> None:
    if norm_weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"{what} needs norm_weight [{k}] and a residual shaped as x {tuple(x.shape)}; "
            f"got {tuple(norm_weight.shape)} and "
            f"{None if residual is None else tuple(residual.shape)}"
        )
    if residual is not None and residual.stride(1) != 1:
        raise ValueError(f"{what} needs a unit-stride residual; got {residual.stride()}")


def silu_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """(SiLU(gate) * up) @ weight^T from gate_up [M, 2 * inter] (gate first) in one launch,
    as the SiLU*mul op then `gemv` round and compute it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_gemv needs gate_up [M, 2 * inter]; got {tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    _check(gate_up, weight, inter, "silu_gemv")
    return _launch(gate_up, weight, inter, config, SILU)[0]


def gemv_silu(x: torch.Tensor, weight: torch.Tensor, config: dict) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) [M, inter] from weight = [gate; up] [2 * inter, K] in
    one launch of the all-rows kernel (`config`: an all_rows launch, e.g. `rows_config`
    for inter columns), as the product then the SiLU*mul op round and compute it: the
    gate_up product never reaches memory and no SiLU*mul launch follows."""
    return _launch_silu_rows(x, weight, config, None, "gemv_silu")[0]


def norm_gemv_silu(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`gemv_silu` of RMSNorm(x + residual), x + residual) in one launch of the all-rows
    kernel: the norm as `norm_gemv` computes it (1 / RMS after the sums), then SiLU*mul after
    the products, so a float32 verify pass's MLP is two launches, this and the down product."""
    _check_norm(x, residual, norm_weight, x.shape[-1], "norm_gemv_silu")
    out, residual_out = _launch_silu_rows(
        x, weight, config, (residual, norm_weight, eps), "norm_gemv_silu"
    )
    return out, x if residual_out is None else residual_out


def _launch_silu_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: dict,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"{what} needs weight [2 * inter, K]; got {tuple(weight.shape)}")
    _check(x, weight, x.shape[-1], what)
    params = dict(GEMV_CONFIG, **config)
    if not params.pop("all_rows", False):
        raise ValueError(
            f"{what} runs in the all-rows kernel: its config needs all_rows; got {config}"
        )
    return _launch_rows(x, weight, params, silu_mul=True, norm=norm)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_config(columns: int, num_sms: int, silu_mul: bool = False) -> dict:
    """The all-rows kernel's launch for a weight of `columns` output columns (with
    `silu_mul`: columns of SiLU*mul's output, each reading a gate and an up row) on `num_sms`
    SMs: ROWS_BLOCK_N columns a program (ROWS_SILU_BLOCK_N with `silu_mul`), ROWS_PRODUCTS
    products a row per key step, ROWS_LOOP_STAGES key steps in flight (none from
    PIPELINE_MAX_PROGRAMS_PER_SM programs an SM on), loads in 3-d blocks with ROWS_LOAD_3D."""
    block_n = ROWS_SILU_BLOCK_N if silu_mul else ROWS_BLOCK_N
    return dict(
        BLOCK_N=block_n,
        BLOCK_K=ROWS_PRODUCTS // block_n,
        num_warps=4,
        num_stages=3,
        LOOP_STAGES=_loop_stages(ROWS_LOOP_STAGES, triton.cdiv(columns, block_n), num_sms),
        LOAD_3D=ROWS_LOAD_3D,
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


def _kernel_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """`linear_config` for x against weight where the kernel can take them (CUDA, unit
    stride along K), else None."""
    if (
        x.is_cuda
        and x.dim() == 2
        and isinstance(weight, torch.Tensor)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    ):
        return linear_config(x.shape[0], x.dtype, tuple(weight.shape), _num_sms(x.device))
    return None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), with the matrix-vector kernel where it is the faster (on CUDA:
    `linear_config`)."""
    config = _kernel_config(x, weight)
    if config is not None:
        return gemv(x, weight, config)
    return torch.nn.functional.linear(x, weight)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`norm_gemv` where the kernel is the faster for the product (`linear_config`): one
    row, or float32 rows in the all-rows kernel; None elsewhere (the caller runs the norm
    and `linear`)."""
    config = _kernel_config(x, weight)
    if config is None or (residual is not None and residual.stride(-1) != 1):
        return None
    if config.get("all_rows"):
        return norm_gemv(x, residual, norm_weight, eps, weight, config)
    if x.shape[0] != FUSED_ROWS:
        return None
    launch = norm_config(config, (weight.shape[0], weight.shape[1]), _num_sms(x.device))
    return norm_gemv(x, residual, norm_weight, eps, weight, launch)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`silu_gemv` for one row where the kernel is the faster for the product
    (`linear_config`); None elsewhere (the caller runs SiLU*mul and `linear`)."""
    config = _kernel_config(gate_up, weight)
    if config is None or gate_up.shape[0] != FUSED_ROWS:
        return None
    return silu_gemv(gate_up, weight, config)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`gemv_silu` (SiLU*mul of x's product with weight = [gate; up]) where the all-rows
    kernel is the faster for the product (`linear_config`: float32, 2 to MAX_ROWS rows);
    None elsewhere (the caller runs `linear` and SiLU*mul)."""
    config = _kernel_config(x, weight)
    if config is None or not config.get("all_rows") or weight.shape[0] % 2:
        return None
    return gemv_silu(
        x, weight, rows_config(weight.shape[0] // 2, _num_sms(x.device), silu_mul=True)
    )


def norm_linear_silu_mul(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`norm_gemv_silu` (the norm before the gate_up product and SiLU*mul after it) where
    the all-rows kernel is the faster for the product (`linear_config`: float32, 2 to
    MAX_ROWS rows); None elsewhere (the caller fuses what else applies)."""
    config = _kernel_config(x, weight)
    if (
        config is None
        or not config.get("all_rows")
        or weight.shape[0] % 2
        or (residual is not None and residual.stride(-1) != 1)
    ):
        return None
    launch = rows_config(weight.shape[0] // 2, _num_sms(x.device), silu_mul=True)
    return norm_gemv_silu(x, residual, norm_weight, eps, weight, launch)
