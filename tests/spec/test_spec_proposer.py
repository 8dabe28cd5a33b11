"""The n-gram proposer: exact trees for hand-made histories, and properties of every tree."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec import DraftTree, NgramProposer, SpecConfig, stack
from engine.state.debug import same_value


def propose(history: list[int], budget: int | None = None, **config: int) -> DraftTree:
    proposer = NgramProposer(SpecConfig(**config))
    proposer.add_request(0, history)
    return proposer.propose(0, budget=budget)


def test_longest_match_then_recency_among_equal_counts() -> None:
    # "1 2" is followed by 3 twice; after "1 2 3" come 4 (older) and 6 (newer), once each.
    tree = propose(
        [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2],
        max_trie_depth=6,
        min_match=1,
        max_match=3,
        capacity=144,
    )
    assert tree == DraftTree((2, 3, 6, 4, 7, 5, 1, 1), (-1, 0, 1, 1, 2, 3, 4, 5), match_len=2)


def test_frequency_ranks_first_and_budget_cuts_best_first() -> None:
    # After 5: 1 twice, 2 once (newer). Windows of 4 tokens bound the depth below "5".
    history = [5, 1, 9, 5, 1, 9, 5, 2, 9, 5]
    config = {"max_trie_depth": 4, "min_match": 1, "max_match": 1, "capacity": 64}
    assert propose(history, **config) == DraftTree(
        (5, 1, 9, 5, 2, 9, 5), (-1, 0, 1, 2, 0, 4, 5), match_len=1
    )
    assert propose(history, budget=3, **config) == DraftTree((5, 1, 9, 5), (-1, 0, 1, 2), 1)
    assert propose(history, budget=4, **config).tokens == (5, 1, 9, 5, 2)
    assert propose(history, budget=0, **config) == DraftTree.root_only(5)


def test_a_longer_match_wins_over_a_more_frequent_short_one() -> None:
    history = [1, 2, 3, 7, 4, 2, 3, 8, 2, 3, 8, 9, 1, 2, 3]
    tree = propose(history, max_trie_depth=6, min_match=1, max_match=3, capacity=144)
    assert tree == DraftTree((3, 7, 4, 2), (-1, 0, 1, 2), match_len=3)


def test_breadth_limits_the_children_kept() -> None:
    history = [0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0]
    tree = propose(history, max_trie_depth=3, min_match=1, max_match=1, max_breadth=3, capacity=36)
    assert tree == DraftTree((0, 5, 4, 3, 0, 0, 0), (-1, 0, 0, 0, 1, 2, 3), match_len=1)


def test_no_match_gives_the_root_only() -> None:
    assert propose([1, 2, 3], min_match=1) == DraftTree.root_only(3)
    assert propose([4], min_match=1) == DraftTree.root_only(4)
    assert propose([1, 2, 1], min_match=2) == DraftTree.root_only(1)


def test_corpus_is_used_when_it_matches_longer() -> None:
    proposer = NgramProposer(SpecConfig(max_trie_depth=6, min_match=1, max_match=3, capacity=144))
    proposer.add_corpus([10, 11, 12, 13, 14])
    proposer.add_corpus([20, 21])
    proposer.add_request(1, [12, 30, 11, 12])
    assert proposer.propose(1) == DraftTree((12, 13, 14), (-1, 0, 1), match_len=2)
    proposer.add_request(2, [12, 40, 12])  # its own "12 40" ties the corpus' "12 13" at 1
    assert proposer.propose(2).tokens == (12, 40, 12)
    proposer.add_request(3, [14, 20])  # documents do not run into each other
    assert proposer.propose(3) == DraftTree((20, 21), (-1, 0), match_len=1)


def test_extend_context_and_remove() -> None:
    proposer = NgramProposer(SpecConfig(min_match=1, max_match=2, capacity=1024))
    proposer.add_request(7, [1, 2, 3])
    assert proposer.propose(7) == DraftTree.root_only(3)
    proposer.extend(7, [1, 2])
    assert proposer.propose(7).tokens == (2, 3, 1, 2)
    assert proposer.history(7) == [1, 2, 3, 1, 2]
    assert proposer.propose(7, context=[5, 1]).tokens == (1, 2, 3, 1, 2)
    trees = proposer.propose_batch([7, 7], budgets=[1, 0])
    assert trees.sizes.tolist() == [2, 1] and trees.tokens.tolist() == [2, 3, 2]
    with pytest.raises(ValueError, match="1 budgets for 2 requests"):
        proposer.propose_batch([7, 7], budgets=[1])
    proposer.remove(7)
    assert 7 not in proposer
    with pytest.raises(KeyError, match="request 7 is not known"):
        proposer.propose(7)
    proposer.add_request(8, [1])
    with pytest.raises(KeyError, match="already known"):
        proposer.add_request(8, [1])
    with pytest.raises(ValueError, match=r"budget=13 is not allowed"):
        proposer.propose(8, budget=13)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 2\*\*32\); got -1..5"):
        proposer.extend(8, [5, -1])
    assert proposer.history(8) == [1]
    with pytest.raises(ValueError, match="no tokens"):
        proposer.propose(8, context=[])


def occurs(history: list[int], gram: list[int]) -> bool:
    n = len(gram)
    return any(history[i : i + n] == gram for i in range(len(history) - n + 1))


def _drawn_config(depth: int, min_match: int, max_breadth: int, capacity: int) -> SpecConfig:
    """A SpecConfig from drawn values: matches of min_match (at most depth - 1) to depth - 1
    tokens."""
    return SpecConfig(
        max_trie_depth=depth,
        min_match=min(min_match, depth - 1),
        max_match=depth - 1,
        max_breadth=max_breadth,
        capacity=capacity,
    )


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=80),
    st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=4),
    st.integers(0, 12),
    st.integers(3, 6),
    st.integers(1, 3),
    st.integers(1, 4),
)
def test_every_tree_respects_budget_and_is_seen(
    prompt: list[int],
    chunks: list[list[int]],
    budget: int,
    depth: int,
    min_match: int,
    max_breadth: int,
) -> None:
    config = _drawn_config(depth, min_match, max_breadth, capacity=4 * depth * depth)
    proposer = NgramProposer(config)
    proposer.add_request(0, prompt)
    history = list(prompt)
    for chunk in [[], *chunks]:
        proposer.extend(0, chunk)
        history += chunk
        tree = proposer.propose(0, budget=budget)
        assert 1 <= len(tree.tokens) <= budget + 1
        assert tree.tokens[0] == history[-1]
        if len(tree.tokens) == 1:
            continue
        assert config.min_match <= tree.match_len <= depth - 1
        suffix = history[len(history) - tree.match_len :]
        for node in range(1, len(tree.tokens)):
            path = []
            walk = node
            while walk > 0:
                path.append(tree.tokens[walk])
                walk = tree.parents[walk]
            assert len(suffix) + len(path) <= depth
            assert occurs(history, suffix + path[::-1]), "a draft path never occurred"
        for node in range(len(tree.tokens)):
            sibling_tokens = [
                token
                for token, parent in zip(tree.tokens, tree.parents, strict=True)
                if parent == node
            ]
            assert len(sibling_tokens) == len(set(sibling_tokens))
            assert len(sibling_tokens) <= config.breadth(tree.match_len)


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(st.integers(0, 5), min_size=1, max_size=80),
    corpus=st.lists(st.integers(0, 5), max_size=40),
    min_match=st.integers(1, 3),
    extra=st.integers(0, 4),
    capacity=st.sampled_from([256, 512]),
)
def test_a_suffix_without_a_shorter_match_has_no_longer_one(
    history, corpus, min_match, extra, capacity
) -> None:
    """The proposer looks the corpus up beyond its shortest suffix only when that one has a
    continuation. Searched longest first without that stop, the request's history before the
    corpus at each length, every match is the same, the corpus' eviction included."""
    config = SpecConfig(
        max_trie_depth=8, min_match=min_match, max_match=min_match + extra, capacity=capacity
    )
    proposer = NgramProposer(config)
    if corpus:
        proposer.add_corpus(corpus)
    proposer.add_request(0, history[:1])
    for position in range(1, len(history) + 1):
        tokens = history[:position]
        if position > 1:
            proposer.extend(0, tokens[-1:])
        expected = None
        for length in range(min(config.max_match, len(tokens)), min_match - 1, -1):
            suffix = tokens[-length:]
            if occurs(tokens[:-1], suffix):  # followed by a token
                expected = ("history", length)
                break
            if corpus and proposer._corpus.continues(proposer._corpus.trie.find(suffix)):
                expected = ("corpus", length)
                break
        matched = proposer._match(proposer._history(0), tokens, budget=12)
        found = None
        if matched is not None:
            found = ("corpus" if matched[0] is proposer._corpus else "history", matched[2])
        assert found == expected


