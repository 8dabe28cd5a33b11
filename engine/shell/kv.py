"""The shell's mutable KV bookkeeping: a token-level slot allocator, the request table and
the prefix cache.

This is the only place slots change hands. `apply(effects)` turns a transition's effects into
changes here, in the order `Effects` documents; `check(...)` verifies conservation any time.
Slot 0 is reserved as the padding slot (padded CUDA-graph entries write there), so slots handed
out are 1..capacity and the KV pool tensors have capacity + 1 entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.shell.radix import Match, Peek, RadixCache
from engine.state import PADDING_SLOT, Effects, Running
from engine.state.seqlens import DEBUG, has_duplicates

_NO_SLOTS = np.zeros(0, dtype=np.int64)


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
        if self._is_free[slots].any() or has_duplicates(slots):
            raise ValueError(f"double free of KV slots {slots[self._is_free[slots]].tolist()[:8]}")
        self._is_free[slots] = True
        self._free_stack[self._num_free : self._num_free + slots.size] = slots
        self._num_free += slots.size

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(self._is_free)


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
            return _NO_SLOTS, _NO_SLOTS
        at, slots = (np.concatenate(parts) for parts in zip(*pending, strict=True))
        # a place written twice (a shared prefix's slots over a row's own): the last write
        # only, as applied one write at a time
        last = at.size - 1 - np.unique(at[::-1], return_index=True)[1]
        return at[last], slots[last]


History = Callable[[int, int], Sequence[int] | np.ndarray]  # (request id, n) -> its first n tokens


class KVBook:
    """Allocator, request table and prefix cache (`cache`, None when off), and the one place
    effects are applied. Every slot is exactly one of: free; owned by one running request
    alone (its row after its shared prefix); in the cache, locked by the running requests
    whose shared prefix holds it, or evictable. Evictable slots count as available: `alloc`
    evicts least recently used ones when the free slots do not suffice."""

    def __init__(
        self,
        capacity: int,
        num_rows: int,
        max_context: int,
        device: torch.device | str = "cpu",
        prefix_cache: bool = False,
        table: RequestTable | None = None,
    ) -> None:
        """`table`: the request table to keep (one that records its changes for other
        ranks' mirrors, `engine.shell.sharded`); default: a new one of these sizes."""
        self.slots = SlotAllocator(capacity)
        self.table = table if table is not None else RequestTable(num_rows, max_context, device)
        self.cache = RadixCache() if prefix_cache else None
        self.evicted_slots = 0  # slots evicted from the cache, since start
        self.evictions = 0  # evictions that freed slots
        # told of every Effects before it is applied (a trace records them: shell/trace.py)
        self.on_apply: Callable[[Effects], None] | None = None

    # --- slots ------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Slots `alloc` can hand out: free ones and evictable cached ones."""
        return self.slots.num_free + (0 if self.cache is None else self.cache.num_evictable)

    def alloc(self, count: int) -> np.ndarray:
        """`count` slots, evicting cached ones (LRU) first if too few are free."""
        short = count - self.slots.num_free
        if short > 0 and self.cache is not None and self.cache.num_evictable:
            freed = self.cache.evict(short)
            self.slots.free(freed)
            self.evicted_slots += int(freed.size)
            self.evictions += 1
        return self.slots.alloc(count)

    # --- the prefix cache -------------------------------------------------------------------
    def acquire(self, holder: int, tokens: Sequence[int] | np.ndarray | Peek) -> np.ndarray:
        """The slots of the longest cached prefix of `tokens`, locked for `holder` (a request
        being admitted) until its row is released (`apply`) or `unacquire`. `tokens` may be
        a `RadixCache.peek` of them instead, with no insert or eviction since (other
        acquires may come between): that spares a second descent of the tree."""
        if self.cache is None:
            return _NO_SLOTS
        if isinstance(tokens, Peek):
            match = self.cache.take(tokens)
        else:
            match = self.cache.match(tokens)
        if match.length:
            self.cache.lock(holder, match.handle)
        return match.slots

    def unacquire(self, holder: int) -> None:
        """Give back what `acquire` locked for a request that was not admitted after all."""
        if self.cache is not None and self.cache.held_length(holder):
            self.cache.unlock(holder)

    # --- effects ------------------------------------------------------------------------------
    def apply(
        self, effects: Effects, table_written: bool = False, history: History | None = None
    ) -> None:
        """Apply effects in their documented order. `table_written`: their table writes were
        already applied (the engine applies a decode pass's writes early, `decode_writes`);
        with ENGINE_DEBUG that is checked rather than assumed. `history` gives the tokens of
        the requests whose KV enters the prefix cache."""
        if self.on_apply is not None:
            self.on_apply(effects)
        if not table_written:
            self.table.write(effects.table_rows, effects.table_cols, effects.table_slots)
        elif DEBUG and not np.array_equal(
            self.table.host[effects.table_rows, effects.table_cols], effects.table_slots
        ):
            raise AssertionError("table writes said to be applied early are missing")
        self.slots.free(effects.free_slots)
        if effects.share_rids.size:
            self._share_all(effects, history)
        for rid, row, length, shared, cached in zip(
            effects.release_rids.tolist(),
            effects.release_rows.tolist(),
            effects.release_lens.tolist(),
            effects.release_shared.tolist(),
            effects.release_cached.tolist(),
            strict=True,
        ):
            self._release(rid, row, length, shared, cached, history)

    def _share_all(self, effects: Effects, history: History | None) -> None:
        """Step 3 of `Effects`: each shared row's positions the cache already held take the
        cache's slots, written to the table at once."""
        if self.cache is None:
            raise ValueError("a share effect needs the prefix cache")
        moves = [
            self._share(rid, row, length, history)
            for rid, row, length in zip(
                effects.share_rids.tolist(),
                effects.share_rows.tolist(),
                effects.share_lens.tolist(),
                strict=True,
            )
        ]
        rows, cols, slots = (np.concatenate(parts) for parts in zip(*moves, strict=True))
        self.table.write(rows, cols, slots)

    def _share(
        self, rid: int, row: int, length: int, history: History | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Request `rid`'s committed tokens into the cache, its lock moved to them. Returns
        the table writes (rows, columns, slots) that give its row the cache's slots where the
        cache held the position already."""
        assert self.cache is not None
        tokens, match = self._insert(rid, row, length, history)
        if match.length != tokens.size:
            raise AssertionError("a prefix just inserted is not cached")
        row_slots = self.table.host[row, : match.length]
        moved = np.flatnonzero(row_slots != match.slots)  # positions the cache already held
        self.unacquire(rid)
        self.cache.lock(rid, match.handle)
        return np.full(moved.size, row, dtype=np.int64), moved, match.slots[moved]

    def _release(
        self, rid: int, row: int, length: int, shared: int, cached: bool, history: History | None
    ) -> None:
        if self.cache is None:
            self.slots.free(self.table.host[row, shared:length])
        else:
            kept = self._insert(rid, row, length, history)[0].size if cached else shared
            self.slots.free(self.table.host[row, kept:length])
            self.unacquire(rid)
        self.table.release_row(row)

    def _insert(
        self, rid: int, row: int, length: int, history: History | None
    ) -> tuple[np.ndarray, Match]:
        """Put the committed tokens of request `rid` (on `row`) into the cache, as far as
        they are known; its slots where the cache held the position already are freed.
        Returns the tokens inserted, and their match in the cache now."""
        assert self.cache is not None
        if history is None:
            raise ValueError("caching a request's KV needs its tokens (history)")
        tokens = np.asarray(history(rid, length), dtype=np.int64)[:length]
        duplicates, match = self.cache.insert_match(tokens, self.table.host[row, : tokens.size])
        self.slots.free(duplicates)
        return tokens, match

    # --- checks -------------------------------------------------------------------------------
    def check(
        self,
        running: Running,
        in_flight: np.ndarray | None = None,
        history: History | None = None,
        tree: bool = True,
    ) -> None:
        """Slot conservation: free + owned (+ in flight) + cached == capacity, each slot with
        one kind of owner; each row holds its request's shared prefix (the cache's slots for
        those tokens, when `history` is given) and then its own slots up to its committed
        length; the cache's lock holders are exactly the requests with a shared prefix.
        `tree`: also scan the whole prefix tree (its structure and lock counts; a caller
        that knows the tree did not change since the last scan may leave it out)."""
        owned = [
            self.table.host[row, shared:length]
            for row, shared, length in zip(
                running.rows.tolist(),
                running.shared_lens.tolist(),
                running.kv_lens.tolist(),
                strict=True,
            )
        ]
        if in_flight is not None:
            owned.append(np.asarray(in_flight, dtype=np.int64))
        owned_flat = np.concatenate(owned) if owned else np.zeros(0, dtype=np.int64)
        cached = np.zeros(0, dtype=np.int64) if self.cache is None else self.cache.cached_slots()
        if has_duplicates(owned_flat):
            raise AssertionError("a KV slot is owned twice")
        if (owned_flat == PADDING_SLOT).any():
            raise AssertionError("a request owns the padding slot")
        if self.slots._is_free[owned_flat].any() or self.slots._is_free[cached].any():
            raise AssertionError("a KV slot is both free and owned (or cached)")
        if np.intersect1d(owned_flat, cached).size:
            raise AssertionError("a KV slot is both owned by a request and in the prefix cache")
        if self.slots.num_free + owned_flat.size + cached.size != self.slots.capacity:
            raise AssertionError(
                f"slots leaked: {self.slots.num_free} free + {owned_flat.size} owned + "
                f"{cached.size} cached != capacity {self.slots.capacity}"
            )
        if self.table.num_free_rows + len(running) != self.table.host.shape[0]:
            raise AssertionError("request-table rows leaked or double-owned")
        self._check_shared(running, history, tree)

    def _check_shared(self, running: Running, history: History | None, tree: bool) -> None:
        holding = {
            rid: shared
            for rid, shared in zip(running.rids.tolist(), running.shared_lens.tolist(), strict=True)
            if shared
        }
        if self.cache is None:
            if holding:
                raise AssertionError("requests hold shared prefixes without a prefix cache")
            return
        if tree:
            self.cache.check()
        if self.cache.holders() != holding:
            raise AssertionError(
                f"the cache's lock holders {self.cache.holders()} are not the running "
                f"requests' shared prefixes {holding}"
            )
        if history is None:
            return
        for rid, row, shared in zip(
            running.rids.tolist(),
            running.rows.tolist(),
            running.shared_lens.tolist(),
            strict=True,
        ):
            if not shared:
                continue
            match = self.cache.match(np.asarray(history(rid, shared)), touch=False)
            if match.length != shared or not np.array_equal(
                self.table.host[row, :shared], match.slots
            ):
                raise AssertionError(
                    f"request {rid}'s row does not start with its cached prefix's slots"
                )
