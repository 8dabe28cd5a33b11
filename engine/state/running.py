"""The requests that hold KV, as one columnar immutable value.

Per request: its id, its request-table row, `kv_lens` (tokens whose KV is committed; equal to
the filled prefix of its table row), `shared_lens` (how many of those slots, from the start of
the row, belong to the prefix cache and are locked by the request; the rest it owns alone),
`token_lens` (tokens known: prompt plus output), and the columns the finish check reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from engine.state.debug import DEBUG, trusted
from engine.state.params import SamplingParams
from engine.state.seqlens import (
    INDEX_DTYPE,
    SeqLens,
    freeze,
    frozen_array,
    has_duplicates,
    index_array,
    is_frozen,
)

__all__ = ["DEBUG", "FinishRules", "Running"]


def _stop_matrix(values: object) -> np.ndarray:
    if (
        type(values) is np.ndarray
        and values.ndim == 2
        and values.dtype == INDEX_DTYPE
        and is_frozen(values)
    ):
        return values
    array = np.array(values, dtype=INDEX_DTYPE, copy=True)
    if array.ndim == 1:  # empty: no stop ids (widened to the batch below); else one each
        array = array.reshape(0, 0) if array.size == 0 else array.reshape(-1, 1)
    if array.ndim != 2:
        raise ValueError(f"stop_ids must be a (batch, k) matrix; got shape {array.shape}")
    array.flags.writeable = False
    return array


@attrs.frozen(eq=False)
class FinishRules:
    """Finish-check columns: max/min new tokens, EOS id (-1: ignored), stop ids (-1 padded)."""

    max_new: np.ndarray = attrs.field(converter=frozen_array)
    min_new: np.ndarray = attrs.field(converter=frozen_array)
    eos: np.ndarray = attrs.field(converter=frozen_array)
    stop_ids: np.ndarray = attrs.field(converter=_stop_matrix)

    def __attrs_post_init__(self) -> None:
        n = self.max_new.shape[0]
        if self.stop_ids.size == 0 and self.stop_ids.shape[0] != n:
            object.__setattr__(self, "stop_ids", _stop_matrix(np.zeros((n, 0))))
        if not (self.min_new.shape[0] == self.eos.shape[0] == self.stop_ids.shape[0] == n):
            raise ValueError("FinishRules columns must all have one entry per request")

    @classmethod
    def empty(cls) -> FinishRules:
        return cls([], [], [], np.zeros((0, 0), dtype=INDEX_DTYPE))

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], eos_id: int, more_eos_ids: Sequence[int] = ()
    ) -> FinishRules:
        """The columns for requests with these parameters (EOS -1 where ignore_eos). A model
        with several EOS ids (Qwen's <|im_end|> and <|endoftext|>) passes the others as
        `more_eos_ids`: they join each request's stop ids, except where ignore_eos."""
        extra = [int(t) for t in dict.fromkeys(more_eos_ids) if t >= 0 and t != eos_id]
        stops = [list(p.stop_token_ids) + ([] if p.ignore_eos else extra) for p in params]
        width = max((len(row) for row in stops), default=0)
        stop_ids = np.full((len(params), width), -1, dtype=INDEX_DTYPE)
        for row, ids in enumerate(stops):
            stop_ids[row, : len(ids)] = ids
        return cls(
            [p.max_tokens for p in params],
            [p.min_tokens for p in params],
            [-1 if p.ignore_eos else eos_id for p in params],
            stop_ids,
        )

    def __len__(self) -> int:
        return int(self.max_new.shape[0])

    def select(self, indices: np.ndarray) -> FinishRules:
        """The rows at integer `indices` (fancy indexing: fresh columns, valid as these)."""
        return trusted(
            FinishRules,
            max_new=freeze(self.max_new[indices]),
            min_new=freeze(self.min_new[indices]),
            eos=freeze(self.eos[indices]),
            stop_ids=freeze(self.stop_ids[indices]),
        )

    def concat(self, other: FinishRules) -> FinishRules:
        width = max(self.stop_ids.shape[1], other.stop_ids.shape[1])

        def pad(m: np.ndarray) -> np.ndarray:
            if m.shape[1] == width:
                return m
            return np.pad(m, ((0, 0), (0, width - m.shape[1])), constant_values=-1)

        # columns of two valid values joined: valid, and fresh (nobody else holds them)
        return trusted(
            FinishRules,
            max_new=freeze(np.concatenate([self.max_new, other.max_new])),
            min_new=freeze(np.concatenate([self.min_new, other.min_new])),
            eos=freeze(np.concatenate([self.eos, other.eos])),
            stop_ids=freeze(np.concatenate([pad(self.stop_ids), pad(other.stop_ids)])),
        )


def _optional_lens(values: object) -> np.ndarray | None:
    return None if values is None else frozen_array(values)


@attrs.frozen(eq=False)
class Running:
    """Requests holding KV, in batch order. Every column has one entry per request."""

    rids: np.ndarray = attrs.field(converter=frozen_array)
    rows: np.ndarray = attrs.field(converter=frozen_array)
    kv_lens: SeqLens
    token_lens: SeqLens
    prompt_lens: np.ndarray = attrs.field(converter=frozen_array)
    last_tokens: np.ndarray = attrs.field(converter=frozen_array)
    rules: FinishRules
    max_context: int
    # leading slots of each row that the prefix cache holds (None: no shared slots)
    shared_lens: np.ndarray = attrs.field(default=None, converter=_optional_lens)

    def __attrs_post_init__(self) -> None:
        n = self.rids.shape[0]
        if self.shared_lens is None:
            object.__setattr__(self, "shared_lens", frozen_array(np.zeros(n, INDEX_DTYPE)))
        sizes = (
            self.rows.shape[0],
            len(self.kv_lens),
            len(self.token_lens),
            self.prompt_lens.shape[0],
            self.last_tokens.shape[0],
            len(self.rules),
            self.shared_lens.shape[0],
        )
        if any(size != n for size in sizes):
            raise ValueError(f"Running columns disagree on the batch size: {n} vs {sizes}")
        if n and not (self.kv_lens.lens <= self.token_lens.lens).all():
            raise ValueError(f"kv_lens {self.kv_lens} exceed token_lens {self.token_lens}")
        if n and ((self.shared_lens < 0) | (self.shared_lens > self.kv_lens.lens)).any():
            raise ValueError(
                f"shared_lens {self.shared_lens.tolist()} must be within 0..kv_lens {self.kv_lens}"
            )
        if n and self.token_lens.max > self.max_context:
            raise ValueError(
                f"a request has {self.token_lens.max} tokens; max_context is {self.max_context}"
            )
        if DEBUG:
            for lens in (self.kv_lens, self.token_lens):
                if lens.total != int(lens.lens.sum()):
                    raise ValueError(f"stale total: {lens.total} != sum of {lens}")
        if DEBUG and n:
            if np.unique(self.rids).size != n or np.unique(self.rows).size != n:
                raise ValueError("request ids and rows must be unique within a batch")
            if (self.prompt_lens > self.token_lens.lens).any() or (self.prompt_lens < 1).any():
                raise ValueError("each request needs 1 <= prompt_len <= token_len")

    # --- construction -------------------------------------------------------------------
    @classmethod
    def empty(cls, max_context: int) -> Running:
        return cls(
            [], [], SeqLens.empty(), SeqLens.empty(), [], [], FinishRules.empty(), max_context
        )

    @classmethod
    def admitted(
        cls,
        rids: Sequence[int] | np.ndarray,
        rows: Sequence[int] | np.ndarray,
        token_lens: Sequence[int] | np.ndarray,
        prompt_lens: Sequence[int] | np.ndarray,
        last_tokens: Sequence[int] | np.ndarray,
        rules: FinishRules,
        max_context: int,
        kv_lens: Sequence[int] | np.ndarray | None = None,
    ) -> Running:
        """Requests entering with no KV committed yet (kv_lens 0), or with a cached prefix
        of `kv_lens` tokens whose slots the prefix cache holds (shared)."""
        kv = SeqLens(np.zeros(len(rids), dtype=INDEX_DTYPE) if kv_lens is None else kv_lens)
        return cls(
            rids,
            rows,
            kv,
            SeqLens(token_lens),
            prompt_lens,
            last_tokens,
            rules,
            max_context,
            kv.lens,
        )

    @classmethod
    def of_valid(
        cls,
        rids: np.ndarray,
        rows: np.ndarray,
        kv_lens: SeqLens,
        token_lens: SeqLens,
        prompt_lens: np.ndarray,
        last_tokens: np.ndarray,
        rules: FinishRules,
        max_context: int,
        shared_lens: np.ndarray,
    ) -> Running:
        """A transition's next Running whose invariants hold by construction (kv_lens grew by
        computed tokens, token_lens stayed below max_context by the finish check) from
        read-only columns: skips the re-checks, which still run under ENGINE_DEBUG."""
        return trusted(
            cls,
            rids=rids,
            rows=rows,
            kv_lens=kv_lens,
            token_lens=token_lens,
            prompt_lens=prompt_lens,
            last_tokens=last_tokens,
            rules=rules,
            max_context=max_context,
            shared_lens=shared_lens,
        )

    # --- reading ------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.rids.shape[0])

    @property
    def num_output(self) -> np.ndarray:
        return self.token_lens.lens - self.prompt_lens

    @property
    def own_lens(self) -> np.ndarray:
        """Committed slots each request owns alone (after its shared prefix)."""
        return self.kv_lens.lens - self.shared_lens

    @property
    def pending_lens(self) -> np.ndarray:
        """Known tokens whose KV is not yet computed (1 for a request ready to decode)."""
        return self.token_lens.lens - self.kv_lens.lens

    def index_of(self, rid: int) -> int:
        hits = np.flatnonzero(self.rids == rid)
        if hits.size != 1:
            raise KeyError(f"request {rid} is not in this batch")
        return int(hits[0])

    # --- new values ---------------------------------------------------------------------
    def select(self, indices: Sequence[int] | np.ndarray) -> Running:
        """The requests at `indices` (a bool mask or integer indices), in that order."""
        idx = index_array(indices)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        if idx.size and has_duplicates(idx):
            raise ValueError(f"indices {idx.tolist()} name a request twice")
        # the rows of a valid batch, each once (fancy indexing: fresh columns): valid
        return Running.of_valid(
            freeze(self.rids[idx]),
            freeze(self.rows[idx]),
            self.kv_lens.select(idx),
            self.token_lens.select(idx),
            freeze(self.prompt_lens[idx]),
            freeze(self.last_tokens[idx]),
            self.rules.select(idx),
            self.max_context,
            freeze(self.shared_lens[idx]),
        )

    def merge(self, other: Running) -> Running:
        """This batch followed by `other`; lengths and sums stay exact."""
        if other.max_context != self.max_context:
            raise ValueError("cannot merge batches with different max_context")
        if len(other) == 0 or len(self) == 0:  # values are immutable: share the other one
            return other if len(self) == 0 else self
        rids = freeze(np.concatenate([self.rids, other.rids]))
        if has_duplicates(rids):
            raise ValueError("cannot merge batches that share a request")
        # two valid batches joined (their rows distinct, as their requests are): valid, and
        # every column fresh
        return Running.of_valid(
            rids,
            freeze(np.concatenate([self.rows, other.rows])),
            self.kv_lens.concat(other.kv_lens),
            self.token_lens.concat(other.token_lens),
            freeze(np.concatenate([self.prompt_lens, other.prompt_lens])),
            freeze(np.concatenate([self.last_tokens, other.last_tokens])),
            self.rules.concat(other.rules),
            self.max_context,
            freeze(np.concatenate([self.shared_lens, other.shared_lens])),
        )
