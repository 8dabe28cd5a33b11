"""Sampling verify: it emits exactly the target distribution (chi-square), it is reproducible
per request, and a one-hot target makes it greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from engine.spec import DraftTree, request_rng, stack, verify_greedy, verify_sampling

VOCAB = 6
SAMPLES = 12_000
# Children in rank order, a repeated sibling token (3) and a branch below a rejected sibling.
TEMPLATE = DraftTree((0, 2, 3, 3, 1, 5, 4, 2), (-1, 0, 0, 0, 1, 1, 2, 4))


def markov_target(seed: int = 7) -> np.ndarray:
    """P[a] = distribution of the next token after token a; every entry >= 1/12."""
    rng = np.random.default_rng(seed)
    return 0.5 / VOCAB + 0.5 * rng.dirichlet(np.full(VOCAB, 1.0), size=VOCAB)


def node_probs(trees: list[DraftTree], table: np.ndarray) -> torch.Tensor:
    """The target at each node depends on the node's token (a Markov target)."""
    return torch.from_numpy(table[[t for tree in trees for t in tree.tokens]])


def rerooted(root: int) -> DraftTree:
    return DraftTree((root, *TEMPLATE.tokens[1:]), TEMPLATE.parents)


def first_two_tokens(table: np.ndarray, seed: int) -> np.ndarray:
    """Emit until every request has two tokens: one verify step, then another where needed."""
    rngs = [request_rng(rid, seed + rid) for rid in range(SAMPLES)]
    trees = [TEMPLATE] * SAMPLES
    first = verify_sampling(stack(trees), node_probs(trees, table), rngs)
    emitted = first.emitted(stack(trees))
    short = [i for i, tokens in enumerate(emitted) if len(tokens) < 2]
    again = [rerooted(emitted[i][-1]) for i in short]
    second = verify_sampling(stack(again), node_probs(again, table), [rngs[i] for i in short])
    for i, tokens in zip(short, second.emitted(stack(again)), strict=True):
        emitted[i] = emitted[i] + tokens
    return np.array([tokens[:2] for tokens in emitted])


def test_first_token_and_first_pair_follow_the_target() -> None:
    table = markov_target()
    pairs = first_two_tokens(table, seed=1234)
    root = TEMPLATE.tokens[0]
    first_counts = np.bincount(pairs[:, 0], minlength=VOCAB)
    assert chisquare(first_counts, SAMPLES * table[root]).pvalue > 1e-3
    pair_counts = np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    pair_expected = (table[root][:, None] * table).reshape(-1) * SAMPLES
    assert chisquare(pair_counts, pair_expected).pvalue > 1e-3
    # The test has power: the same counts are far from a slightly different target.
    wrong = table[root] ** 1.3 / (table[root] ** 1.3).sum()
    assert chisquare(first_counts, SAMPLES * wrong).pvalue < 1e-6


def test_reproducible_per_request() -> None:
    table = markov_target()
    trees = [TEMPLATE] * 50
    probs = node_probs(trees, table)

    def run(seed: int) -> list[list[int]]:
        rngs = [request_rng(rid, None if seed is None else seed + rid) for rid in range(50)]
        return verify_sampling(stack(trees), probs, rngs).emitted(stack(trees))

    assert run(5) == run(5)
    assert run(None) == run(None)
    assert run(5) != run(6) and run(5) != run(None)
    # A request's draws depend on its own generator only, not on its batch neighbours.
    alone = verify_sampling(stack(trees[:1]), probs[: len(TEMPLATE.tokens)], [request_rng(9, 5)])
    assert alone.emitted(stack(trees[:1]))[0] == run(5)[0]
    assert len({tuple(tokens) for tokens in run(None)}) > 5


def test_one_hot_target_is_greedy() -> None:
    rng = np.random.default_rng(3)
    trees = [TEMPLATE, DraftTree.root_only(4), rerooted(2)]
    argmax = rng.integers(0, VOCAB, size=sum(len(t.tokens) for t in trees))
    argmax[1] = 2  # make the first tree accept a prefix
    one_hot = torch.nn.functional.one_hot(torch.from_numpy(argmax), VOCAB).double()
    sampled = verify_sampling(stack(trees), one_hot, [request_rng(r, 0) for r in range(3)])
    greedy = verify_greedy(stack(trees), argmax)
    assert sampled.accepted_lens == greedy.accepted_lens
    assert sampled.accepted_nodes.tolist() == greedy.accepted_nodes.tolist()
    assert sampled.bonus.tolist() == greedy.bonus.tolist()


def test_rejected_tokens_never_come_back_as_bonus() -> None:
    # The root's mass is on 2 (its first child) and 4 (no child): a rejected 2 leaves only 4.
    probs = torch.zeros(len(TEMPLATE.tokens), VOCAB, dtype=torch.float64)
    probs[:, 1] = 1.0
    probs[0] = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.5, 0.0])
    trees = [TEMPLATE] * 200
    result = verify_sampling(
        stack(trees), probs.repeat(200, 1), [request_rng(r, None) for r in range(200)]
    )
    emitted = result.emitted(stack(trees))
    rejected_at_root = [
        tokens for tokens, n in zip(emitted, result.accepted_lens.tolist(), strict=True) if n == 0
    ]
    assert 60 < len(rejected_at_root) < 140
    assert all(tokens == [4] for tokens in rejected_at_root)
    assert all(tokens[:2] == [2, 1] for tokens in emitted if tokens != [4])


def test_shape_errors() -> None:
    trees = stack([TEMPLATE])
    with pytest.raises(ValueError, match=r"target_probs has shape \(7, 6\); the trees need"):
        verify_sampling(trees, torch.ones(7, VOCAB), [request_rng(0, 0)])
    with pytest.raises(ValueError, match="2 generators for 1 requests"):
        verify_sampling(trees, torch.ones(8, VOCAB), [request_rng(0, 0)] * 2)
    with pytest.raises(ValueError, match=r"requests \[0\] have no probability mass left"):
        verify_sampling(stack([DraftTree.root_only(0)]), torch.zeros(1, VOCAB), [request_rng(0, 0)])


@st.composite
def trees_with_probs(draw: st.DrawFn) -> tuple[DraftTree, np.ndarray]:
    size = draw(st.integers(1, 10))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    rows = draw(
        st.lists(
            st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0]), min_size=4, max_size=4).filter(any),
            min_size=size,
            max_size=size,
        )
    )
    return DraftTree(tokens, parents), np.array(rows)


@settings(max_examples=100, deadline=None)
@given(st.lists(trees_with_probs(), min_size=1, max_size=4), st.integers(0, 2**32))
def test_accepted_and_bonus_tokens_are_possible(cases: list, seed: int) -> None:
    trees = [tree for tree, _ in cases]
    probs = torch.from_numpy(np.concatenate([rows for _, rows in cases]))
    rngs = [request_rng(rid, seed) for rid in range(len(trees))]
    result = verify_sampling(stack(trees), probs, rngs)
    bounds = result.accepted_lens.indptr()
    for i, (tree, rows) in enumerate(cases):
        node = 0
        for child in result.accepted_nodes[bounds[i] : bounds[i + 1]].tolist():
            assert tree.parents[child] == node and rows[node, tree.tokens[child]] > 0
            node = child
        bonus = int(result.bonus[i])
        assert rows[node, bonus] > 0, "the bonus had probability 0"
        children = [tree.tokens[c] for c in range(len(tree.tokens)) if tree.parents[c] == node]
        assert bonus not in children, "a rejected child's token came back as the bonus"
