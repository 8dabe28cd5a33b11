"""The snapshot of one forward pass: what the attention backends and the model read.

A `Batch` is the `Running` state before the pass plus, per request, the tokens computed in
this pass (`new_lens`), their inputs and the KV slots they are written to, and the draft trees
when verifying. `seq_lens` (prefix + new) is derived, never passed in.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence

import attrs
import numpy as np

from engine.state.debug import DEBUG, trusted
from engine.state.running import Running
from engine.state.seqlens import INDEX_DTYPE, SeqLens, freeze, frozen_array

# The KV slot that padded entries (a CUDA graph's padding tokens) write to: never handed to a
# request, so the pools hold capacity + 1 slots.
PADDING_SLOT = 0

MAX_TREE_NODES = 63  # ancestor masks are int64 bit sets


class Mode(enum.Enum):
    """What a pass computes, derived from its counts (`Batch.mode`): nothing; prompt chunks
    (and, in a mixed pass, pending decode tokens); one pending token per request; draft trees."""

    IDLE = "idle"
    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


@attrs.frozen(eq=False)
class DraftTrees:
    """One draft tree per request, flattened in batch order.

    Node 0 of each tree is its root: the request's pending token (its KV is computed in the
    verify pass). `parents` holds local indices (root: -1) and every parent precedes its child.
    """

    sizes: SeqLens
    tokens: np.ndarray = attrs.field(converter=frozen_array)
    parents: np.ndarray = attrs.field(converter=frozen_array)
    depths: np.ndarray = attrs.field(init=False)
    ancestor_bits: np.ndarray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        total = self.sizes.total
        if self.tokens.shape[0] != total or self.parents.shape[0] != total:
            raise ValueError(
                f"draft trees have {self.tokens.shape[0]} tokens and "
                f"{self.parents.shape[0]} parents; sizes sum to {total}"
            )
        if len(self.sizes) and (self.sizes.lens < 1).any():
            raise ValueError("every draft tree has at least its root")
        if total and int(self.tokens.min()) < 0:
            raise ValueError("draft tree tokens must be token ids >= 0")
        if self.sizes.max > MAX_TREE_NODES:
            raise ValueError(
                f"a draft tree has {self.sizes.max} nodes; at most {MAX_TREE_NODES} are allowed"
            )
        if total == len(self.sizes):  # roots only (sizes >= 1: checked): nothing to walk
            if (self.parents != -1).any():
                raise ValueError("node 0 of every draft tree must be its root (parent -1)")
            object.__setattr__(self, "depths", freeze(np.zeros(total, INDEX_DTYPE)))
            object.__setattr__(self, "ancestor_bits", freeze(np.ones(total, np.int64)))
            return
        local = self.sizes.offsets_within()
        is_root = local == 0
        if (self.parents[is_root] != -1).any():
            raise ValueError("node 0 of every draft tree must be its root (parent -1)")
        rest = ~is_root
        if ((self.parents[rest] < 0) | (self.parents[rest] >= local[rest])).any():
            raise ValueError("every non-root node's parent must be an earlier node of its tree")
        depths, bits = _depths_and_ancestors(self.sizes, self.parents, local)
        object.__setattr__(self, "depths", freeze(depths))
        object.__setattr__(self, "ancestor_bits", freeze(bits))

    @classmethod
    def from_lists(
        cls, tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]
    ) -> DraftTrees:
        if [len(t) for t in tokens] != [len(p) for p in parents]:
            raise ValueError(
                f"draft trees have {[len(t) for t in tokens]} tokens and "
                f"{[len(p) for p in parents]} parents; each tree needs one each"
            )
        sizes = SeqLens([len(t) for t in tokens])
        flat_tokens = np.fromiter((x for t in tokens for x in t), dtype=INDEX_DTYPE)
        flat_parents = np.fromiter((x for p in parents for x in p), dtype=INDEX_DTYPE)
        return cls(sizes, flat_tokens, flat_parents)

    @classmethod
    def from_flat(
        cls, sizes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
    ) -> DraftTrees:
        """From flat lists in batch order (`parents` local, as stored): checked, with the
        depths and ancestor bits derived, in one pass over the nodes. A proposer's trees hold
        a few dozen nodes, less work than numpy's cost per call (the checked constructor's
        pointer jumping)."""
        if sum(sizes) != len(tokens) or len(parents) != len(tokens):
            raise ValueError(
                f"draft trees have {len(tokens)} tokens and {len(parents)} parents; sizes "
                f"sum to {sum(sizes)}"
            )
        if tokens and min(tokens) < 0:
            raise ValueError("draft tree tokens must be token ids >= 0")
        depths: list[int] = []
        bits: list[int] = []
        start = 0
        for size in sizes:
            if not 1 <= size <= MAX_TREE_NODES:
                raise ValueError(
                    f"a draft tree has {size} nodes; it needs its root and at most "
                    f"{MAX_TREE_NODES} are allowed"
                )
            if parents[start] != -1:
                raise ValueError("node 0 of every draft tree must be its root (parent -1)")
            depths.append(0)
            bits.append(1)
            for local in range(1, size):
                parent = parents[start + local]
                if not 0 <= parent < local:
                    raise ValueError(
                        "every non-root node's parent must be an earlier node of its tree"
                    )
                depths.append(depths[start + parent] + 1)
                bits.append(bits[start + parent] | 1 << local)
            start += size
        return trusted(
            cls,
            sizes=SeqLens.of_valid(frozen_array(sizes)),
            tokens=frozen_array(tokens),
            parents=frozen_array(parents),
            depths=frozen_array(depths),
            ancestor_bits=frozen_array(bits),
        )

    @classmethod
    def roots_only(cls, root_tokens: np.ndarray) -> DraftTrees:
        """A tree of its root alone per token (most steps of free text): only the tokens are
        checked, the rest is so by construction (shared read-only columns per batch size)."""
        tokens = frozen_array(root_tokens)
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError("draft tree tokens must be token ids >= 0")
        parents, depths, bits = _root_columns(tokens.shape[0])
        return trusted(
            cls,
            sizes=SeqLens.full(tokens.shape[0], 1),
            tokens=tokens,
            parents=parents,
            depths=depths,
            ancestor_bits=bits,
        )


@functools.lru_cache(maxsize=64)
def _root_columns(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parents (-1), depths (0) and ancestor bits (1) of `size` roots-only trees."""
    return (
        freeze(np.full(size, -1, dtype=INDEX_DTYPE)),
        freeze(np.zeros(size, INDEX_DTYPE)),
        freeze(np.ones(size, np.int64)),
    )


