"""A Triton matrix-vector kernel for the linear layers of batch-1 decode (and of fp32 passes
of a few rows: a small model's verify pass).

At batch 1 a decode step's projections are matrix-vector products: all the time is spent
streaming the weight matrix once. cuBLAS picks split-K GEMM tiles for the narrower of them
(qkv and o_proj at Llama-3-8B's shape ran at 3.2 and 2.7 TB/s on an H200, plus a split-K
reduce launch), against ~4.2 TB/s for a copy. This kernel gives each program `BLOCK_N` whole
weight rows (contiguous in memory), walks them in `BLOCK_K` steps with the loads pipelined,
and keeps every row of x in registers: one launch, no reduction pass, fp32 accumulation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # x rows the kernel accepts (a verify pass of a 12-draft tree has 13)
# `linear` takes the kernel for one row and weights up to MAX_WEIGHT_ELEMENTS. Measured on the
# H200 (bench_gemv.py, docs/benchmarks.md): at one row qkv (25M elements) runs at 1.05-1.07x
# and o_proj (17M) at 1.10-1.11x cuBLAS's speed, but gate_up (117M) at 0.99x and down (59M)
# at 0.90x, where cuBLAS already streams at ~4 TB/s; at 2 and 4 rows the one-row kernel
# re-reads the weights per row and falls to 0.24-0.74x, so bf16 rows stay with cuBLAS.
LINEAR_ROWS = 1
MAX_WEIGHT_ELEMENTS = 32 * 2**20
# float32 products of 2..MAX_ROWS rows (a small model's verify pass: 13) go to the all-rows
# kernel up to ROWS_MAX_WEIGHT_ELEMENTS: cuBLAS runs them on SIMT tiles with a split-K reduce.
# On the H200 at SmolLM2-135M's shapes and 13 rows (`bench_gemv.py --shapes smollm2_135m
# --dtype float32 --rows 13 --sweep`) the kernel's best launches took 6.3-10.7 us against
# cuBLAS's 10.1-13.5 us for qkv, o_proj, gate_up and down (0.55M-1.8M elements), but 92 us
# against 64 us for the 28M-element output layer.
ROWS_MAX_WEIGHT_ELEMENTS = 4 * 2**20
# The all-rows launch (`rows_config`): on the H200's 132 SMs the fastest swept launches were
# the widest tiles that still made 1.8 or more programs an SM (BLOCK_N 8 for 3072 columns: 384
# programs; 4 for 960: 240; 2 for 576: 288), with 512 or fewer products a row per key step
# (BLOCK_N x BLOCK_K), eight warps for the narrowest tiles.
ROWS_PROGRAMS_PER_SM = 1.75
ROWS_PRODUCTS = 512


@triton.jit
def _gemv_kernel(
    x,
    w,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    for m in tl.static_range(BLOCK_M):
        if m < M:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                in_k = ks < K
                tile = tl.load(w_rows + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
                xs = tl.load(x + m * stride_xm + ks, mask=in_k, other=0.0)
                acc += tl.sum(tile.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
            tl.store(out + m * stride_om + cols, acc.to(out.dtype.element_ty), mask=in_n)


@triton.jit
def _gemv_rows_kernel(
    x,
    w,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """All x rows at once: each weight tile is loaded once for every row; the products
    accumulate elementwise in [rows, columns, keys] and are summed over the keys once, at
    the end (no reduction across threads inside the loop)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    in_n = cols < N
    in_m = rows < M
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        tile = tl.load(w_rows + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
        xs = tl.load(
            x + rows[:, None] * stride_xm + ks[None, :],
            mask=in_m[:, None] & in_k[None, :],
            other=0.0,
        )
        acc += xs.to(tl.float32)[:, None, :] * tile.to(tl.float32)[None, :, :]
    tl.store(
        out + rows[:, None] * stride_om + cols[None, :],
        tl.sum(acc, axis=2).to(out.dtype.element_ty),
        mask=in_m[:, None] & in_n[None, :],
    )


# Launch parameters: the fastest of the swept configurations for qkv and o_proj at one row on
# the H200 (`benchmarks/bench_gemv.py --sweep`).
GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS (as F.linear
    without bias). `config` overrides the launch parameters (benchmarks)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv serves 1 to {MAX_ROWS} rows; got {rows} (use F.linear)")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"gemv needs unit stride along K; got x strides {x.stride()}, "
            f"weight strides {weight.stride()}"
        )
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    params = dict(GEMV_CONFIG, **(config or {}))
    kernel = _gemv_rows_kernel if params.pop("all_rows", False) else _gemv_kernel
    grid = (triton.cdiv(n, params["BLOCK_N"]),)
    kernel[grid](
        x,
        weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=triton.next_power_of_2(rows),
        **params,
    )
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_config(columns: int, num_sms: int) -> dict:
    """The all-rows kernel's launch for a weight of `columns` output columns on `num_sms` SMs:
    the widest BLOCK_N of 8, 4, 2 that keeps ROWS_PROGRAMS_PER_SM programs an SM (2 if
    none does), BLOCK_K up to ROWS_PRODUCTS / BLOCK_N."""
    block_n = next(
        (n for n in (8, 4) if triton.cdiv(columns, n) >= ROWS_PROGRAMS_PER_SM * num_sms), 2
    )
    block_k = min(128, ROWS_PRODUCTS // block_n)
    return dict(
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8 if block_n * block_k < ROWS_PRODUCTS else 4,
        num_stages=3,
        all_rows=True,
    )


def linear_config(
    rows: int, dtype: torch.dtype, weight_shape: tuple[int, int], num_sms: int
) -> dict | None:
    """The kernel's launch for an x of `rows` rows against a weight of `weight_shape` (N, K)
    (GEMV_CONFIG, `rows_config`), or None where cuBLAS is the faster: one row of any dtype
    with weights up to MAX_WEIGHT_ELEMENTS, or float32 up to MAX_ROWS rows with weights up to
    ROWS_MAX_WEIGHT_ELEMENTS."""
    elements = weight_shape[0] * weight_shape[1]
    if rows == LINEAR_ROWS and elements <= MAX_WEIGHT_ELEMENTS:
        return GEMV_CONFIG
    if (
        dtype == torch.float32
        and LINEAR_ROWS < rows <= MAX_ROWS
        and elements <= ROWS_MAX_WEIGHT_ELEMENTS
    ):
        return rows_config(weight_shape[0], num_sms)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), with the matrix-vector kernel where it is the faster (on CUDA:
    `linear_config`)."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1:
        config = linear_config(x.shape[0], x.dtype, tuple(weight.shape), _num_sms(x.device))
        if config is not None:
            return gemv(x, weight, config)
    return torch.nn.functional.linear(x, weight)
