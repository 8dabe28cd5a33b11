"""The occurrence index: the proposer's trees equal those grown from tries of the same history
(nothing evicted), in numpy's grouping and in Python's, and long repeats stay vectorized."""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import DraftTree, NgramProposer, SpecConfig, occurrences
from engine.spec.occurrences import OccurrenceIndex
from engine.spec.trie import Trie


def trie_tree(
    history: list[int],
    corpus: list[list[int]],
    context: Sequence[int],
    config: SpecConfig,
    budget: int,
) -> DraftTree:
    """The tree the proposer grew from per-request tries: the longest suffix of `context`
    whose node has a child, the request's trie before the corpus' at each length; below it,
    best first, children ranked by (count, newest start), a path's score its parent's times
    its count over the node's children's counts."""
    depth, big = config.max_trie_depth, 1 << 20
    tries = [Trie(depth, big)]
    tries[0].add(history)
    if corpus:
        tries.append(Trie(depth, big))
        for stream, document in enumerate(corpus, start=1):
            tries[1].add(document, stream=stream)
            tries[1].close(stream)
    root = context[-1]
    lengths = range(min(config.max_match, len(context)), config.min_match - 1, -1)
    found = [
        (trie, node, length)
        for length in lengths
        for trie in tries
        if (node := trie.find(context[len(context) - length :])) >= 0
        and trie.first_child[node] >= 0
    ]
    if budget == 0 or not found:
        return DraftTree.root_only(root)
    trie, matched, match_len = found[0]
    breadth = config.breadth(match_len)
    tokens, parents = [root], [-1]
    frontier: list[tuple[float, int, int, int]] = []
    pushed = 0

    def push_children(node: int, local: int, score: float) -> None:
        nonlocal pushed
        children = [(trie.count[c], trie.stamp[c], c) for c in trie.children(node)]
        total = sum(count for count, _, _ in children)
        for count, _, child in sorted(children, reverse=True)[:breadth]:
            heapq.heappush(frontier, (-score / total * count, pushed, child, local))
            pushed += 1

    push_children(matched, 0, 1.0)
    while frontier and len(tokens) - 1 < budget:
        negative_score, _, node, parent = heapq.heappop(frontier)
        tokens.append(trie.token[node])
        parents.append(parent)
        push_children(node, len(tokens) - 1, -negative_score)
    return DraftTree(tokens, parents, match_len)


@contextlib.contextmanager
def small_below(small: int, match: int, rows: int) -> Iterator[None]:
    """Occurrences up to `small` grouped in Python (`Few`), up to `rows` grouped in Python by
    runs (`Rows`), more with numpy; up to `match` matched in Python, more with numpy."""
    saved = occurrences.SMALL, occurrences.MATCH, occurrences.ROWS
    occurrences.SMALL, occurrences.MATCH, occurrences.ROWS = small, match, rows
    try:
        yield
    finally:
        occurrences.SMALL, occurrences.MATCH, occurrences.ROWS = saved


@st.composite
def configs(draw: st.DrawFn) -> SpecConfig:
    depth = draw(st.integers(2, 8))
    min_match = draw(st.integers(1, depth - 1))
    low = draw(st.integers(1, 3))
    return SpecConfig(
        max_trie_depth=depth,
        min_match=min_match,
        max_match=draw(st.integers(min_match, depth - 1)),
        min_breadth=low,
        max_breadth=draw(st.integers(low, 4)),
        capacity=1 << 16,  # every occurrence is read
    )


@pytest.mark.parametrize(
    ("small", "match", "rows"),
    [
        (0, 0, 0),
        (occurrences.SMALL, occurrences.MATCH, occurrences.ROWS),
        (1 << 30, 1 << 30, 0),
        (0, 0, 1 << 30),
        (2, 4, 6),
        (0, 1 << 30, 0),
    ],
    ids=["numpy", "default", "python", "runs", "all three", "matched in python, numpy's groups"],
)
@settings(max_examples=150, deadline=None)
@given(
    config=configs(),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    chunks=st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=5),
    corpus=st.lists(st.lists(st.integers(0, 3), max_size=30), max_size=3),
    contexts=st.lists(st.none() | st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=6),
    budgets=st.lists(st.integers(0, 12), min_size=6, max_size=6),
)
def test_trees_equal_those_grown_from_tries(
    small, match, rows, config, prompt, chunks, corpus, contexts, budgets
) -> None:
    with small_below(small, match, rows):
        check_trees(config, prompt, chunks, corpus, contexts, budgets)


