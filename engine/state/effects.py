"""The effects of a transition, as data: what the shell applies to the KV pool, the request
table and the prefix cache, and the tokens and finishes it reports (`Effects`); a
transition's `Result` pairs them with the next snapshot."""

from __future__ import annotations

import attrs
import numpy as np

from engine.state.debug import trusted
from engine.state.finish import FinishReason
from engine.state.running import Running
from engine.state.seqlens import SeqLens, frozen_array

_EMPTY = frozen_array([])
_NO_LENS = SeqLens.empty()
_NO_FLAGS = frozen_array(np.zeros(0, dtype=bool), bool)


def _flags(values: object) -> np.ndarray:
    return frozen_array(values, bool)


@attrs.frozen(eq=False)
class Effects:
    """What the shell must do after a transition, in this order:

    1. write `table_slots` into the request table at (`table_rows`, `table_cols`);
    2. free `free_slots` (slots that never entered the table: rejected drafts);
    3. share: for each `share_rids` request (on row `share_rows`), its first `share_lens`
       committed tokens enter the prefix cache; where the cache already holds a slot for a
       position, the row takes that slot and frees its own; its lock moves to the new prefix;
    4. release each `release_rows` row (of request `release_rids`): its first `release_lens`
       slots, of which the first `release_shared` are the prefix cache's and locked by it.
       With the cache on and `release_cached` set, its committed tokens enter the cache (as
       in 3; its own slots become the cache's); otherwise its own slots are freed. Then its
       lock is released and the row given back.
    `emitted_*` are the tokens each request gained (CSR over `emitted_rids`);
    `finished_*` the requests that left with a reason; `retracted_rids` those sent back to wait.
    """

    table_rows: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    table_cols: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    table_slots: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    free_slots: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    release_rows: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    release_lens: SeqLens = _NO_LENS
    release_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    release_shared: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    release_cached: np.ndarray = attrs.field(default=_NO_FLAGS, converter=_flags)
    share_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    share_rows: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    share_lens: SeqLens = _NO_LENS
    emitted_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    emitted_lens: SeqLens = _NO_LENS
    emitted_tokens: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    finished_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    finished_reasons: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    retracted_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)

    def __attrs_post_init__(self) -> None:
        if not (self.table_rows.shape == self.table_cols.shape == self.table_slots.shape):
            raise ValueError("table writes need one row, column and slot each")
        released = self.release_rows.shape[0]
        if not (
            len(self.release_lens)
            == self.release_rids.shape[0]
            == self.release_shared.shape[0]
            == self.release_cached.shape[0]
            == released
        ):
            raise ValueError("each released row needs its request, length, shared length and flag")
        if (
            released
            and ((self.release_shared < 0) | (self.release_shared > self.release_lens.lens)).any()
        ):
            raise ValueError("a released row's shared slots must be within its length")
        if not (self.share_rids.shape[0] == self.share_rows.shape[0] == len(self.share_lens)):
            raise ValueError("each shared row needs its request and length")
        if self.emitted_tokens.shape[0] != self.emitted_lens.total:
            raise ValueError("emitted tokens must match emitted_lens.total")
        if self.finished_rids.shape != self.finished_reasons.shape:
            raise ValueError("each finished request needs a reason")

    @classmethod
    def of_valid(cls, **columns: np.ndarray | SeqLens) -> Effects:
        """Effects a transition assembled from read-only arrays (snapshot columns, or arrays it
        made and froze): taken as they are; the fields left out keep their defaults. Under
        ENGINE_DEBUG each array is checked to be read-only already, and the shape checks run."""
        return trusted(cls, **columns)

    def emitted(self) -> dict[int, list[int]]:
        """rid -> tokens gained (for the shell's per-request histories)."""
        rids, tokens = self.emitted_rids.tolist(), self.emitted_tokens.tolist()
        if len(tokens) == len(rids) and self.emitted_lens.max <= 1:  # one each: a decode
            return {rid: [token] for rid, token in zip(rids, tokens, strict=True)}
        bounds = self.emitted_lens.indptr().tolist()
        return {rid: tokens[bounds[i] : bounds[i + 1]] for i, rid in enumerate(rids)}

    def finished(self) -> dict[int, FinishReason]:
        if not self.finished_rids.size:  # most passes
            return {}
        return {
            int(r): FinishReason(int(c))
            for r, c in zip(self.finished_rids, self.finished_reasons, strict=True)
        }


@attrs.frozen(eq=False)
class Result:
    """What a transition returns: the next snapshot, and the effects the shell applies."""

    running: Running
    effects: Effects
