"""Per-request lengths and their total as one immutable value.

The total is computed from the lengths when the value is made and can never be passed in,
so no code path can leave it stale (the bug family this project exists to remove).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from engine.state.debug import DEBUG, trusted

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEBUG",
    "INDEX_DTYPE",
    "SeqLens",
    "freeze",
    "frozen_array",
    "has_duplicates",
    "index_array",
    "is_frozen",
]

INDEX_DTYPE = np.int64


def is_frozen(array: np.ndarray) -> bool:
    """Whether nothing can write `array`: neither it nor any array whose memory it views."""
    viewed: object = array
    while viewed is not None:
        if type(viewed) is not np.ndarray or viewed.flags.writeable:
            return False
        viewed = viewed.base
    return True


def frozen_array(values: object, dtype: type = INDEX_DTYPE) -> np.ndarray:
    """A read-only 1-D array of `values`: `values` itself when it already is one that nothing
    can write, else a read-only copy (a snapshot never shares a writeable buffer)."""
    if (
        type(values) is np.ndarray
        and not values.flags.writeable
        and values.ndim == 1
        and values.dtype == dtype
        and (values.base is None or is_frozen(values.base))
    ):
        return values
    array: np.ndarray = np.array(values, dtype=dtype, copy=True)
    array.flags.writeable = False
    return array if array.ndim == 1 else array.reshape(-1)


def has_duplicates(values: np.ndarray) -> bool:
    """Whether a value occurs twice in the 1-D `values` (a sort: several times faster than
    `np.unique`, which hashes)."""
    if values.size < 2:
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def freeze(array: np.ndarray) -> np.ndarray:
    """Make an array the caller just created (and shares with no one) read-only, in place."""
    array.flags.writeable = False
    return array


@functools.lru_cache(maxsize=64)
def _full(size: int, value: int) -> SeqLens:
    return SeqLens.of_valid(freeze(np.full(size, value, dtype=INDEX_DTYPE)))


def _to_lens(values: object) -> np.ndarray:
    array = frozen_array(values)
    if array.size and int(array.min()) < 0:
        raise ValueError(f"lengths must be >= 0; got {array.tolist()[:16]}")
    return array


def index_array(indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """A bool mask or integer indices as an index array (an empty list indexes as integers)."""
    index = np.asarray(indices)
    return index.astype(np.intp) if index.size == 0 and index.dtype != bool else index


@attrs.frozen(eq=False, repr=False)
class SeqLens:
    """Lengths of the requests of a batch, in batch order, and their exact total."""

    lens: np.ndarray = attrs.field(converter=_to_lens)
    total: int = attrs.field(init=False)
    # The largest length, once asked (-1: not yet), and the offsets (None: not yet). Caches
    # of what the lengths determine, not part of the value.
    _max: int = attrs.field(init=False, default=-1, eq=False)
    _indptr: np.ndarray | None = attrs.field(init=False, default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "total", int(self.lens.sum()))

    # --- construction -------------------------------------------------------------------
    @classmethod
    def empty(cls) -> SeqLens:
        return cls(np.zeros(0, dtype=INDEX_DTYPE))

    @classmethod
    def full(cls, size: int, value: int) -> SeqLens:
        """`size` lengths of `value`. Values are immutable, so equal ones are shared (a
        decode step asks for ones(batch size) every step)."""
        if value < 0:
            raise ValueError(f"lengths must be >= 0; got {value}")
        return _full(int(size), int(value))

    @classmethod
    def of_valid(cls, lens: np.ndarray) -> SeqLens:
        """From read-only int64 1-D lengths known to be >= 0 (sums, picks or joins of SeqLens
        lengths): skips the conversion and the check, never the total, computed here."""
        return trusted(cls, lens=lens, total=int(lens.sum()))

    # --- reading ------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.lens.shape[0])

    def __getitem__(self, index: int) -> int:
        return int(self.lens[index])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SeqLens) and np.array_equal(self.lens, other.lens)

    def __hash__(self) -> int:
        return hash(self.lens.tobytes())

    def __repr__(self) -> str:
        return f"SeqLens({self.lens.tolist()}, total={self.total})"

    def tolist(self) -> list[int]:
        return self.lens.tolist()

    @property
    def max(self) -> int:
        if self._max < 0:  # computed once: the lengths never change
            object.__setattr__(self, "_max", int(self.lens.max()) if len(self) else 0)
        return self._max

    def indptr(self) -> np.ndarray:
        """Cumulative offsets, length len(self) + 1, last element == total (read-only: made
        once, as the lengths never change; a verify step asks for a tree's several times)."""
        out = self._indptr
        if out is None:
            out = np.zeros(self.lens.shape[0] + 1, dtype=INDEX_DTYPE)
            self.lens.cumsum(out=out[1:])
            out.flags.writeable = False
            object.__setattr__(self, "_indptr", out)
        return out

    def starts(self) -> np.ndarray:
        """Offset of each request's first element in a flat buffer of `total` elements."""
        return self.indptr()[:-1]

    def segment_ids(self) -> np.ndarray:
        """For each of the `total` flat elements, the index of the request it belongs to."""
        return np.repeat(np.arange(len(self), dtype=INDEX_DTYPE), self.lens)

    def offsets_within(self) -> np.ndarray:
        """For each flat element, its offset inside its request's segment (0, 1, ...)."""
        return np.arange(self.total, dtype=INDEX_DTYPE) - np.repeat(self.starts(), self.lens)

    # --- new values ---------------------------------------------------------------------
    def grow(self, deltas: object) -> SeqLens:
        """Each length plus its delta (a scalar or one per request)."""
        if type(deltas) is int and deltas >= 0:  # lengths only grow: nothing to check
            return SeqLens.of_valid(freeze(self.lens + deltas))
        delta = np.asarray(deltas, dtype=INDEX_DTYPE)
        lens = self.lens + delta
        if lens.shape != self.lens.shape:
            raise ValueError(
                f"grow needs one delta per request ({len(self)}) or a scalar; "
                f"got shape {delta.shape}"
            )
        growing = delta.ndim == 0 and int(delta) >= 0  # lengths only grow: nothing to check
        return SeqLens.of_valid(freeze(lens)) if growing else SeqLens(freeze(lens))

    def __add__(self, other: SeqLens) -> SeqLens:
        if len(other) != len(self):
            raise ValueError(f"cannot add SeqLens of {len(other)} requests to {len(self)}")
        return SeqLens.of_valid(freeze(self.lens + other.lens))

    def select(self, indices: Sequence[int] | np.ndarray) -> SeqLens:
        """The lengths at `indices` (a bool mask or integer indices), in that order."""
        return SeqLens.of_valid(freeze(self.lens[index_array(indices)]))

    def concat(self, *others: SeqLens) -> SeqLens:
        return SeqLens.of_valid(
            freeze(np.concatenate([self.lens, *(other.lens for other in others)]))
        )

    # --- a device mirror (a pass's metadata reaches the device in one `backends.base.upload`
    # of indptr() and lens) -------------------------------------------------------------
    def lens_to(self, device: torch.device | str) -> torch.Tensor:
        """The lengths as an int32 torch tensor on `device`."""
        import torch

        return torch.from_numpy(self.lens.astype(np.int32)).to(device, non_blocking=True)