def test_total_drafts_go_in_order_and_unused_ones_pass_on() -> None:
    """A pool with room for 5 drafts in all: the first request that matches takes what its
    tree uses; a request with no match takes none, and the next one gets them."""
    config = SpecConfig(max_trie_depth=6, min_match=1, max_match=3, capacity=144)
    proposer = NgramProposer(config)
    proposer.add_request(0, [1, 2, 3, 4, 5, 6, 7, 1, 2])  # matches "1 2" -> 3 4 5 ...
    proposer.add_request(1, [9, 8, 7])  # no repeated suffix: root only
    proposer.add_request(2, [4, 5, 6, 7, 8, 9, 4, 5])  # matches "4 5" -> 6 7 8 ...
    sizes = lambda trees: trees.sizes.lens.tolist()  # noqa: E731
    # unbounded, each tree has 4 drafts (the histories hold no more)
    assert sizes(proposer.propose_batch([0, 1, 2], [12, 12, 12])) == [5, 1, 5]
    assert sizes(proposer.propose_batch([0, 1, 2], [12, 12, 12], total_drafts=5)) == [5, 1, 2]
    # request 1 matches nothing: its budget of 12 reserves none of the 5 (cutting budgets
    # before proposing gave every tree here the root only)
    assert sizes(proposer.propose_batch([1, 2, 0], [12, 12, 12], total_drafts=5)) == [1, 5, 2]
    assert sizes(proposer.propose_batch([0, 2], [2, 12], total_drafts=5)) == [3, 4]
    assert sizes(proposer.propose_batch([0, 1, 2], [4, 12, 12], total_drafts=5)) == [5, 1, 2]
    assert sizes(proposer.propose_batch([0, 2], None, total_drafts=0)) == [1, 1]
    with pytest.raises(ValueError, match="total_drafts=-1 is not allowed"):
        proposer.propose_batch([0], [1], total_drafts=-1)


