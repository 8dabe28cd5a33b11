"""The shell's mutable KV bookkeeping (`KVBook`): over the token-level slot allocator
(`engine.shell.slots`), the request table (`engine.shell.table`) and the prefix cache
(`engine.shell.radix`).

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
from engine.shell.slots import NO_SLOTS, SlotAllocator
from engine.shell.table import RequestTable
from engine.state import PADDING_SLOT, Effects, Running
from engine.state.seqlens import DEBUG, has_duplicates

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
            return NO_SLOTS
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
