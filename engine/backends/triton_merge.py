"""The merge of split-KV attention: each split's partial output and log-sum (base 2) per
(token, q head) combine into the output, rescaled by their log-sums.

Two ways to run it: `merge_splits` launches a kernel over (tokens, q heads) after the split
kernel; or the split kernel merges in the last of each (request, kv head)'s programs to
finish (`last_to_arrive`, then `merge_rows`), counting arrivals in `merge_counters`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.backends.base import BufferTooSmall
from engine.pdl import enter

MERGE_VALUES_PER_THREAD = 64  # fp32 partial values a thread holds in the fused merge's tile


def pow2_floor(value: float) -> int:
    """The largest power of two <= value (1 below 2)."""
    return 1 << max(int(value), 1).bit_length() - 1


@triton.jit
def last_to_arrive(counter, num_splits):
    """Count this split program in at `counter`; True in the last of num_splits to arrive.

    Memory order (the "last block reduces" semaphore): the barrier makes every thread's
    partial and lse stores precede, in this program, the one thread's atomic add; the add is
    a release at GPU scope, and release is cumulative, so those stores are visible GPU-wide
    before the count. The add that reads num_splits - 1 comes after every other split's add
    in the counter's modification order (read-modify-writes chain: a release sequence) and
    is an acquire, so it synchronizes with each of them: every split's stores happen before
    the last one's loads. Its other threads follow the acquire through the barrier Triton
    places after a scalar atomic (it broadcasts the result through shared memory). The
    merge's loads bypass L1 (.cg): an SM's L1 is not coherent and must not serve a line
    cached before the stores. The last program puts the counter back to 0 with a plain
    store: nothing else touches it in this launch, and the next launch on the stream starts
    after this one has finished (a kernel that started early, by programmatic dependent
    launch, on the same counters would race)."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1


@triton.jit
def merge_rows(
    partial,
    lse,
    out,
    qo_start,
    num_rows,
    kv_head,
    num_splits,
    num_tokens,
    out_capacity,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Merge the splits of num_rows rows (row r: token qo_start + r // GROUP, q head
    kv_head * GROUP + r % GROUP) into out: ROW_BLOCK rows x SPLIT_CHUNK splits x HEAD_DIM
    loaded at once (one L2 round trip where the tile holds them all), combined by online
    rescaling across chunks of splits. Loads bypass L1 (see `last_to_arrive`)."""
    dims = tl.arange(0, HEAD_DIM)
    chunk = tl.arange(0, SPLIT_CHUNK)
    for first_row in range(0, num_rows, ROW_BLOCK):
        rows = first_row + tl.arange(0, ROW_BLOCK)
        token = (qo_start + rows // GROUP).to(tl.int64)
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < num_rows) & (token < num_tokens)
        lse_rows = lse + token[:, None] * stride_lt + head[:, None] * stride_lh
        part_rows = partial + token[:, None, None] * stride_pt + head[:, None, None] * stride_ph
        top = tl.full([ROW_BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([ROW_BLOCK], tl.float32)
        merged = tl.zeros([ROW_BLOCK, HEAD_DIM], tl.float32)
        for first_split in range(0, num_splits, SPLIT_CHUNK):
            splits = first_split + chunk
            ok = row_ok[:, None] & (splits < num_splits)[None, :]
            log_sums = tl.load(
                lse_rows + splits[None, :],
                mask=ok,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            parts = tl.load(
                part_rows + splits[None, :, None] * stride_ps + dims[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
                cache_modifier=".cg",
            )
            new_top = tl.maximum(top, tl.max(log_sums, 1))
            base = tl.where(new_top == float("-inf"), 0.0, new_top)  # no keys yet: weights 0
            rescale = tl.math.exp2(top - base)
            weights = tl.math.exp2(log_sums - base[:, None])
            total = total * rescale + tl.sum(weights, 1)
            merged = merged * rescale[:, None] + tl.sum(parts * weights[:, :, None], 1)
            top = new_top
        merged = merged / tl.where(total > 0.0, total, 1.0)[:, None]
        out_ptrs = out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptrs,
            merged.to(out.dtype.element_ty),
            mask=(row_ok & (token < out_capacity))[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    partial,
    lse,
    out,
    num_splits,
    num_tokens,
    out_capacity,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (token, q head) a program, every split at once."""
    enter(PDL)  # with PDL: every split program has finished and its stores are visible
    merge_rows(
        partial,
        lse,
        out,
        tl.program_id(0),
        1,
        tl.program_id(1),
        num_splits,
        num_tokens,
        out_capacity,
        stride_pt,
        stride_ph,
        stride_ps,
        stride_lt,
        stride_lh,
        stride_ot,
        stride_oh,
        1,
        1,
        BLOCK_S,
        HEAD_DIM,
    )


def merge_splits(
    partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int
) -> None:
    """Merge partial [tokens, q heads, splits, head_dim] by lse [tokens, q heads, splits]
    into out (rows past out's capacity dropped)."""
    num_tokens, num_q_heads, _, head_dim = partial.shape
    _merge_splits_kernel[(num_tokens, num_q_heads)](
        partial,
        lse,
        out,
        num_splits,
        num_tokens,
        out.shape[0],
        *partial.stride()[:3],
        *lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        num_warps=4,
        **pdl.launch(out.device, "merge"),
    )


@functools.lru_cache(maxsize=1024)
def merge_tiles(
    block_s: int, rows: int, head_dim: int, num_warps: int, tile: int | None = None
) -> tuple[int, int]:
    """(ROW_BLOCK, SPLIT_CHUNK) of the fused merge: as many splits of a row, then as many
    rows, as a tile of `tile` fp32 values holds (default MERGE_VALUES_PER_THREAD a thread).
    Cached: every layer's launch asks."""
    tile = tile or MERGE_VALUES_PER_THREAD * 32 * num_warps
    split_chunk = min(block_s, pow2_floor(tile / head_dim))
    row_block = min(triton.next_power_of_2(rows), pow2_floor(tile / (split_chunk * head_dim)))
    return row_block, split_chunk


def counters_needed(num_requests: int, num_kv_heads: int) -> int:
    """The fused merge's counters for num_requests x num_kv_heads programs' splits: one each."""
    return num_requests * num_kv_heads


def merge_counters(num_requests: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for the fused merge of up to num_requests x num_kv_heads programs'
    splits. A launch leaves them at zero, so one buffer serves every launch on a stream (and
    every replay of a graph that captured it); never two launches running at once."""
    return torch.zeros(
        counters_needed(num_requests, num_kv_heads), dtype=torch.int32, device=device
    )


def check_counters(counters: torch.Tensor, num_requests: int, num_kv_heads: int) -> None:
    """Size and dtype only: this runs at every layer's launch (each check costs host time)."""
    needed = counters_needed(num_requests, num_kv_heads)
    if counters.dtype != torch.int32:
        raise ValueError(f"merge counters must be int32 (see merge_counters); got {counters.dtype}")
    if counters.numel() < needed:
        raise BufferTooSmall(
            f"merge counters hold {counters.numel()} entries; this pass needs {num_requests} "
            f"requests x {num_kv_heads} kv heads = {needed}"
        )
