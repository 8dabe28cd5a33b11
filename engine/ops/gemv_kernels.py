"""The Triton kernels of `engine.ops.gemv`: matrix-vector products for the linear layers of
batch-1 decode, and the all-rows product of a few float32 rows (a small model's verify pass).

`gemv_kernel` gives each program `BLOCK_N` whole weight rows (contiguous in memory), walks
them in `BLOCK_K` steps with the loads pipelined, and keeps every row of x in registers: one
launch, no reduction pass, fp32 accumulation. `gemv_rows_kernel` does the same for all of x's
rows at once, each weight tile loaded once for every row. Both take a prologue applied to x's
rows before the products (`PLAIN`, `NORM`, `SILU`, `_x_block`). Which launch a product gets,
and its configuration, is `engine.ops.gemv_policy`'s; `engine.ops.gemv` launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.pdl import enter, leave, prefetch_l2

PLAIN, NORM, SILU = 0, 1, 2  # what a kernel does to x's rows before the products


@triton.jit
def _x_block(
    x,
    residual,
    norm_w,
    residual_out,
    row_offs,
    key_offs,
    mask,
    key_mask,
    write_residual,
    stride_xm,
    stride_rm,
    stride_ro,
    K,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """(x's rows `row_offs` at columns `key_offs` as fp32 after the prologue, the squares to
    sum for NORM), shaped as the offsets broadcast ([rows, keys], or [rows, 1, keys]; `mask`
    the same, `key_mask` the keys'): PLAIN x; NORM x (+ residual, rounded to x's dtype and
    stored to residual_out where `write_residual`) scaled by norm_w, not yet by 1 / RMS; SILU
    SiLU(gate) * up of x = [gate | up] (K columns each), rounded as the SiLU*mul op rounds
    it."""
    row_ptrs = x + row_offs * stride_xm + key_offs
    if PROLOGUE == 2:
        gate = tl.load(row_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row_ptrs + K, mask=mask, other=0.0)
        xs = (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
        squares = xs
    else:
        values = tl.load(row_ptrs, mask=mask, other=0.0)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:
                added = values.to(tl.float32) + tl.load(
                    residual + row_offs * stride_rm + key_offs, mask=mask, other=0.0
                ).to(tl.float32)
                values = added.to(values.dtype)
                tl.store(
                    residual_out + row_offs * stride_ro + key_offs,
                    values,
                    mask=mask & write_residual,
                )
            values32 = values.to(tl.float32)
            scale = tl.load(norm_w + key_offs, mask=key_mask, other=0.0).to(tl.float32)
            xs = values32 * scale
            squares = values32 * values32
        else:
            xs = values.to(tl.float32)
            squares = xs
    return xs, squares


@triton.jit
def _prefetch_rows(w, w_rows, in_n, K, PREFETCH_K: tl.constexpr, LINE: tl.constexpr):
    """Prefetch the first PREFETCH_K columns of the program's weight rows into L2, a line
    (LINE elements) a time. Weights: no kernel of the stream writes them, so this may run
    before `enter`, beside the kernel before."""
    if PREFETCH_K > 0:
        # lines past a row's end fetch its last line again (not one shared address: every
        # program asking for the same line would queue at one L2 slice)
        lines = tl.minimum(tl.arange(0, PREFETCH_K // LINE) * LINE, K - 1)
        prefetch_l2(tl.where(in_n[:, None], w_rows + lines[None, :], w))


@triton.jit
def gemv_kernel(
    x,
    w,
    out,
    residual,
    norm_w,
    residual_out,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_ro,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
):
    """One x row at a time: each program's BLOCK_N weight rows against the row, summed
    across the threads at every key step."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    _prefetch_rows(w, w_rows, in_n, K, PREFETCH_K, LINE)
    enter(PDL)
    first = tl.program_id(0) == 0  # the program that writes the residual stream
    for m in tl.static_range(BLOCK_M):
        if m < M:
            row = m + tl.arange(0, 1)
            in_m = row < M
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            sum_squares = tl.zeros([1, BLOCK_K], dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
                ks = k0 + tl.arange(0, BLOCK_K)
                in_k = ks < K
                tile = tl.load(w_rows + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
                xs, squares = _x_block(
                    x,
                    residual,
                    norm_w,
                    residual_out,
                    row[:, None],
                    ks[None, :],
                    in_m[:, None] & in_k[None, :],
                    in_k[None, :],
                    first,
                    stride_xm,
                    stride_rm,
                    stride_ro,
                    K,
                    PROLOGUE,
                    HAS_RESIDUAL,
                )
                acc += tl.sum(tile.to(tl.float32) * xs, axis=1)
                if PROLOGUE == 1:
                    sum_squares += squares
            if PROLOGUE == 1:
                acc = acc * tl.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)
            leave(PDL)
            tl.store(out + m * stride_om + cols, acc.to(out.dtype.element_ty), mask=in_n)


@triton.jit
def gemv_rows_kernel(
    x,
    w,
    out,
    residual,
    norm_w,
    residual_out,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_ro,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WITH_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
    LOAD_3D: tl.constexpr = False,
):
    """All x rows at once: each weight tile is loaded once for every row; the products
    accumulate elementwise in [rows, columns, keys] and are summed over the keys once, at
    the end (no reduction across threads inside the loop). WITH_NORM: x's rows go through
    `_x_block`'s NORM prologue (program 0 writes the residual stream) and each sum is scaled
    by its row's 1 / RMS, as in the row-at-a-time kernel. SILU_MUL: w is [gate; up] (2N
    rows) and out gets SiLU(x @ gate^T) * (x @ up^T), each product rounded to out's dtype
    first, as the SiLU*mul op after the product rounds them. LOAD_3D: x's rows and the
    weight tiles are loaded as [rows, 1, keys] and [1, columns, keys] blocks rather than
    loaded flat and broadcast, so that the accumulator takes the loads' layout (a few
    consecutive keys a thread) and the sum over the keys at the end shuffles less between
    threads (sm_90, 13 rows: o_proj's 322 shuffles a thread -> 64)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    in_n = cols < N
    in_m = rows < M
    w_rows = w + cols.to(tl.int64)[:, None] * stride_wn
    _prefetch_rows(w, w_rows, in_n, K, PREFETCH_K, LINE)
    if SILU_MUL:
        _prefetch_rows(w, w_rows + N * stride_wn, in_n, K, PREFETCH_K, LINE)
    enter(PDL)
    first = tl.program_id(0) == 0  # the program that writes the residual stream
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K] if SILU_MUL else [1, 1, 1], dtype=tl.float32)
    if LOAD_3D:
        w_block = w + cols.to(tl.int64)[None, :, None] * stride_wn  # [1, columns, 1]
        sum_squares = tl.zeros([BLOCK_M, 1, BLOCK_K] if WITH_NORM else [1, 1, 1], tl.float32)
    else:
        w_block = w_rows  # [columns, 1]
        sum_squares = tl.zeros([BLOCK_M, BLOCK_K] if WITH_NORM else [1, 1], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        if LOAD_3D:
            row_offs, key_offs, key_mask = (
                rows[:, None, None],
                ks[None, None, :],
                in_k[None, None, :],
            )
            x_mask = in_m[:, None, None] & key_mask
            tile_mask = in_n[None, :, None] & key_mask
        else:
            row_offs, key_offs, key_mask = rows[:, None], ks[None, :], in_k[None, :]
            x_mask = in_m[:, None] & key_mask
            tile_mask = in_n[:, None] & key_mask
        tile = tl.load(w_block + key_offs, mask=tile_mask, other=0.0).to(tl.float32)
        xs, squares = _x_block(
            x,
            residual,
            norm_w,
            residual_out,
            row_offs,
            key_offs,
            x_mask,
            key_mask,
            first,
            stride_xm,
            stride_rm,
            stride_ro,
            K,
            1 if WITH_NORM else 0,  # the NORM prologue, or none
            HAS_RESIDUAL,
        )
        if WITH_NORM:
            sum_squares += squares
        if SILU_MUL:
            up = tl.load(w_block + N * stride_wn + key_offs, mask=tile_mask, other=0.0)
            up = up.to(tl.float32)
        if LOAD_3D:  # [rows, 1, keys] x [1, columns, keys]
            acc += xs * tile
            if SILU_MUL:
                acc_up += xs * up
        else:
            acc += xs[:, None, :] * tile[None, :, :]
            if SILU_MUL:
                acc_up += xs[:, None, :] * up[None, :, :]
    sums = tl.sum(acc, axis=2)
    if WITH_NORM:
        if LOAD_3D:
            inv_rms = tl.rsqrt(tl.sum(sum_squares, axis=2) / K + eps)  # [rows, 1]
        else:
            inv_rms = tl.rsqrt(tl.sum(sum_squares, axis=1) / K + eps)[:, None]
        sums = sums * inv_rms
    leave(PDL)
    if SILU_MUL:
        gate = sums.to(out.dtype.element_ty).to(tl.float32)
        up_sums = tl.sum(acc_up, axis=2)
        if WITH_NORM:
            up_sums = up_sums * inv_rms
        up_sums = up_sums.to(out.dtype.element_ty).to(tl.float32)
        sums = gate * tl.sigmoid(gate) * up_sums
    tl.store(
        out + rows[:, None] * stride_om + cols[None, :],
        sums.to(out.dtype.element_ty),
        mask=in_m[:, None] & in_n[None, :],
    )
