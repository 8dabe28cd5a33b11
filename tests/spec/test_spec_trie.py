"""The window trie: exact counts, recency stamps, and eviction that keeps the recent windows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec.trie import ROOT, Trie


def occurrences(history: list[int], gram: list[int]) -> int:
    n = len(gram)
    return sum(history[i : i + n] == gram for i in range(len(history) - n + 1))


def all_grams(trie: Trie) -> dict[tuple[int, ...], int]:
    """n-gram -> node id for every node (walks the child links)."""
    out: dict[tuple[int, ...], int] = {}
    pending = [((), ROOT)]
    while pending:
        gram, node = pending.pop()
        for child in trie.children(node):
            child_gram = (*gram, trie.token[child])
            out[child_gram] = child
            pending.append((child_gram, child))
    return out


def check_structure(trie: Trie) -> None:
    for node in range(len(trie.count)):
        children = trie.children(node)
        assert all(trie.stamp[c] <= trie.stamp[node] for c in children)
    assert len(all_grams(trie)) == trie.num_nodes


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.lists(st.integers(0, 3), max_size=10),
    st.integers(2, 5),
)
def test_counts_equal_occurrences(prompt: list[int], more: list[int], depth: int) -> None:
    trie = Trie(depth, capacity=10_000)
    trie.add(prompt)
    trie.add(more)  # extending a stream continues its open windows
    history = prompt + more
    grams = all_grams(trie)
    expected = {
        tuple(history[i : i + n]) for n in range(1, depth + 1) for i in range(len(history) - n + 1)
    }
    assert set(grams) == expected
    for gram, node in grams.items():
        assert trie.count[node] == occurrences(history, list(gram))
        last_start = max(i for i in range(len(history)) if history[i : i + len(gram)] == list(gram))
        assert trie.stamp[node] == last_start
    check_structure(trie)


def test_streams_do_not_share_windows() -> None:
    trie = Trie(3, capacity=100)
    trie.add([1, 2], stream=1)
    trie.add([3, 4], stream=2)
    trie.add([5], stream=1)
    assert trie.find([1, 2, 5]) >= 0
    assert trie.find([2, 3]) < 0 and trie.find([4, 5]) < 0
    trie.close(1)
    trie.add([6], stream=1)
    assert trie.find([2, 5, 6]) < 0 and trie.find([6]) >= 0


def test_eviction_keeps_the_recent_windows() -> None:
    depth, capacity = 4, 64
    trie = Trie(depth, capacity)
    history = list(range(1000, 1500))  # all distinct: every window is new
    trie.add(history[:300])
    trie.add(history[300:])
    assert trie.num_nodes <= capacity
    for start in range(len(history) - 8, len(history)):
        assert trie.find(history[start : start + depth]) >= 0, f"window at {start} was evicted"
    for start in range(400):
        assert trie.find(history[start : start + 1]) < 0, f"old window at {start} was kept"
    check_structure(trie)


def test_a_window_seen_again_is_recent() -> None:
    trie = Trie(3, capacity=36)
    trie.add([7, 8, 9])
    trie.add(range(100, 200))
    assert trie.find([7, 8, 9]) < 0
    trie.add([7, 8, 9])
    trie.add(range(200, 203))
    assert trie.find([7, 8, 9]) >= 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=300), st.integers(2, 4))
def test_eviction_keeps_structure_and_open_windows(history: list[int], depth: int) -> None:
    capacity = 4 * depth * depth
    trie = Trie(depth, capacity)
    for start in range(0, len(history), 7):
        trie.add(history[start : start + 7])
    assert trie.num_nodes <= capacity
    check_structure(trie)
    for gram, node in all_grams(trie).items():
        assert 1 <= trie.count[node] <= occurrences(history, list(gram))
    # The open windows survived eviction and were renumbered with it.
    for length in range(1, min(depth, len(history)) + 1):
        assert trie.find(history[-length:]) >= 0


def test_bad_tokens_and_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="capacity >= 4"):
        Trie(4, capacity=63)
    trie = Trie(2, capacity=16)
    with pytest.raises(ValueError, match=r"token -1 is not allowed"):
        trie.add([3, -1])
    with pytest.raises(ValueError, match=r"token 4294967296 is not allowed"):
        trie.add([2**32])
    assert np.array_equal(trie.stamps(), [0])  # the token before the bad one was added


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.lists(st.integers(0, 3), max_size=10),
    st.integers(1, 6),
    st.sampled_from([3, 2**32 - 1]),
)
def test_a_prompt_built_at_once_equals_one_added_token_by_token(
    prompt: list[int], more: list[int], depth: int, scale: int
) -> None:
    """Into an empty trie `add` builds every window at once (`Trie._build`); it makes the
    nodes, in the same order, with the counts, stamps, links and open windows that adding
    the tokens one by one makes, and the stream goes on the same way after it."""
    prompt = [t * scale // 3 for t in prompt]  # small ids, or up to the largest allowed
    at_once, one_by_one = Trie(depth, 10_000), Trie(depth, 10_000)
    at_once.add(prompt, stream=5)
    one_by_one.add([], stream=5)  # a stream already open: token by token from here
    one_by_one.add(prompt, stream=5)
    for trie in (at_once, one_by_one):
        trie.add(more, stream=5)
    for column in ("token", "count", "stamp", "first_child", "next_sibling"):
        assert list(getattr(at_once, column)) == list(getattr(one_by_one, column)), column
    assert list(at_once._children.items()) == list(one_by_one._children.items())
    assert at_once._open == one_by_one._open and at_once.tick == one_by_one.tick
    check_structure(at_once)
