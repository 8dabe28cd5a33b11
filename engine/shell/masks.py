"""A pass's grammar masks on their way to the logits: host rows filled (on a thread, with a
GPU: `MaskFills`) into staging buffers kept from pass to pass, copied to the device without
waiting for the pass, unpacked there and applied (every token a row does not allow at -inf)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from engine.model.sampling import host_to_device


class Staging:
    """The host rows a pass's masks are filled into, kept from pass to pass (no allocation
    per step): pinned with a GPU, so that their copy to it starts without waiting for the
    pass. Two buffers in turn: a pass fills one while the last pass's copy may still read
    the other, and a buffer is reused once its copy is done (an event recorded after it;
    by then long since, in practice: the pass's tokens were read)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[Any] = [None, None]
        self._turn = 0

    def take(self, rows: int, words: int) -> tuple[np.ndarray, torch.Tensor]:
        """[rows, words] int32 rows to fill (their contents are stale), as numpy and torch
        views of one buffer."""
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # that buffer's last copy (an event, not the pass)
            self._copied[turn] = None
        buffer = self._buffers[turn]
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != words:
            size = max(rows, 2 * buffer.shape[0] if buffer is not None else 0, 64)
            buffer = torch.empty((size, words), dtype=torch.int32, pin_memory=self.pinned)
            self._buffers[turn] = buffer
        words_view = buffer[:rows]
        return words_view.numpy(), words_view

    def copied(self, buffer: torch.Tensor) -> None:
        """`buffer` (a view of one taken) was copied to the GPU on the current stream."""
        for turn, held in enumerate(self._buffers):
            if held is not None and held.data_ptr() == buffer.data_ptr():
                event = torch.cuda.Event()
                event.record()
                self._copied[turn] = event


class PendingMasks:
    """A pass's masks, being filled (on a host thread with `MaskFills.parallel`) into staging
    rows. `host()` waits for them; `apply(logits)` then copies them to the logits' device
    (pinned, without waiting for the pass) and sets what a row does not allow to -inf."""

    def __init__(
        self,
        bitmask: np.ndarray,
        words: torch.Tensor,
        stats: MutableMapping[str, Any],  # counts and seconds
        count: int,
        job: concurrent.futures.Future | None,
        staging: Staging,
    ) -> None:
        self.bitmask, self.words, self.stats, self.count = bitmask, words, stats, count
        self.job, self.staging = job, staging

    @property
    def done(self) -> bool:
        return self.job is None or self.job.done()

    def host(self) -> np.ndarray:
        """The [rows, words] int32 masks, once filled (the wait counts as
        `grammar_mask_wait_seconds`)."""
        if self.job is not None:
            job, self.job = self.job, None
            started = time.perf_counter()
            seconds = job.result()
            self.stats["grammar_mask_wait_seconds"] += time.perf_counter() - started
            self.stats["grammar_masks"] += self.count
            self.stats["grammar_mask_seconds"] += seconds
        return self.bitmask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] with every token its row's mask does not allow at -inf (a
        new tensor)."""
        bitmask = self.host()
        if logits.device.type != "cuda":
            return apply_masks(logits, bitmask)
        if self.staging.pinned:
            words = self.words.to(logits.device, non_blocking=True)
            self.staging.copied(self.words)
        else:
            words = host_to_device(bitmask, logits.device)
        return _where_allowed(logits, unpack_words(words))


def apply_masks(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """`logits` [rows, vocab] with every token its row's mask does not allow at -inf (a new
    tensor). Ids past the grammar's vocabulary are never allowed."""
    if logits.device.type == "cpu":
        allowed = torch.from_numpy(
            np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)
        )
    else:  # the words cross (pinned, without waiting for the pass), then unpack there
        allowed = unpack_words(host_to_device(bitmask, logits.device))
    return _where_allowed(logits, allowed)


def _where_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return torch.where(allowed[:, :vocab], logits, float("-inf"))


