"""A pass's grammar masks on their way to the logits: host rows filled (on a thread, with a
GPU) into staging buffers kept from pass to pass, copied to the device without waiting for
the pass, unpacked there and applied (every token a row does not allow at -inf)."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import time
from typing import Any

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
    """A pass's masks, being filled (on a host thread with `Grammars.parallel`) into staging
    rows. `host()` waits for them; `apply(logits)` then copies them to the logits' device
    (pinned, without waiting for the pass) and sets what a row does not allow to -inf."""

    def __init__(
        self,
        bitmask: np.ndarray,
        words: torch.Tensor,
        stats: collections.Counter,
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
