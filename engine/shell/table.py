"""The request table: req_to_token[row, position] = KV slot for each running request's row,
kept on the host with a device mirror that the attention backends read (`RequestTable`)."""

from __future__ import annotations

import numpy as np
import torch

from engine.shell.slots import NO_SLOTS, OutOfSlots
from engine.state import PADDING_SLOT


class RequestTable:
    """req_to_token[row, position] = KV slot. The host array is the truth; `device` mirrors it
    (the same memory on CPU unless `mirror`) for the attention backends' kv-index
    construction.

    Once `defer_writes()` is called (by the runner whose captured passes apply them), writes
    to a separate device mirror wait on the host: `take_writes` hands them to the next
    captured pass, which applies them on the device before it reads the table (no launch of
    their own), and anything else that reads the mirror gets it through `device`, which
    applies what waits first (`flush`), as does `clear`."""

    def __init__(
        self,
        num_rows: int,
        max_context: int,
        device: torch.device | str = "cpu",
        mirror: bool = False,
    ):
        self.max_context = max_context
        self.host = np.zeros((num_rows, max_context), dtype=np.int32)
        device = torch.device(device)
        self.mirrored = device.type != "cpu" or mirror  # the device table is memory apart
        self._device = (
            torch.zeros((num_rows, max_context), dtype=torch.int32, device=device)
            if self.mirrored
            else torch.from_numpy(self.host)
        )
        self._flat = self._device.view(-1)  # the device table, one row after another
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.deferring = False
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # (flat places, slots)

    @property
    def device(self) -> torch.Tensor:
        """The device mirror, every write applied to it (in stream order)."""
        self.flush()
        return self._device

    @property
    def num_pending(self) -> int:
        """Writes not applied to the device mirror yet."""
        return sum(at.size for at, _ in self._pending)

    def defer_writes(self) -> None:
        """From now on writes wait for `take_writes` or `flush` (see the class)."""
        if not self.mirrored:
            raise ValueError("writes can wait only for a separate device mirror (mirror=True)")
        self.deferring = True

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
        self.clear(row)
        self._free_rows.append(row)

    def clear(self, row: int) -> None:
        """Every position of `row` back to the padding slot."""
        self.host[row] = PADDING_SLOT
        if self.mirrored:
            self.device[row] = PADDING_SLOT  # after the writes that wait (they may be its)

    def write_on_device(self, at: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """On the device, in stream order after the writes that wait: `slots` at the flat
        places `at` (row * max_context + position) where `keep` (values the device found;
        the others' places keep their entries). The host's table learns them by its own
        writes (`write`); without a separate mirror it is the device table, and such writes
        that the host does not make again are its to clear (`DeviceWalk.cleared`)."""
        flat = self.device.view(-1)
        flat[at] = torch.where(keep, slots.to(flat.dtype), flat[at])

    def write(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        if rows.size == 0:
            return
        self.host[rows, cols] = slots
        if not self.mirrored:
            return
        at = np.asarray(rows, dtype=np.int64) * self.max_context + cols
        self._pending.append((at, np.asarray(slots, dtype=np.int64)))
        if not self.deferring:
            self.flush()

    def take_writes(self, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The waiting writes (flat places, slots; oldest first, so a later write to a place
        wins where they are applied in order), handed over to be applied by the caller's
        pass; None where more than `capacity` wait: they are applied now (`flush`)."""
        if self.num_pending > capacity:
            self.flush()
            return None
        return self._take()

    def flush(self) -> None:
        """Apply the waiting writes to the device mirror: one asynchronous copy from pinned
        memory (a copy from pageable memory would wait for the device to finish everything
        queued, and the engine writes while a pass runs), then one scatter into the flat
        table. Torch's pinned-memory cache hands the buffer out again only once the copy
        has run."""
        if not self._pending:
            return
        at, slots = self._take()
        count = at.size
        pinned = torch.empty(count * 12, dtype=torch.uint8, pin_memory=self._flat.is_cuda)
        packed = pinned.numpy()
        packed[: count * 8].view(np.int64)[:] = at
        packed[count * 8 :].view(np.int32)[:] = slots
        sent = pinned.to(self._flat.device, non_blocking=True)
        at_d, slots_d = sent[: count * 8].view(torch.int64), sent[count * 8 :].view(torch.int32)
        self._flat.index_copy_(0, at_d, slots_d)

    def _take(self) -> tuple[np.ndarray, np.ndarray]:
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            return pending[0]
        if not pending:
            return NO_SLOTS, NO_SLOTS
        at, slots = (np.concatenate(parts) for parts in zip(*pending, strict=True))
        # a place written twice (a shared prefix's slots over a row's own): the last write
        # only, as applied one write at a time
        last = at.size - 1 - np.unique(at[::-1], return_index=True)[1]
        return at[last], slots[last]