@functools.lru_cache(maxsize=8)
def _bits(device: torch.device) -> torch.Tensor:
    """int32 words with one bit set each, bit 0 to bit 31 (kept per device)."""
    return torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int32, device=device),
        torch.arange(32, dtype=torch.int32, device=device),
    )


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 masks -> [rows, 32 * words] bool (bit b of word w: token 32w + b),
    in two kernels."""
    return ((words[:, :, None] & _bits(words.device)) != 0).flatten(1)


POOL, SERIAL = "pool", "serial"
# A pass's masks expected to take less than this (`Faster.expected`) are filled on the loop's
# thread: handing them to the filler thread and back costs about as much.
HANDOFF_SECONDS = 100e-6


class Faster:
    """Which way fills a pass's masks faster on this machine: llguidance's pool or one row
    after another. The pool's start and its per-row overhead (which grows with the
    vocabulary) can cost more than cheap masks; a grammar with costly masks gains from it.
    Each way's seconds per row are a running mean; the faster is taken, the other retried
    every `PROBE` passes (a mask's cost changes with the grammars in flight)."""

    PROBE = 32

    def __init__(self) -> None:
        self.mean: dict[str, float] = {}
        self.passes = 0

    def pick(self) -> str:
        self.passes += 1
        for way in (POOL, SERIAL):  # each measured once first
            if way not in self.mean:
                return way
        faster, slower = sorted((POOL, SERIAL), key=self.mean.__getitem__)
        return slower if self.passes % self.PROBE == 0 else faster

    def expected(self, rows: int) -> float:
        """Seconds `rows` masks are expected to take the faster way (inf: not measured)."""
        return rows * min(self.mean.values()) if self.mean else float("inf")

    def record(self, way: str, seconds: float, rows: int) -> None:
        per_row = seconds / max(rows, 1)
        last = self.mean.get(way)
        self.mean[way] = per_row if last is None else 0.75 * last + 0.25 * per_row


class MaskFills:
    """Where a pass's masks are filled: into staging rows (`take`), by llguidance's pool or
    one row after another (`fill_rows`, whichever `rows_way` measured faster here; a verify
    pass's tree masks measure theirs in `trees_way`), on the filler thread or on the
    caller's (`submit`). `parallel`: off the loop's thread where a hand-off costs less than
    the fill (`HANDOFF_SECONDS`; with a GPU, the device runs the pass meanwhile; on a CPU
    the cores run the model, and a pool's threads would wait behind it). `stats` counts the
    masks and their host time (`grammar_masks`, `grammar_mask_seconds`)."""

    def __init__(self, stats: MutableMapping[str, Any], parallel: bool) -> None:
        self.stats, self.parallel = stats, parallel
        self.staging = Staging(pinned=parallel and torch.cuda.is_available())
        self.rows_way, self.trees_way = Faster(), Faster()  # pool or serial, measured
        self._executor: llguidance.LLExecutor | None = None
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: concurrent.futures.Future | None = None  # the last fill started

    def take(self, rows: int, words: int) -> tuple[np.ndarray, torch.Tensor]:
        """Staging rows for a pass's masks (`Staging.take`), once the last fill is done."""
        self.settle()
        return self.staging.take(rows, words)

    def fill_rows(self, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
        """Fill `rows` of `bitmask`: on llguidance's pool or one by one (on this thread), the
        way `rows_way` measured faster here."""
        way = self.rows_way.pick() if self.parallel and len(rows) > 1 else SERIAL
        started = time.perf_counter()
        if way == POOL:
            llg_numpy.fill_next_token_bitmask_par(self.pool(), rows, bitmask)
        else:
            for matcher, row in rows:
                llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
        if self.parallel:
            self.rows_way.record(way, time.perf_counter() - started, len(rows))

    def pool(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def submit(
        self,
        fill: Callable[[], None],
        bitmask: np.ndarray,
        words: torch.Tensor,
        count: int,
        way: Faster | None,
    ) -> PendingMasks:
        """`fill()` (which writes `bitmask`'s `count` masks) timed: with `parallel`, on the
        filler thread, unless `way` measured it cheaper than the hand-off (`HANDOFF_SECONDS`);
        then, with `way` None, and without `parallel`, here."""

        def timed() -> float:
            started = time.perf_counter()
            fill()
            return time.perf_counter() - started

        if not self.parallel or way is None or way.expected(count) < HANDOFF_SECONDS:
            seconds = timed()
            self.stats["grammar_masks"] += count
            self.stats["grammar_mask_seconds"] += seconds
            return PendingMasks(bitmask, words, self.stats, count, None, self.staging)
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
        running = threading.Event()

        def started() -> float:
            running.set()
            return timed()

        self._inflight = self._filler.submit(started)
        # Wait (GIL released) until the filler runs: it then holds the GIL only until it
        # enters llguidance, where this thread takes it back. Otherwise it might wait for
        # it for an interpreter switch interval (5 ms) while this thread does host work.
        running.wait()
        return PendingMasks(bitmask, words, self.stats, count, self._inflight, self.staging)

    def settle(self) -> None:
        """Wait for the last fill if it is still running: its pass failed before applying
        it, and its matchers and staging rows are about to be used again (its error went
        with that pass)."""
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])
            self._inflight = None