def check_trees(config, prompt, chunks, corpus, contexts, budgets) -> None:
    proposer = NgramProposer(config)
    for document in corpus:
        proposer.add_corpus(document)
    proposer.add_request(0, prompt)
    history = list(prompt)
    for step, chunk in enumerate([[], *chunks]):
        proposer.extend(0, chunk)
        history += chunk
        context = contexts[step] if step < len(contexts) else None
        budget = budgets[step]
        tree = proposer.propose(0, context, budget)
        expected = trie_tree(
            history, corpus, history if context is None else context, config, budget
        )
        assert tree == expected


@pytest.mark.parametrize(
    "history",
    [[7] * 3000, [1, 1, 1, 1, 2] * 700 + [1, 1], [5] * 2000 + [6] + [5] * 10],
    ids=["one token", "indentation", "a run then a break"],
)
def test_long_repeats_match_in_numpy_and_equal_the_trie(history: list[int]) -> None:
    """Thousands of occurrences of the suffix: matched and grouped as arrays (no loop over
    them in Python), with the trie's tree."""
    config = SpecConfig()
    proposer = NgramProposer(config)
    proposer.add_request(0, history[:1000])
    proposer.extend(0, history[1000:2000])
    for token in history[2000:]:  # the numpy copy of the tokens catches up lazily
        proposer.extend(0, [token])
    index = proposer._history(0)
    match_len, ends = index.match(history, config.max_match, config.min_match)
    assert match_len == config.max_match and ends.size > 500
    tree = proposer.propose(0)
    assert tree == trie_tree(history, [], history, config, config.draft_budget)
    assert len(tree.tokens) > 1


@pytest.mark.parametrize("period", [12, 60])
def test_a_pattern_repeated_with_changes_equals_the_trie(period: int) -> None:
    """A pattern repeated with a token changed here and there (a copying model's text): tens
    of occurrences of the suffix, more than `SMALL`, grouped by runs (`Rows`) below a branch
    and along runs of one continuation, as at the default depth and budget the trie's tree."""
    rng = np.random.default_rng(period)
    pattern = rng.integers(0, 50, period)
    stream = np.resize(pattern, 1200)
    changed = rng.random(stream.size) < 0.05
    stream[changed] = rng.integers(0, 50, int(changed.sum()))
    history = stream.tolist()
    config = SpecConfig()
    proposer = NgramProposer(config)
    proposer.add_request(0, history[:900])
    sizes = []
    for end in range(901, len(history), 3):
        proposer.extend(0, history[end - 3 if end > 901 else 900 : end])
        tree = proposer.propose(0)
        assert tree == trie_tree(history[:end], [], history[:end], config, config.draft_budget)
        _, ends = proposer._history(0).match(history[:end], config.max_match, config.min_match)
        sizes.append(len(ends))
    assert max(sizes) > occurrences.SMALL


def test_a_match_reads_the_newest_occurrences_of_its_key() -> None:
    """capacity // max_trie_depth occurrences of the suffix's last key are read: an older
    longer match is not found once the key occurred more often since."""
    history = [1, 2, 3, 4] + [5, 2, 3, 6] * 20 + [1, 2, 3]
    small = SpecConfig(max_trie_depth=4, min_match=2, max_match=3, capacity=64)  # 16 read
    large = SpecConfig(max_trie_depth=4, min_match=2, max_match=3, capacity=1024)
    assert NgramProposer(small).config.capacity // 4 == 16
    trees = []
    for config in (small, large):
        proposer = NgramProposer(config)
        proposer.add_request(0, history)
        trees.append(proposer.propose(0))
    assert trees[0] == DraftTree((3, 6, 5, 1), (-1, 0, 1, 1), match_len=2)
    assert trees[1] == DraftTree((3, 4), (-1, 0), match_len=3)


def test_a_context_token_out_of_range_matches_nothing() -> None:
    """A key packs two tokens of 32 bits: (0, 2**32) packs as (1, 0). Every token of a
    candidate is compared, so the context's out-of-range token matches nothing (the
    trie's child key aliased it the same way)."""
    proposer = NgramProposer(SpecConfig(min_match=2, max_match=3))
    proposer.add_request(0, [1, 0, 9, 1, 0, 9])
    assert proposer.propose(0, context=[1, 0]).tokens == (0, 9, 1, 0, 9)
    assert proposer.propose(0, context=[0, 1 << 32]) == DraftTree.root_only(1 << 32)


def test_the_index_is_checked_where_it_is_made() -> None:
    with pytest.raises(ValueError, match="key_len 1 or 2.*got key_len=3"):
        OccurrenceIndex(key_len=3, depth=4, max_candidates=8)
    index = OccurrenceIndex(key_len=1, depth=4, max_candidates=8)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 2\*\*32\); got 3..4294967296"):
        index.add([3, 1 << 32])
    assert len(index.tokens) == 0