@settings(max_examples=80, deadline=None)
@given(
    histories=st.lists(
        st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=5
    ),
    budgets=st.lists(st.integers(0, 12), min_size=5, max_size=5) | st.none(),
    total_drafts=st.integers(0, 30) | st.none(),
    min_match=st.integers(1, 3),
)
def test_propose_batch_equals_one_tree_per_request_stacked(
    histories: list[list[int]],
    budgets: list[int] | None,
    total_drafts: int | None,
    min_match: int,
) -> None:
    """The batch's flat columns, built directly, are those of each request's own tree
    (`propose` at its budget, cut to the drafts left) stacked in order."""
    config = SpecConfig(max_trie_depth=6, min_match=min_match, max_match=4, capacity=144)
    proposer = NgramProposer(config)
    for rid, history in enumerate(histories):
        proposer.add_request(rid, history)
    rids = list(range(len(histories)))[::-1]  # not in the order they were added
    chosen = None if budgets is None else budgets[: len(rids)]
    trees = proposer.propose_batch(rids, chosen, total_drafts)
    expected, left = [], total_drafts
    for i, rid in enumerate(rids):
        budget = 12 if chosen is None else chosen[i]
        tree = proposer.propose(rid, budget=budget if left is None else min(budget, left))
        expected.append(tree)
        if left is not None:
            left -= len(tree.tokens) - 1
    reference = stack(expected)
    for field in ("tokens", "parents", "depths", "ancestor_bits"):
        assert same_value(getattr(trees, field), getattr(reference, field)), field
    assert trees.sizes == reference.sizes


