"""Greedy verify: exact hand-built cases, a sequential reference, and the state transition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import DraftTree, stack, verify_greedy
from engine.state import (
    MAX_TREE_NODES,
    FinishRules,
    Running,
    SeqLens,
    schedule_verify,
    verify,
)

#     0:5
#   1:6   2:7
#  3:8 4:6   5:9
TREE = DraftTree((5, 6, 7, 8, 6, 9), (-1, 0, 0, 1, 1, 2))


def outcome_lists(trees: list[DraftTree], argmax: list[int]) -> tuple[list, list, list]:
    result = verify_greedy(stack(trees), np.array(argmax))
    return result.accepted_lens.tolist(), result.accepted_nodes.tolist(), result.bonus.tolist()


@pytest.mark.parametrize(
    ("argmax", "accepted", "bonus"),
    [
        ([6, 8, 0, 0, 0, 0], [1, 3], 0),  # root -> 1:6 -> 3:8, a leaf: bonus from node 3
        ([6, 6, 0, 0, 3, 0], [1, 4], 3),  # at node 1 the argmax is 6: the second child
        ([7, 6, 9, 0, 0, 4], [2, 5], 4),  # the root's second child, then its child
        ([6, 2, 0, 0, 0, 0], [1], 2),  # node 1's children both rejected: bonus 2 from node 1
        ([3, 8, 9, 0, 0, 0], [], 3),  # nothing accepted: bonus is the root's argmax
    ],
)
def test_hand_built_paths(argmax: list[int], accepted: list[int], bonus: int) -> None:
    assert outcome_lists([TREE], argmax) == ([len(accepted)], accepted, [bonus])


def test_root_only_trees_and_logits_input() -> None:
    trees = [DraftTree.root_only(4), TREE, DraftTree.root_only(1)]
    argmax = [2, 6, 8, 0, 0, 0, 0, 3]
    assert outcome_lists(trees, argmax) == ([0, 2, 0], [1, 3], [2, 0, 3])
    logits = torch.full((8, 10), -1.0)
    logits[torch.arange(8), torch.tensor(argmax)] = 5.0
    result = verify_greedy(stack(trees), logits)
    assert result.bonus.tolist() == [2, 0, 3] and result.accepted_nodes.tolist() == [1, 3]
    assert result.emitted(stack(trees)) == [[2], [6, 8, 0], [3]]
    with pytest.raises(ValueError, match="the target gives 7 entries; the trees have 8 nodes"):
        verify_greedy(stack(trees), argmax[:7])


def sequential_reference(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    node, path = 0, []
    while True:
        children = [c for c in range(len(tree.tokens)) if tree.parents[c] == node]
        match = [c for c in children if tree.tokens[c] == argmax[node]]
        if not match:
            return path, argmax[node]
        node = match[0]
        path.append(node)


@st.composite
def tree_and_argmax(draw: st.DrawFn) -> tuple[DraftTree, list[int]]:
    size = draw(st.integers(1, 14))
    parents = [-1] + [draw(st.integers(max(0, i - 3), i - 1)) for i in range(1, size)]
    tokens = draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    argmax = draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    return DraftTree(tokens, parents), argmax


@settings(max_examples=150, deadline=None)
@given(st.lists(tree_and_argmax(), min_size=1, max_size=6))
def test_equals_sequential_reference(cases: list[tuple[DraftTree, list[int]]]) -> None:
    trees = [tree for tree, _ in cases]
    lens, nodes, bonus = outcome_lists(trees, [a for _, argmax in cases for a in argmax])
    expected = [sequential_reference(tree, argmax) for tree, argmax in cases]
    assert lens == [len(path) for path, _ in expected]
    assert nodes == [node for path, _ in expected for node in path]
    assert bonus == [b for _, b in expected]


def test_a_node_of_another_branch_with_the_wanted_token_is_skipped() -> None:
    # root -> 2:7 is accepted; node 3 holds the wanted 9 but hangs below node 1, so the walk
    # takes node 4, the first child of node 2 with it.
    tree = DraftTree((5, 6, 7, 9, 9), (-1, 0, 0, 1, 2))
    assert outcome_lists([tree], [7, 0, 9, 0, 4]) == ([2], [2, 4], [4])


@st.composite
def wide_tree_and_argmax(draw: st.DrawFn) -> tuple[DraftTree, list[int]]:
    """Trees up to the largest allowed, each parent any earlier node."""
    size = draw(st.integers(1, MAX_TREE_NODES))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    argmax = draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    return DraftTree(tokens, parents), argmax


@settings(max_examples=100, deadline=None)
@given(st.lists(wide_tree_and_argmax(), min_size=1, max_size=8), st.booleans())
def test_large_trees_equal_sequential_reference(
    cases: list[tuple[DraftTree, list[int]]], as_logits: bool
) -> None:
    trees = [tree for tree, _ in cases]
    argmax = [a for _, values in cases for a in values]
    target: object = np.array(argmax)
    if as_logits:
        logits = torch.zeros(len(argmax), 4)
        logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
        target = logits
    result = verify_greedy(stack(trees), target)
    expected = [sequential_reference(tree, values) for tree, values in cases]
    assert result.accepted_lens.tolist() == [len(path) for path, _ in expected]
    assert result.accepted_nodes.tolist() == [node for path, _ in expected for node in path]
    assert result.bonus.tolist() == [b for _, b in expected]
    assert result.accepted_nodes.dtype == result.bonus.dtype == np.int64


def test_outcome_commits_through_the_state_verify() -> None:
    trees = [TREE, DraftTree.root_only(3)]
    token_lens = np.array([10, 4])
    running = Running(
        [11, 12],
        [0, 1],
        SeqLens(token_lens - 1),
        SeqLens(token_lens),
        [8, 2],
        [5, 3],
        FinishRules([100, 100], [0, 0], [-1, -1], np.zeros((2, 0))),
        64,
    )
    batch = schedule_verify(running, stack(trees), np.arange(1, 8))
    result = verify_greedy(batch.trees, np.array([6, 6, 0, 0, 3, 0, 1]))
    after = verify(batch, result.accepted_lens, result.accepted_nodes, result.bonus)
    assert after.effects.emitted() == {11: [6, 6, 3], 12: [1]}
    assert after.running.kv_lens.tolist() == [12, 4]
    assert sorted(after.effects.free_slots.tolist()) == [3, 4, 6]  # nodes 2, 3, 5 of tree 0
