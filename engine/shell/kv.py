"""The shell's mutable KV bookkeeping: a token-level slot allocator and the request table.

This is the only place slots change hands. `apply(effects)` turns a transition's effects into
changes here, in the order `Effects` documents; `check(...)` verifies conservation any time.
Slot 0 is reserved as the padding slot (padded CUDA-graph entries write there), so slots handed
out are 1..capacity and the KV pool tensors have capacity + 1 entries.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.state import PADDING_SLOT, Effects, Running
from engine.state.seqlens import DEBUG


class OutOfSlots(RuntimeError):
    """Fewer free KV slots than asked for; the scheduler retracts or waits."""


class SlotAllocator:
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
        if self._is_free[slots].any() or np.unique(slots).size != slots.size:
            raise ValueError(f"double free of KV slots {slots[self._is_free[slots]].tolist()[:8]}")
        self._is_free[slots] = True
        self._free_stack[self._num_free : self._num_free + slots.size] = slots
        self._num_free += slots.size

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(self._is_free)


class RequestTable:
    """req_to_token[row, position] = KV slot. The host array is the truth; `device` mirrors it
    (the same memory on CPU) for the attention backends' kv-index construction."""

    def __init__(self, num_rows: int, max_context: int, device: torch.device | str = "cpu"):
        self.max_context = max_context
        self.host = np.zeros((num_rows, max_context), dtype=np.int32)
        device = torch.device(device)
        self.device = (
            torch.from_numpy(self.host)
            if device.type == "cpu"
            else torch.zeros((num_rows, max_context), dtype=torch.int32, device=device)
        )
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise OutOfSlots("no free request-table row; max_running_requests reached")
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        if row in self._free_rows:
            raise ValueError(f"request-table row {row} released twice")
        self.host[row] = PADDING_SLOT
        if self.device.device.type != "cpu":
            self.device[row] = PADDING_SLOT
        self._free_rows.append(row)

    def write(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        if rows.size == 0:
            return
        self.host[rows, cols] = slots
        if self.device.device.type != "cpu":
            # One asynchronous copy from pinned memory, then one scatter. (A copy from pageable
            # memory would wait for the device to finish everything queued: the engine
            # writes here while a pass runs.) The caching host allocator keeps the pinned
            # block until the copy is done.
            packed = torch.from_numpy(np.stack([rows, cols, slots]).astype(np.int64))
            rows_d, cols_d, slots_d = packed.pin_memory().to(self.device.device, non_blocking=True)
            self.device.index_put_((rows_d, cols_d), slots_d.to(torch.int32))


class KVBook:
    """Allocator + request table, and the one place effects are applied."""

    def __init__(
        self, capacity: int, num_rows: int, max_context: int, device: torch.device | str = "cpu"
    ) -> None:
        self.slots = SlotAllocator(capacity)
        self.table = RequestTable(num_rows, max_context, device)

    def apply(self, effects: Effects, table_written: bool = False) -> None:
        """Apply effects in their documented order. `table_written`: their table writes were
        already applied (the engine applies a decode pass's writes early, `decode_writes`);
        with ENGINE_DEBUG that is checked rather than assumed."""
        if not table_written:
            self.table.write(effects.table_rows, effects.table_cols, effects.table_slots)
        elif DEBUG and not np.array_equal(
            self.table.host[effects.table_rows, effects.table_cols], effects.table_slots
        ):
            raise AssertionError("table writes said to be applied early are missing")
        self.slots.free(effects.free_slots)
        for row, length in zip(
            effects.release_rows.tolist(), effects.release_lens.tolist(), strict=True
        ):
            self.slots.free(self.table.host[row, :length])
            self.table.release_row(row)

    def check(self, running: Running, in_flight: np.ndarray | None = None) -> None:
        """Slot conservation: free + owned (+ in flight) == capacity, nothing owned twice,
        and each row holds exactly its request's slots up to its committed length."""
        owned = [
            self.table.host[row, :length]
            for row, length in zip(running.rows.tolist(), running.kv_lens.tolist(), strict=True)
        ]
        if in_flight is not None:
            owned.append(np.asarray(in_flight, dtype=np.int64))
        owned_flat = np.concatenate(owned) if owned else np.zeros(0, dtype=np.int64)
        if np.unique(owned_flat).size != owned_flat.size:
            raise AssertionError("a KV slot is owned twice")
        if (owned_flat == PADDING_SLOT).any():
            raise AssertionError("a request owns the padding slot")
        if self.slots._is_free[owned_flat].any():
            raise AssertionError("a KV slot is both free and owned")
        if self.slots.num_free + owned_flat.size != self.slots.capacity:
            raise AssertionError(
                f"slots leaked: {self.slots.num_free} free + {owned_flat.size} "
                f"owned != capacity {self.slots.capacity}"
            )
        if self.table.num_free_rows + len(running) != self.table.host.shape[0]:
            raise AssertionError("request-table rows leaked or double-owned")
