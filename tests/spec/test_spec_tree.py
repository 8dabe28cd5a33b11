"""Draft trees: validation, the batch form, and the verify inputs derived from it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import (
    DraftTree,
    ancestor_mask,
    child_links,
    parent_flat,
    positions,
    prune,
    stack,
)
from engine.spec.tree import reroot, unstack, with_roots
from engine.state import SeqLens


@st.composite
def draft_trees(draw: st.DrawFn, max_size: int = 12, vocab: int = 4) -> DraftTree:
    size = draw(st.integers(1, max_size))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=size, max_size=size))
    return DraftTree(tokens, parents)


def test_hand_built_links_positions_and_mask() -> None:
    #     0
    #   1   2
    #  3 4   5
    tree = DraftTree((9, 1, 2, 3, 4, 5), (-1, 0, 0, 1, 1, 2))
    trees = stack([DraftTree.root_only(7), tree])
    first_child, next_sibling = child_links(trees)
    assert first_child.tolist() == [-1, 1, 3, 5, -1, -1, -1]
    assert next_sibling.tolist() == [-1, -1, 2, -1, 4, -1, -1]
    assert parent_flat(trees).tolist() == [-1, -1, 1, 1, 2, 2, 3]
    assert positions(trees, SeqLens([4, 10])).tolist() == [4, 10, 11, 11, 12, 12, 12]
    mask = ancestor_mask(trees).astype(int)
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert unstack(trees) == [DraftTree.root_only(7), DraftTree(tree.tokens, tree.parents)]


@settings(max_examples=60, deadline=None)
@given(st.lists(draft_trees(), min_size=1, max_size=5))
def test_links_and_mask_agree_with_parents(trees_list: list[DraftTree]) -> None:
    trees = stack(trees_list)
    first_child, next_sibling = child_links(trees)
    mask = ancestor_mask(trees)
    flat = 0
    for tree in trees_list:
        size = len(tree.tokens)
        for node in range(size):
            children = [c for c in range(size) if tree.parents[c] == node]
            linked = []
            child = first_child[flat + node]
            while child >= 0:
                linked.append(int(child))
                child = next_sibling[flat + child]
            assert linked == children
            ancestors = set()
            walk = node
            while walk >= 0:
                ancestors.add(walk)
                walk = tree.parents[walk]
            row = mask[flat + node]
            assert {j for j in range(row.shape[0]) if row[j]} == ancestors
        flat += size


def test_invalid_trees_are_rejected() -> None:
    with pytest.raises(ValueError, match="needs a root"):
        DraftTree((), ())
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree((1, 2), (-1,))
    with pytest.raises(ValueError, match=r"node 0 is the root \(parent -1\); got parent 0"):
        DraftTree((1, 2), (0, 0))
    with pytest.raises(ValueError, match="node 2 has parent 2; a parent must be an earlier"):
        DraftTree((1, 2, 3), (-1, 0, 2))
    with pytest.raises(ValueError, match="at most 63"):
        DraftTree(range(64), [-1, *range(63)])
    with pytest.raises(ValueError, match="2 prefix lengths for 1 trees"):
        positions(stack([DraftTree.root_only(1)]), SeqLens([1, 2]))
    assert np.array_equal(child_links(stack([DraftTree.root_only(1)]))[0], [-1])


def test_prune_drops_a_node_and_everything_below_it() -> None:
    #     0          tree 0: node 1 dropped takes 3 and 4 with it; tree 1 keeps its root
    #   1   2        though it is marked; tree 2 is kept whole
    #  3 4   5
    trees = stack(
        [
            DraftTree((9, 1, 2, 3, 4, 5), (-1, 0, 0, 1, 1, 2)),
            DraftTree((7, 8), (-1, 0)),
            DraftTree((6,), (-1,)),
        ]
    )
    keep = np.ones(trees.sizes.total, dtype=bool)
    keep[[1, 6]] = False  # tree 0's node 1; tree 1's root
    pruned = unstack(prune(trees, keep))
    assert [(t.tokens, t.parents) for t in pruned] == [
        ((9, 2, 5), (-1, 0, 1)),
        ((7, 8), (-1, 0)),
        ((6,), (-1,)),
    ]
    assert prune(trees, np.ones(trees.sizes.total, dtype=bool)) is trees
    with pytest.raises(ValueError, match="keep has"):
        prune(trees, np.ones(3, dtype=bool))


@settings(max_examples=200)
@given(st.lists(draft_trees(), min_size=1, max_size=4), st.data())
def test_prune_keeps_exactly_the_nodes_whose_whole_path_is_kept(
    trees: list[DraftTree], data: st.DataObject
) -> None:
    batch = stack(trees)
    keep = np.array(
        data.draw(st.lists(st.booleans(), min_size=batch.sizes.total, max_size=batch.sizes.total)),
        dtype=bool,
    )
    pruned = unstack(prune(batch, keep))
    flat = 0
    for tree, got in zip(trees, pruned, strict=True):

        def path_kept(node: int) -> bool:
            while node > 0:
                if not keep[flat + node]:
                    return False
                node = tree.parents[node]
            return True

        kept = [n for n in range(len(tree.tokens)) if path_kept(n)]
        assert got.tokens == tuple(tree.tokens[n] for n in kept)
        remap = {old: new for new, old in enumerate(kept)}
        assert got.parents == tuple(-1 if n == 0 else remap[tree.parents[n]] for n in kept)
        flat += len(tree.tokens)


def test_reroot_takes_the_subtree_under_the_roots_first_child() -> None:
    #       9            the root's first child (node 1) is the guess for the token after 9:
    #    1     2         its subtree, rooted at it, is what the next step would verify
    #   3 4     5
    #   6
    trees = stack(
        [
            DraftTree((9, 1, 2, 3, 4, 5, 6), (-1, 0, 0, 1, 1, 2, 3)),
            DraftTree((7,), (-1,)),
            DraftTree((8, 2), (-1, 0)),
        ]
    )
    rerooted, guesses = reroot(trees)
    assert unstack(rerooted) == [
        DraftTree((1, 3, 4, 6), (-1, 0, 0, 1)),
        DraftTree((7,), (-1,)),
        DraftTree((2,), (-1,)),
    ]
    assert guesses.tolist() == [1, -1, 2]
    assert unstack(with_roots(rerooted, [5, 6, 7]))[0] == DraftTree((5, 3, 4, 6), (-1, 0, 0, 1))
    with pytest.raises(ValueError, match="2 root tokens for 3 trees"):
        with_roots(rerooted, [5, 6])


@settings(max_examples=200)
@given(st.lists(draft_trees(), min_size=1, max_size=5))
def test_reroot_keeps_exactly_the_first_childs_descendants(trees: list[DraftTree]) -> None:
    rerooted, guesses = reroot(stack(trees))
    for tree, got, guess in zip(trees, unstack(rerooted), guesses.tolist(), strict=True):
        if len(tree.tokens) == 1:
            assert got == tree and guess == -1
            continue

        def below_first_child(node: int) -> bool:
            while node > 1:
                node = tree.parents[node]
            return node == 1

        kept = [n for n in range(len(tree.tokens)) if below_first_child(n)]
        remap = {old: new for new, old in enumerate(kept)}
        assert guess == tree.tokens[1]
        assert got.tokens == tuple(tree.tokens[n] for n in kept)
        assert got.parents == tuple(-1 if n == 1 else remap[tree.parents[n]] for n in kept)
