"""Draft trees: validation, the batch form, and the verify inputs derived from it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import DraftTree, ancestor_mask, child_links, parent_flat, positions, stack
from engine.spec.tree import unstack
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
