"""KV slots, one per cached token, handed out and taken back: the allocator of the slots the
KV pool holds (1..capacity; slot 0 is the padding slot, never handed out). `KVBook`
(`engine.shell.kv`) is its one user that moves slots between owners."""

from __future__ import annotations

import numpy as np

from engine.state import PADDING_SLOT
from engine.state.seqlens import has_duplicates

NO_SLOTS = np.zeros(0, dtype=np.int64)


class OutOfSlots(RuntimeError):
    """Fewer free KV slots than asked for; the scheduler retracts or waits."""


class SlotAllocator:
    """The free slots as a stack (the last freed is handed out first) and a free flag for
    each slot, by which `free` refuses a double free; a slot out of range is refused too."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KV capacity must be >= 1 slot; got {capacity}")
        self.capacity = capacity
        self._free_stack = np.arange(capacity, 0, -1, dtype=np.int64)  # pop from the end
        self._num_free = capacity
        self._is_free = np.ones(capacity + 1, dtype=bool)
        self._is_free[PADDING_SLOT] = False

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, count: int) -> np.ndarray:
        if count < 0:
            raise ValueError(f"asked for {count} KV slots; the count must be >= 0")
        if count > self._num_free:
            raise OutOfSlots(f"asked for {count} KV slots; {self._num_free} are free")
        slots = self._free_stack[self._num_free - count : self._num_free][::-1].copy()
        self._num_free -= count
        self._is_free[slots] = False
        return slots

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size == 0:
            return
        if slots.min() < 1 or slots.max() > self.capacity:
            raise ValueError(f"slot out of range 1..{self.capacity}: {slots.tolist()[:8]}")
        if self._is_free[slots].any() or has_duplicates(slots):
            raise ValueError(f"double free of KV slots {slots[self._is_free[slots]].tolist()[:8]}")
        self._is_free[slots] = True
        self._free_stack[self._num_free : self._num_free + slots.size] = slots
        self._num_free += slots.size

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(self._is_free)