@settings(max_examples=80, deadline=None)
@given(
    history=st.lists(st.integers(0, 6), min_size=1, max_size=30),
    corpus=st.lists(st.integers(0, 6), min_size=1, max_size=20) | st.none(),
    min_match=st.integers(1, 3),
)
def test_a_request_that_may_not_draft_drafts_nothing(
    history: list[int], corpus: list[int] | None, min_match: int
) -> None:
    """`may_draft` False: no budget grows a tree beyond its root, and `draft_batch` builds
    none; True where a tree grows at some budget (a shorter match than `min_match` may
    still leave it a root)."""
    config = SpecConfig(max_trie_depth=6, min_match=min_match, max_match=4, capacity=144)
    proposer = NgramProposer(config)
    if corpus is not None:
        proposer.add_corpus(corpus)
    proposer.add_request(0, history)
    grows = len(proposer.propose(0, budget=12).tokens) > 1
    if not proposer.may_draft(0):
        assert not grows
        assert proposer.draft_batch([0], [12]) is None
        assert proposer.propose_batch([0], [12]).sizes.total == 1
    elif min_match <= 2:  # the key is the whole shortest match: a hit always drafts
        assert grows
    assert (proposer.draft_batch([0], [12]) is None) == (not grows)


def reference_tree(history: list[int], config: SpecConfig, budget: int) -> DraftTree:
    """The draft tree, told from the history alone (no trie): a gram's continuations are the
    windows of up to `max_trie_depth` tokens that hold it and one more token, each ranked by
    its occurrences, then by its newest start; a path's score is the product of each step's
    occurrences over all its node's continuations."""
    depth = config.max_trie_depth

    def continuations(gram: list[int]) -> list[tuple[int, int, int]]:
        """(occurrences, newest start, token) of each token after `gram` in a window."""
        if len(gram) >= depth:
            return []
        seen: dict[int, list[int]] = {}
        for start in range(len(history) - len(gram)):
            if history[start : start + len(gram)] == gram:
                seen.setdefault(history[start + len(gram)], []).append(start)
        return [(len(starts), starts[-1], token) for token, starts in seen.items()]

    root = history[-1]
    if budget == 0:
        return DraftTree.root_only(root)
    for match_len in range(min(config.max_match, len(history)), config.min_match - 1, -1):
        suffix = history[len(history) - match_len :]
        if continuations(suffix):
            break
    else:
        return DraftTree.root_only(root)
    breadth = config.breadth(match_len)
    tokens, parents = [root], [-1]
    frontier: list[tuple[float, int, list[int], int]] = []
    pushed = 0

    def push_children(gram: list[int], local: int, path_score: float) -> None:
        nonlocal pushed
        found = continuations(gram)
        scale = path_score / sum(count for count, _, _ in found)
        for count, _, token in sorted(found, reverse=True)[:breadth]:
            heapq.heappush(frontier, (-scale * count, pushed, [*gram, token], local))
            pushed += 1

    push_children(suffix, 0, 1.0)
    while frontier and len(tokens) - 1 < budget:
        negative_score, _, gram, parent = heapq.heappop(frontier)
        tokens.append(gram[-1])
        parents.append(parent)
        if continuations(gram):
            push_children(gram, len(tokens) - 1, -negative_score)
    return DraftTree(tokens, parents, match_len)


@settings(max_examples=80, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=50),
    chunks=st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=5),
    budget=st.integers(0, 12),
    depth=st.integers(3, 7),
    min_match=st.integers(1, 3),
    max_breadth=st.integers(1, 4),
)
def test_trees_equal_the_reference_told_from_the_history(
    prompt: list[int],
    chunks: list[list[int]],
    budget: int,
    depth: int,
    min_match: int,
    max_breadth: int,
) -> None:
    """The trie's counts, recency and continuation totals (summed from the children as the
    tree grows) give the trees the history itself gives, after a prompt and each chunk."""
    # nothing evicted: every window of the history is kept
    config = _drawn_config(depth, min_match, max_breadth, capacity=10_000)
    proposer = NgramProposer(config)
    proposer.add_request(0, prompt)
    history = list(prompt)
    for chunk in [[], *chunks]:
        proposer.extend(0, chunk)
        history += chunk
        assert proposer.propose(0, budget=budget) == reference_tree(history, config, budget)
