"""Best-first growth of a draft tree below a matched n-gram, over any source of continuations
(a trie's nodes, or a request's occurrence groups)."""

from __future__ import annotations

import heapq
from typing import Any, Protocol

from engine.spec.trie import Trie

# (count, stamp, token, child node): one continuation of a node; `stamp` is the start of its
# newest occurrence (siblings' stamps differ, so they rank by (count, stamp) alone).
Continuation = tuple[int, int, int, Any]


class Continuations(Protocol):
    """What `grow` reads of a source of n-grams: a node's continuations."""

    def ranked(self, node: Any, breadth: int) -> tuple[int, list[Continuation]]:
        """The occurrences of `node`'s n-gram that go on (their children's counts summed;
        0 where none does), and its `breadth` most frequent continuations, best first
        (newest first among equal counts)."""
        ...


def grow(
    source: Continuations, matched: Any, budget: int, breadth: int
) -> tuple[list[int], list[int]]:
    """Best-first expansion below node `matched` of `source`: (draft tokens, their local
    parents), where local 0 is the root; every parent precedes its children. A candidate's
    score is its parent's times its count over all of the parent's continuations."""
    drafts: list[int] = []
    parents: list[int] = []
    # Heap entries: (-path frequency, push order, token, node, parent local id).
    frontier: list[tuple[float, int, int, Any, int]] = []
    pushed = 0

    def push_children(node: Any, local: int, path_score: float) -> None:
        nonlocal pushed
        total, ranked = source.ranked(node, breadth)
        if not ranked:
            return
        scale = path_score / total
        for count, _, token, child in ranked:
            heapq.heappush(frontier, (-scale * count, pushed, token, child, local))
            pushed += 1

    push_children(matched, 0, 1.0)
    while frontier and len(drafts) < budget:
        negative_score, _, token, node, parent_local = heapq.heappop(frontier)
        drafts.append(token)
        parents.append(parent_local)
        push_children(node, len(drafts), -negative_score)
    return drafts, parents


class TrieNodes:
    """A trie's nodes as a source of continuations (node: a node id)."""

    __slots__ = ("trie",)

    def __init__(self, trie: Trie) -> None:
        self.trie = trie

    def continues(self, node: int) -> bool:
        """Whether `node` (-1: none) exists and has a child."""
        return node >= 0 and self.trie.first_child[node] >= 0

    def ranked(self, node: int, breadth: int) -> tuple[int, list[Continuation]]:
        trie = self.trie
        count, stamp, token, next_sibling = trie.count, trie.stamp, trie.token, trie.next_sibling
        child = trie.first_child[node]
        if child < 0:
            return 0, []
        if next_sibling[child] < 0:
            only = count[child]
            return only, [(only, stamp[child], token[child], child)]
        ranked = []
        total = 0
        while child >= 0:
            child_count = count[child]
            total += child_count
            ranked.append((child_count, stamp[child], token[child], child))
            child = next_sibling[child]
        if len(ranked) <= 2 * breadth:
            ranked.sort(reverse=True)  # stamps differ: the tuples' order is (count, stamp)
            return total, ranked[:breadth]
        return total, heapq.nlargest(breadth, ranked)
