"""The shell's KV bookkeeping: slot allocator, request table, KVBook.apply / check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state_builders import Rule, running_of

from engine import state
from engine.shell.kv import KVBook
from engine.shell.slots import OutOfSlots, SlotAllocator
from engine.shell.table import RequestTable
from engine.state import PADDING_SLOT


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 40), ops=st.lists(st.integers(-8, 8), max_size=30))
def test_allocator_conserves_slots(capacity, ops):
    """Positive op: alloc that many; negative: free that many of the owned (oldest first)."""
    slots = SlotAllocator(capacity)
    owned: list[int] = []
    for op in ops:
        if op >= 0:
            if op > slots.num_free:
                with pytest.raises(OutOfSlots):
                    slots.alloc(op)
                continue
            got = slots.alloc(op).tolist()
            assert PADDING_SLOT not in got and not set(got) & set(owned)
            owned += got
        else:
            slots.free(np.array(owned[:-op], dtype=np.int64))
            owned = owned[-op:]
        assert slots.num_free + len(owned) == capacity
        assert sorted(slots.free_slots().tolist() + owned) == list(range(1, capacity + 1))


def test_allocator_rejects_bad_counts_and_frees():
    slots = SlotAllocator(4)
    with pytest.raises(ValueError, match=">= 0"):
        slots.alloc(-2)  # regression: used to grow num_free by 2
    assert slots.num_free == 4
    got = slots.alloc(2)
    slots.free(got[:1])
    with pytest.raises(ValueError, match="double free"):
        slots.free(got[:1])
    with pytest.raises(ValueError, match="double free"):
        slots.free(np.array([got[1], got[1]]))
    with pytest.raises(ValueError, match="out of range"):
        slots.free(np.array([PADDING_SLOT]))
    assert slots.num_free == 3


def test_book_applies_effects_and_check_catches_a_leak():
    book = KVBook(capacity=16, num_rows=2, max_context=8)
    row = book.table.alloc_row()
    run = running_of([5], [row], [0], [3], [3], [2], [Rule(4, 0, -1, ())], 8)
    batch = state.schedule_extend(run, [3], [1, 1, 2], book.slots.alloc(3))
    result = state.extend(batch, [3])
    book.apply(result.effects)
    book.check(result.running)
    assert book.table.host[row, :3].tolist() == batch.out_slots.tolist()
    book.slots.alloc(1)  # a slot nobody owns
    with pytest.raises(AssertionError, match="leaked"):
        book.check(result.running)
    book.table.alloc_row()
    with pytest.raises(OutOfSlots, match="row"):
        book.table.alloc_row()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_released_row_is_cleared_on_the_device_too():
    """Regression: release_row zeroed the host row but left the device mirror stale."""
    table = RequestTable(2, 8, device="cuda")
    row = table.alloc_row()
    table.write(np.array([row, row]), np.array([0, 1]), np.array([4, 9]))
    table.release_row(row)
    assert not table.device[row].any().item()
    assert np.array_equal(table.device.cpu().numpy(), table.host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_table_mirrors_the_host_after_writes():
    """Writes of every row and width, later ones over earlier ones, reach the device mirror
    (one flat scatter of int32 slots)."""
    rng = np.random.default_rng(0)
    table = RequestTable(5, 33, device="cuda")
    for count in (1, 7, 40, 165):
        places = rng.choice(5 * 33, size=count, replace=False)
        rows, cols = np.divmod(places, 33)
        table.write(rows, cols, rng.integers(1, 2**31 - 1, size=count))
        assert np.array_equal(table.device.cpu().numpy(), table.host)


def _waiting_table() -> RequestTable:
    table = RequestTable(3, 8, mirror=True)  # a separate mirror, on CPU too
    table.defer_writes()
    return table


def test_deferred_writes_reach_the_mirror_in_order_when_taken_or_read():
    table = _waiting_table()
    table.write(np.array([0, 0]), np.array([1, 2]), np.array([5, 6]))
    table.write(np.array([2, 0]), np.array([7, 1]), np.array([9, 4]))  # (0, 1) again: 4 wins
    assert table.num_pending == 4 and not table._device.any()
    at, slots = table.take_writes(capacity=4)
    assert sorted(zip(at.tolist(), slots.tolist(), strict=True)) == [(1, 4), (2, 6), (23, 9)]
    assert table.num_pending == 0
    table.write(np.array([1]), np.array([3]), np.array([8]))
    assert table.take_writes(capacity=0) is None  # more than fit: applied at once
    assert table._device[1, 3] == 8 and table.num_pending == 0
    table.write(np.array([2, 2]), np.array([0, 1]), np.array([3, 2]))
    assert np.array_equal(table.device.numpy()[2, :2], [3, 2])  # `device` applies them


def test_clearing_a_row_applies_its_waiting_writes_first():
    """A write that waited past a clear of its row would come back after it."""
    table = _waiting_table()
    row = table.alloc_row()
    table.write(np.array([row]), np.array([4]), np.array([7]))
    table.release_row(row)
    assert table.num_pending == 0
    assert np.array_equal(table._device.numpy(), table.host)


def test_only_a_separate_mirror_defers_writes():
    with pytest.raises(ValueError, match="separate device mirror"):
        RequestTable(2, 4).defer_writes()