def _depths_and_ancestors(
    sizes: SeqLens, parents: np.ndarray, local: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Depth of each node and its ancestor-or-self set as bits over local node indices.

    Pointer jumping: each node holds the bits of the path from it up to (excluding) `jump`,
    and `jump` doubles its distance every round, so log2(max depth) rounds reach the root.
    """
    is_root = local == 0
    flat = np.arange(sizes.total, dtype=INDEX_DTYPE)
    jump = np.where(is_root, flat, flat - local + parents)  # parent (a root: itself)
    depths = (~is_root).astype(INDEX_DTYPE)
    bits = np.left_shift(np.int64(1), local).astype(np.int64)
    for _ in range(max(sizes.max - 1, 0).bit_length()):
        depths = depths + depths[jump]
        bits |= bits[jump]
        jump = jump[jump]
    return depths, bits


@functools.lru_cache(maxsize=64)
def _all_true(size: int) -> np.ndarray:
    """`size` read-only True flags (shared: a decode or verify pass asks every step)."""
    return freeze(np.ones(size, dtype=bool))


def _optional_rows(values: object) -> np.ndarray | None:
    return None if values is None else frozen_array(np.asarray(values, dtype=INDEX_DTYPE))


@attrs.frozen(eq=False)
class Batch:
    """One forward pass over every request of `running`."""

    running: Running
    new_lens: SeqLens
    input_ids: np.ndarray = attrs.field(converter=frozen_array)
    out_slots: np.ndarray = attrs.field(converter=frozen_array)
    trees: DraftTrees | None = None
    # new tokens whose logits the pass returns too, after the logit rows' (flat, increasing;
    # None: none): the rows that score prompt tokens (`SamplingParams.prompt_logprobs`)
    score_rows: np.ndarray | None = attrs.field(default=None, converter=_optional_rows)
    seq_lens: SeqLens = attrs.field(init=False)
    mode: Mode = attrs.field(init=False)  # derived from the counts here, never passed in
    # `positions`, once asked (None: not yet). A cache: not part of the value.
    _positions: np.ndarray | None = attrs.field(init=False, default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        run = self.running
        n = len(run)
        if len(self.new_lens) != n:
            raise ValueError(f"new_lens has {len(self.new_lens)} entries; the batch has {n}")
        total = self.new_lens.total
        if self.input_ids.shape[0] != total or self.out_slots.shape[0] != total:
            raise ValueError(
                f"{total} new tokens need as many input ids and slots; got "
                f"{self.input_ids.shape[0]} ids and {self.out_slots.shape[0]} slots"
            )
        mode = Mode.IDLE if total == 0 else Mode.EXTEND
        if self.trees is None:
            # n pending tokens in all, none more than one a request: one each (a total alone
            # allows [2, 0])
            if (
                total == n
                and total
                and self.new_lens.max == 1
                and run.token_lens.total - run.kv_lens.total == n
                and run.pending_lens.max() == 1
            ):
                mode = Mode.DECODE  # n tokens, at most 1 each: exactly 1 each, all pending
            elif n and (self.new_lens.lens > (room := run.pending_lens)).any():
                raise ValueError(
                    f"new tokens {self.new_lens} exceed the pending tokens {room.tolist()}"
                )
        else:
            if self.trees.sizes is not self.new_lens and self.trees.sizes != self.new_lens:
                raise ValueError("a verify pass computes exactly the draft trees' nodes")
            if n and (run.pending_lens != 1).any():
                raise ValueError("verify needs every request to have exactly one pending token")
            mode = Mode.VERIFY if total else Mode.IDLE
        # Decode: one new token each, exactly the one pending, so prefix + new == token_lens.
        seq = run.token_lens if mode == Mode.DECODE else run.kv_lens + self.new_lens
        # Without trees, seq <= token_lens <= max_context already (new <= pending).
        if n and (self.trees is not None or DEBUG) and seq.max > run.max_context:
            raise ValueError(
                f"a request reaches {seq.max} tokens; max_context is {run.max_context}"
            )
        if DEBUG and seq.total != self.running.kv_lens.total + total:
            raise ValueError(f"stale total: seq_lens {seq} != prefix + new {total}")
        object.__setattr__(self, "seq_lens", seq)
        object.__setattr__(self, "mode", mode)
        rows = self.score_rows
        if (
            rows is not None
            and rows.size
            and (
                mode != Mode.EXTEND
                or rows[0] < 0
                or rows[-1] >= total
                or (rows.size > 1 and (np.diff(rows) <= 0).any())
            )
        ):
            raise ValueError(
                f"score_rows {rows.tolist()} must be increasing new-token indices in "
                f"[0, {total}) of an extend pass"
            )

    # --- derived ------------------------------------------------------------------------
    @property
    def prefix_lens(self) -> SeqLens:
        return self.running.kv_lens

    @property
    def positions(self) -> np.ndarray:
        """Position of each new token: prefix length plus offset (or tree depth)."""
        positions = self._positions
        if positions is None:  # computed once (the runner and the commit both read it)
            if self.mode == Mode.DECODE:  # one token each, at its committed length
                positions = self.prefix_lens.lens
            else:
                within = (
                    self.trees.depths if self.trees is not None else self.new_lens.offsets_within()
                )
                positions = freeze(np.repeat(self.prefix_lens.lens, self.new_lens.lens) + within)
            object.__setattr__(self, "_positions", positions)
        return positions

    @property
    def samples(self) -> np.ndarray:
        """Whether each request yields a next token (an extend chunk short of the end: no)."""
        if self.trees is not None or self.mode == Mode.DECODE:  # every request samples
            return _all_true(len(self.running))
        return freeze(
            (self.seq_lens.lens == self.running.token_lens.lens) & (self.new_lens.lens > 0)
        )

    @property
    def logit_rows(self) -> np.ndarray:
        """Flat index of the new token whose logits are sampled, for requests that sample
        (the last token of the chunk); every tree node's logits are kept when verifying."""
        if self.trees is not None:
            return freeze(np.arange(self.new_lens.total, dtype=INDEX_DTYPE))
        ends = self.new_lens.indptr()[1:] - 1
        return freeze(ends[self.samples])

    @property
    def output_rows(self) -> np.ndarray:
        """The rows whose logits the pass returns: the logit rows, then the score rows."""
        if self.score_rows is None:
            return self.logit_rows
        return freeze(np.concatenate([self.logit_rows, self.score_rows]))
