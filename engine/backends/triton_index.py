"""Triton kv-index construction: kv_indices from the request table and the new tokens' slots;
and the request table's pending writes, applied inside a captured pass.

The kernel receives the capacity of kv_indices and masks every store against it; the launcher
refuses a buffer smaller than the snapshot's exact total before anything is launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.backends.base import BufferTooSmall
from engine.pdl import enter

KV_INDEX_BLOCK = 1024
MAX_CHUNKS_PER_REQUEST = 64  # grid-stride beyond this: the grid stays small for long contexts


@triton.jit
def _kv_indices_kernel(
    req_to_token,
    table_row_stride,
    table_width,
    rows,
    prefix_lens,
    kv_indptr,
    qo_indptr,
    out_slots,
    kv_indices,
    kv_capacity,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    req = tl.program_id(0)
    kv_start = tl.load(kv_indptr + req)
    seq_len = tl.load(kv_indptr + req + 1) - kv_start
    prefix = tl.load(prefix_lens + req)
    qo_start = tl.load(qo_indptr + req)
    row_base = req_to_token + tl.load(rows + req).to(tl.int64) * table_row_stride
    for start in range(tl.program_id(1) * BLOCK, seq_len, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_seq = offs < seq_len
        in_table = in_seq & (offs < prefix) & (offs < table_width)
        from_table = tl.load(row_base + offs, mask=in_table, other=0)
        is_new = in_seq & (offs >= prefix)
        from_new = tl.load(out_slots + qo_start + offs - prefix, mask=is_new, other=0)
        value = tl.where(offs < prefix, from_table, from_new.to(tl.int32))
        dest = kv_start + offs
        tl.store(kv_indices + dest, value, mask=in_seq & (dest < kv_capacity))


def launch_kv_indices(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    out_slots: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_capacity: int,
    max_seq_len: int,
) -> None:
    """Launch without the host check (tests use it to see the kernel's own store mask)."""
    num_requests = rows.shape[0]
    if num_requests == 0 or max_seq_len == 0:
        return
    chunks = min(triton.cdiv(max_seq_len, KV_INDEX_BLOCK), MAX_CHUNKS_PER_REQUEST)
    _kv_indices_kernel[(num_requests, chunks)](
        req_to_token,
        req_to_token.stride(0),
        req_to_token.shape[1],
        rows,
        prefix_lens,
        kv_indptr,
        qo_indptr,
        out_slots,
        kv_indices,
        kv_capacity,
        BLOCK=KV_INDEX_BLOCK,
        **pdl.launch(kv_indices.device, "index"),
    )


def build_kv_indices_into(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    out_slots: torch.Tensor,
    kv_indices: torch.Tensor,
    total: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Fill kv_indices[:total] (request i: its table row up to its prefix, then the slots of
    its new tokens). `total` is the snapshot's exact seq_lens total; returns that view."""
    if kv_indices.dtype != torch.int32 or kv_indices.dim() != 1 or not kv_indices.is_contiguous():
        raise ValueError(
            f"kv_indices must be a contiguous 1-D int32 tensor; got "
            f"{kv_indices.dtype} of shape {tuple(kv_indices.shape)}"
        )
    if kv_indices.numel() < total:
        raise BufferTooSmall(
            f"kv_indices holds {kv_indices.numel()} entries; this batch needs "
            f"seq_lens.total = {total}"
        )
    launch_kv_indices(
        req_to_token,
        rows,
        prefix_lens,
        kv_indptr,
        qo_indptr,
        out_slots,
        kv_indices,
        kv_indices.numel(),
        max_seq_len,
    )
    return kv_indices[:total]


@triton.jit
def _table_writes_kernel(
    req_to_token, table_size, writes, capacity, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    enter(PDL)
    count = tl.load(writes)
    offs = tl.arange(0, BLOCK)
    wanted = (offs < count) & (offs < capacity)
    at = tl.load(writes + 1 + offs, mask=wanted, other=0)
    slots = tl.load(writes + 1 + capacity + offs, mask=wanted, other=0)
    tl.store(req_to_token + at, slots.to(tl.int32), mask=wanted & (at >= 0) & (at < table_size))


def launch_table_writes(req_to_token: torch.Tensor, writes: torch.Tensor) -> None:
    """Apply staged request-table writes on the device: `writes` (int64, 1 + 2 * capacity) is
    [count, count flat places (row * width + column), then at 1 + capacity count slots];
    the rest is ignored. Its launch shape depends only on the capacity, so a captured pass
    applies each replay's writes (`RequestTable.take_writes`)."""
    capacity = (writes.numel() - 1) // 2
    if writes.dtype != torch.int64 or writes.dim() != 1 or writes.numel() != 1 + 2 * capacity:
        raise ValueError(
            f"writes must be a 1-D int64 tensor of 1 + 2 * capacity entries; got "
            f"{writes.dtype} of shape {tuple(writes.shape)}"
        )
    if not req_to_token.is_contiguous():
        raise ValueError("the request table must be contiguous (its places are flat)")
    _table_writes_kernel[(1,)](
        req_to_token,
        req_to_token.numel(),
        writes,
        capacity,
        BLOCK=triton.next_power_of_2(max(capacity, 1)),
        **pdl.launch(writes.device, "index"),
    )
