"""Draft trees: one request's tree, the batch form (`engine.state.DraftTrees`), and the verify
inputs derived from it as pure values (links between nodes, positions, a dense ancestor mask).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from engine.state.batch import MAX_TREE_NODES, DraftTrees
from engine.state.seqlens import INDEX_DTYPE, SeqLens


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _check_tree(tree: DraftTree, _attribute: object, _value: object) -> None:
    size = len(tree.tokens)
    if size < 1 or len(tree.parents) != size:
        raise ValueError(
            f"a draft tree needs a root and one parent per token; got "
            f"{size} tokens and {len(tree.parents)} parents"
        )
    if size > MAX_TREE_NODES:
        raise ValueError(f"a draft tree has {size} nodes; at most {MAX_TREE_NODES} are allowed")
    if tree.parents[0] != -1:
        raise ValueError(f"node 0 is the root (parent -1); got parent {tree.parents[0]}")
    for local, parent in enumerate(tree.parents[1:], start=1):
        if not 0 <= parent < local:
            raise ValueError(f"node {local} has parent {parent}; a parent must be an earlier node")


@attrs.frozen
class DraftTree:
    """One request's draft: `tokens[0]` is the root (its pending token); `parents[i]` is the
    local index of node i's parent (root: -1) and precedes i. `match_len` is the suffix length
    the draft was found with (0: no match, a root-only tree)."""

    tokens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    parents: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_check_tree)
    match_len: int = 0

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls((root_token,), (-1,))


def stack(trees: Sequence[DraftTree]) -> DraftTrees:
    """The batch form of `trees`, in order."""
    return DraftTrees.from_lists([t.tokens for t in trees], [t.parents for t in trees])


def unstack(trees: DraftTrees) -> list[DraftTree]:
    """One `DraftTree` per request (for tests and inspection)."""
    bounds = trees.sizes.indptr().tolist()
    return [
        DraftTree(trees.tokens[a:b].tolist(), trees.parents[a:b].tolist())
        for a, b in itertools.pairwise(bounds)
    ]


def parent_flat(trees: DraftTrees) -> np.ndarray:
    """Flat index of each node's parent (roots: -1)."""
    starts = np.repeat(trees.sizes.starts(), trees.sizes.lens)
    return np.where(trees.parents >= 0, starts + trees.parents, -1)


def child_links(trees: DraftTrees) -> tuple[np.ndarray, np.ndarray]:
    """(first_child, next_sibling): local node ids per flat node, -1 where there is none.
    Children are ordered by their local index (the proposer's rank order)."""
    total = trees.sizes.total
    first_child = np.full(total, -1, dtype=INDEX_DTYPE)
    next_sibling = np.full(total, -1, dtype=INDEX_DTYPE)
    parents = parent_flat(trees)
    children = np.flatnonzero(parents >= 0)  # ascending, so siblings come in local order
    if children.size == 0:
        return first_child, next_sibling
    local = trees.sizes.offsets_within()
    order = np.argsort(parents[children], kind="stable")
    child_sorted, parent_sorted = children[order], parents[children][order]
    unique_parents, first_index = np.unique(parent_sorted, return_index=True)
    first_child[unique_parents] = local[child_sorted[first_index]]
    same_parent = parent_sorted[:-1] == parent_sorted[1:]
    next_sibling[child_sorted[:-1][same_parent]] = local[child_sorted[1:][same_parent]]
    return first_child, next_sibling


def positions(trees: DraftTrees, prefix_lens: SeqLens) -> np.ndarray:
    """Position of each node: its request's prefix length plus its depth."""
    if len(prefix_lens) != len(trees.sizes):
        raise ValueError(f"{len(prefix_lens)} prefix lengths for {len(trees.sizes)} trees")
    return np.repeat(prefix_lens.lens, trees.sizes.lens) + trees.depths


def ancestor_mask(trees: DraftTrees) -> np.ndarray:
    """Dense [total, max_size] bool: node j (local) is an ancestor of, or is, each flat node."""
    width = max(trees.sizes.max, 1)
    bits = trees.ancestor_bits[:, None] >> np.arange(width, dtype=np.int64)[None, :]
    return (bits & 1).astype(bool)


def prune(trees: DraftTrees, keep: np.ndarray) -> DraftTrees:
    """`trees` without the nodes `keep` (one bool per flat node) drops, and without every
    node below a dropped one; roots always stay. The same value when nothing is dropped."""
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != (trees.sizes.total,):
        raise ValueError(f"keep has {keep.shape} entries; the trees have {trees.sizes.total} nodes")
    parents = parent_flat(trees)
    is_root = parents < 0
    kept = keep | is_root
    if kept.all():
        return trees
    jump = np.where(is_root, np.arange(trees.sizes.total), parents)
    for _ in range(int(trees.depths.max())):  # a node stays only if its whole path does
        kept = kept & kept[jump]
        jump = jump[jump]
    owner = trees.sizes.segment_ids()
    sizes = np.bincount(owner[kept], minlength=len(trees.sizes))
    new_flat = np.cumsum(kept) - 1
    new_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    new_local = new_flat - new_starts[owner]
    new_parents = np.where(is_root, -1, new_local[np.maximum(parents, 0)])
    return DraftTrees(SeqLens(sizes), trees.tokens[kept], new_parents[kept].astype(INDEX_DTYPE))


def reroot(trees: DraftTrees) -> tuple[DraftTrees, np.ndarray]:
    """Each tree's subtree under its root's first child (the proposer's best guess for the
    token after the root), rooted at that child, and the guessed tokens (-1 where a tree is
    its root alone: it stays so). The drafts of the step after the root's token, if the
    token is the guess: a verify pass can be launched with them before the token is known
    (its root the token, as the device sampled it)."""
    # a tree's node 1, where it has one, is its root's first child (parents come first):
    # the root's other children go, with everything below them
    local = trees.sizes.offsets_within()
    kept = prune(trees, (trees.parents != 0) | (local == 1))
    has_guess = kept.sizes.lens > 1
    starts = kept.sizes.starts()
    guesses = np.where(has_guess, kept.tokens[np.where(has_guess, starts + 1, starts)], -1)
    # then each guessed tree's root: its only child becomes the root, every node one earlier
    guessed = has_guess[kept.sizes.segment_ids()]
    stays = ~(guessed & (kept.parents < 0))
    parents = np.where(guessed, kept.parents - 1, kept.parents)[stays]
    rerooted = DraftTrees(
        SeqLens(kept.sizes.lens - has_guess), kept.tokens[stays], parents.astype(INDEX_DTYPE)
    )
    return rerooted, guesses.astype(INDEX_DTYPE)


def with_roots(trees: DraftTrees, roots: np.ndarray) -> DraftTrees:
    """`trees` with each root's token replaced by `roots` (one per tree)."""
    roots = np.asarray(roots, dtype=INDEX_DTYPE).reshape(-1)
    if roots.shape[0] != len(trees.sizes):
        raise ValueError(f"{roots.shape[0]} root tokens for {len(trees.sizes)} trees")
    tokens = trees.tokens.copy()
    tokens[trees.sizes.starts()] = roots
    return DraftTrees(trees.sizes, tokens, trees.parents)
