"""The shell's KV bookkeeping: slot allocator, request table, KVBook.apply / check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state_builders import Rule, running_of

from engine import state
from engine.shell.kv import KVBook, OutOfSlots, RequestTable, SlotAllocator
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
