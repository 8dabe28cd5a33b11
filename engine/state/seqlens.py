"""Per-request lengths and their total as one immutable value.

The total is computed from the lengths when the value is made and can never be passed in,
so no code path can leave it stale (the bug family this project exists to remove).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

INDEX_DTYPE = np.int64


def frozen_array(values: object, dtype: type = INDEX_DTYPE) -> np.ndarray:
    """A read-only 1-D copy of `values` (a snapshot never shares a writeable buffer)."""
    array = np.array(values, dtype=dtype, copy=True).reshape(-1)
    array.flags.writeable = False
    return array


def _to_lens(values: object) -> np.ndarray:
    array = frozen_array(values)
    if array.size and int(array.min()) < 0:
        raise ValueError(f"lengths must be >= 0; got {array.tolist()[:16]}")
    return array


@attrs.frozen(eq=False, repr=False)
class SeqLens:
    """Lengths of the requests of a batch, in batch order, and their exact total."""

    lens: np.ndarray = attrs.field(converter=_to_lens)
    total: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "total", int(self.lens.sum()))

    # --- construction -------------------------------------------------------------------
    @classmethod
    def empty(cls) -> SeqLens:
        return cls(np.zeros(0, dtype=INDEX_DTYPE))

    @classmethod
    def full(cls, size: int, value: int) -> SeqLens:
        return cls(np.full(size, value, dtype=INDEX_DTYPE))

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
        return int(self.lens.max()) if len(self) else 0

    def indptr(self) -> np.ndarray:
        """Cumulative offsets, length len(self) + 1, last element == total."""
        out = np.zeros(len(self) + 1, dtype=INDEX_DTYPE)
        np.cumsum(self.lens, out=out[1:])
        out.flags.writeable = False
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
        delta_array = np.broadcast_to(np.asarray(deltas, dtype=INDEX_DTYPE), self.lens.shape)
        return SeqLens(self.lens + delta_array)

    def __add__(self, other: SeqLens) -> SeqLens:
        if len(other) != len(self):
            raise ValueError(f"cannot add SeqLens of {len(other)} requests to {len(self)}")
        return SeqLens(self.lens + other.lens)

    def select(self, indices: Sequence[int] | np.ndarray) -> SeqLens:
        """The lengths at `indices` (a bool mask or integer indices), in that order."""
        return SeqLens(self.lens[np.asarray(indices)])

    def concat(self, *others: SeqLens) -> SeqLens:
        return SeqLens(np.concatenate([self.lens, *(other.lens for other in others)]))

    # --- device mirrors: derived here and nowhere else ------------------------------------
    def to_device(self, device: object) -> tuple[object, object]:
        """(int32 lengths, int32 indptr) as torch tensors on `device`."""
        import torch

        lens = torch.from_numpy(self.lens.astype(np.int32)).to(device, non_blocking=True)
        indptr = torch.from_numpy(self.indptr().astype(np.int32)).to(device, non_blocking=True)
        return lens, indptr
