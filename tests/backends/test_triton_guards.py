"""kv-index construction and guard bands: a buffer one element too small is reported, and
the kernels' own store masks never write past a capacity."""

from __future__ import annotations

import pytest
import torch
from backend_cases import DTYPES, clone_pool, make_case

from engine.backends import BufferTooSmall
from engine.backends.torch_backend import TorchBackend, build_kv_indices
from engine.backends.triton_backend import TritonBackend
from engine.backends.triton_decode import decode_attention
from engine.backends.triton_extend import extend_attention
from engine.backends.triton_index import (
    build_kv_indices_into,
    launch_kv_indices,
    launch_table_writes,
)

SENTINEL = -7
GUARD = 5


def index_inputs(case) -> dict:
    backend = TorchBackend(case.pool)
    meta = backend.plan(case.batch)
    rows = torch.from_numpy(case.batch.running.rows.copy()).to(case.q.device)
    return dict(
        req_to_token=case.pool.req_to_token,
        rows=rows,
        prefix_lens=meta.prefix_lens,
        kv_indptr=meta.kv_indptr,
        qo_indptr=meta.qo_indptr,
        out_slots=meta.out_slots,
    )


@pytest.mark.parametrize("mode", ["extend", "verify"])
def test_kv_indices_match_reference(mode: str) -> None:
    case = make_case(mode, [0, 37, 5, 90], [3, 1, 8, 2], 1, 1, 64, DTYPES[0], seed=11)
    args = index_inputs(case)
    total = case.batch.seq_lens.total
    ref = build_kv_indices(**args, total=total)
    buffer = torch.full((total + GUARD,), SENTINEL, dtype=torch.int32, device=case.q.device)
    got = build_kv_indices_into(
        **args, kv_indices=buffer, total=total, max_seq_len=case.batch.seq_lens.max
    )
    assert torch.equal(got, ref)
    assert (buffer[total:] == SENTINEL).all()


def test_kv_indices_buffer_one_too_small_is_reported_and_untouched() -> None:
    case = make_case("extend", [20, 3], [4, 6], 1, 1, 64, DTYPES[0], seed=12)
    args = index_inputs(case)
    total = case.batch.seq_lens.total
    backing = torch.full((total + GUARD,), SENTINEL, dtype=torch.int32, device=case.q.device)
    with pytest.raises(BufferTooSmall, match=f"seq_lens.total = {total}"):
        build_kv_indices_into(
            **args,
            kv_indices=backing[: total - 1],
            total=total,
            max_seq_len=case.batch.seq_lens.max,
        )
    assert (backing == SENTINEL).all()


def test_kv_index_kernel_masks_stores_at_capacity() -> None:
    """Launched past the host check with a capacity one short: the last entry stays put."""
    case = make_case("extend", [20, 3], [4, 6], 1, 1, 64, DTYPES[0], seed=13)
    args = index_inputs(case)
    total = case.batch.seq_lens.total
    ref = build_kv_indices(**args, total=total)
    backing = torch.full((total + GUARD,), SENTINEL, dtype=torch.int32, device=case.q.device)
    launch_kv_indices(
        **args, kv_indices=backing, kv_capacity=total - 1, max_seq_len=case.batch.seq_lens.max
    )
    assert torch.equal(backing[: total - 1], ref[: total - 1])
    assert (backing[total - 1 :] == SENTINEL).all()


def test_table_writes_apply_their_count_within_the_table() -> None:
    """The staged writes' first `count` entries land; later entries, and a place past the
    table (its guard band), are left alone."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backing = torch.full((3 * 8 + GUARD,), SENTINEL, dtype=torch.int32, device=device)
    table = backing[:24].view(3, 8)
    capacity = 6
    writes = torch.zeros(1 + 2 * capacity, dtype=torch.int64, device=device)
    places, slots = [2, 17, 23, 24, 5], [40, 41, 42, 43, 44]  # 24: past the table
    writes[0] = 4  # the fifth entry is staged but not counted
    writes[1:6] = torch.tensor(places)
    writes[1 + capacity : 6 + capacity] = torch.tensor(slots)
    launch_table_writes(table, writes)
    expected = torch.full((3 * 8 + GUARD,), SENTINEL, dtype=torch.int32)
    expected[[2, 17, 23]] = torch.tensor([40, 41, 42], dtype=torch.int32)
    assert torch.equal(backing.cpu(), expected)
    with pytest.raises(ValueError, match="1 \\+ 2 \\* capacity"):
        launch_table_writes(table, writes[:-1])


@pytest.mark.parametrize("mode", ["decode", "extend", "verify"])
def test_output_one_row_too_small_is_reported_and_untouched(mode: str) -> None:
    case = make_case(mode, [9, 30], [3, 2], 1, 2, 64, DTYPES[0], seed=14)
    backend = TritonBackend(case.pool)
    before = clone_pool(case.pool)
    metadata = backend.plan(case.batch)
    tokens = case.q.shape[0]
    backing = torch.full(
        (tokens + GUARD, *case.q.shape[1:]), 3.0, dtype=case.q.dtype, device=case.q.device
    )
    with pytest.raises(BufferTooSmall, match="out has shape"):
        backend.forward(0, case.q, case.k, case.v, metadata, out=backing[: tokens - 1])
    assert (backing == 3.0).all()
    assert torch.equal(case.pool.k_cache[0], before.k_cache[0])


@pytest.mark.parametrize(
    "mode,num_splits", [("decode", 1), ("decode", 3), ("verify", 1), ("verify", 2), ("extend", 1)]
)
def test_attention_kernels_mask_stores_at_capacity(mode: str, num_splits: int) -> None:
    """The kernels launched directly with an output one row short: the row past it and the
    guard band keep their bytes, the rows inside match the reference."""
    case = make_case(mode, [12, 40], [3, 2], 1, 4, 64, DTYPES[0], seed=15)
    ref_backend = TorchBackend(clone_pool(case.pool))
    ref = ref_backend.forward(0, case.q, case.k, case.v, ref_backend.plan(case.batch))
    backend = TritonBackend(case.pool)
    meta = backend.plan(case.batch, num_splits=num_splits)
    k_cache, v_cache = case.pool.k_cache[0], case.pool.v_cache[0]
    k_cache.index_copy_(0, meta.out_slots, case.k)
    v_cache.index_copy_(0, meta.out_slots, case.v)
    tokens = case.q.shape[0]
    backing = torch.full(
        (tokens + GUARD, *case.q.shape[1:]), 3.0, dtype=case.q.dtype, device=case.q.device
    )
    out = backing[: tokens - 1]
    if mode == "extend":
        extend_attention(
            case.q,
            case.k,
            case.v,
            k_cache,
            v_cache,
            meta.kv_indices,
            meta.kv_indptr,
            meta.qo_indptr,
            meta.prefix_lens,
            out,
            meta.max_new_len,
            meta.max_seq_len,
            case.q.shape[-1] ** -0.5,
        )
    else:
        decode_attention(
            case.q,
            k_cache,
            v_cache,
            meta.kv_indices,
            meta.kv_indptr,
            meta.qo_indptr,
            meta.prefix_lens,
            meta.tree_bits,
            out,
            num_splits,
            meta.extra["max_q"],
            case.q.shape[-1] ** -0.5,
        )
    assert (backing[tokens - 1 :] == 3.0).all()
    error = (out.double() - ref[: tokens - 1].double()).norm() / ref[: tokens - 1].double().norm()
    assert error < 1e-2
