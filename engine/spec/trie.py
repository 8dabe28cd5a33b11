"""A trie of token windows with occurrence counts and recency, bounded by a node capacity.

Every position of a token stream starts a window of up to `depth` tokens; each node counts
the windows through it and remembers the start of the newest one (its stamp, a tick). A
parent's stamp is never older than its children's, so evicting every node older than a tick
removes whole subtrees and keeps exactly the recent windows. Nodes live in flat int arrays
and one int-keyed dict, so a large trie costs the garbage collector nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

ROOT = 0
_ROOT_STAMP = 1 << 62  # the root is never evicted
_TOKEN_BITS = 32  # child key: (parent << 32) | token


class Trie:
    """Windows of `depth` tokens from any number of streams, at most `capacity` nodes.

    Node columns (index = node id, 0 = root): `count` windows pass through it, `stamp` is the
    start tick of the newest; children form a linked list (`first_child`, `next_sibling`, -1
    ends it). The sum of a node's children's counts is not kept: each token would update it
    for every open window, and the proposer sums them as it ranks the children, whose
    counts it reads anyway."""

    def __init__(self, depth: int, capacity: int) -> None:
        if depth < 1 or capacity < 4 * depth * depth:
            raise ValueError(
                f"a trie needs depth >= 1 and capacity >= 4 * depth**2; got "
                f"depth={depth}, capacity={capacity}"
            )
        self.depth = depth
        self.capacity = capacity
        self.tick = 0  # the tick the next token gets
        self._children: dict[int, int] = {}
        self.token = array("q", [-1])
        self.count = array("q", [0])
        self.stamp = array("q", [_ROOT_STAMP])
        self.first_child = array("q", [-1])
        self.next_sibling = array("q", [-1])
        # Per stream: ids of the nodes ending its open windows, oldest window first.
        self._open: dict[int, list[int]] = {}

    @property
    def num_nodes(self) -> int:
        """Nodes held, not counting the root."""
        return len(self.count) - 1

    # --- insertion ----------------------------------------------------------------------
    def add(self, tokens: Iterable[int], stream: int = 0) -> None:
        """Append `tokens` to `stream`: each token grows every open window of the stream.
        Into an empty trie (a request's prompt) all windows are built at once (`_build`)."""
        if not self._open and self.num_nodes == 0:
            tokens = [int(t) for t in tokens]
            fits = len(tokens) * self.depth <= self.capacity  # no eviction on the way
            if fits and all(0 <= t < 1 << _TOKEN_BITS for t in tokens):  # else: raise below
                self._build(tokens, stream)
                return
        opened = self._open.setdefault(stream, [])
        for token in tokens:
            token = int(token)
            if not 0 <= token < 1 << _TOKEN_BITS:
                raise ValueError(f"token {token} is not allowed; tokens must be in [0, 2**32)")
            opened = self._push(opened, token)
            self._open[stream] = opened
            if len(self.count) > self.capacity + 1:
                self.evict(self.capacity // 2)  # half: sweeps stay rare
                opened = self._open[stream]

    def close(self, stream: int) -> None:
        """Forget `stream`'s open windows (its next token starts afresh)."""
        self._open.pop(stream, None)

    def _push(self, opened: list[int], token: int) -> list[int]:
        tick = self.tick
        self.tick = tick + 1
        opened.append(ROOT)  # the window starting at this token
        children, count, stamp = self._children, self.count, self.stamp
        token_of, first_child, next_sibling = self.token, self.first_child, self.next_sibling
        grown = []
        start = tick - len(opened) + 1  # the start tick of the oldest open window
        for parent in opened:
            key = (parent << _TOKEN_BITS) | token
            child = children.get(key)
            if child is None:  # a new node (most windows of free text)
                child = len(count)
                children[key] = child
                token_of.append(token)
                count.append(1)
                stamp.append(start)
                first_child.append(-1)
                next_sibling.append(first_child[parent])
                first_child[parent] = child
            else:
                stamp[child] = start  # starts only increase: this window is the newest
                count[child] += 1
            grown.append(child)
            start += 1
        # A window of `depth` tokens is complete: it leaves the open list.
        return grown[1:] if len(grown) >= self.depth else grown

    def _build(self, tokens: list[int], stream: int) -> None:
        """`add(tokens, stream)` into an empty trie, with numpy: the same nodes (numbered in
        the order `_push` makes them), counts, stamps, links and open windows."""
        t = np.asarray(tokens, dtype=np.int64)  # each in [0, 2**32)
        n, tick = int(t.size), self.tick
        if n == 0:
            self._open[stream] = []
            return
        # per length d + 1: each start's n-gram class, and each class's first start
        classes, firsts, inverse = [], [], []
        previous = np.zeros(n, dtype=np.int64)  # the root's class, 0
        for d in range(min(self.depth, n)):
            windows = n - d  # the starts with d + 1 tokens after them
            keys = (previous[:windows] << _TOKEN_BITS) | t[d:]
            unique, first, inv = np.unique(keys, return_index=True, return_inverse=True)
            classes.append(unique.size)
            firsts.append(first)
            inverse.append(inv.reshape(-1))
            previous = inv.reshape(-1)
        # node ids in creation order: by the end of the first occurrence, then its start
        depth_of = np.concatenate([np.full(k, d, dtype=np.int64) for d, k in enumerate(classes)])
        first = np.concatenate(firsts)
        order = np.lexsort((first, first + depth_of))
        node = np.empty(order.size, dtype=np.int64)
        node[order] = np.arange(1, order.size + 1)
        offsets = np.concatenate([[0], np.cumsum(classes)]).astype(np.int64)
        size = order.size + 1
        token = np.full(size, -1, dtype=np.int64)
        count = np.zeros(size, dtype=np.int64)
        stamp = np.full(size, _ROOT_STAMP, dtype=np.int64)
        parent = np.full(size, -1, dtype=np.int64)
        for d, inv in enumerate(inverse):
            ids = node[offsets[d] : offsets[d + 1]]
            starts = np.arange(inv.size, dtype=np.int64)
            token[ids] = t[firsts[d] + d]
            count[ids] = np.bincount(inv, minlength=ids.size)
            newest = np.zeros(ids.size, dtype=np.int64)
            np.maximum.at(newest, inv, starts)
            stamp[ids] = newest + tick
            parent[ids] = (
                0 if d == 0 else node[offsets[d - 1] : offsets[d]][inverse[d - 1][firsts[d]]]
            )
        self._install(parent, token, count, stamp, newest_first=True)
        # the windows still open: those shorter than `depth`, oldest first
        opened = []
        for start in range(max(0, n - self.depth + 1), n):
            d = n - 1 - start
            opened.append(int(node[offsets[d] + inverse[d][start]]))
        self._open[stream] = opened
        self.tick = tick + n

    # --- reading ------------------------------------------------------------------------
    def find(self, tokens: Sequence[int]) -> int:
        """The node of the n-gram `tokens`, or -1 if no kept window holds it."""
        node = ROOT
        children = self._children
        for token in tokens:
            node = children.get((node << _TOKEN_BITS) | int(token), -1)
            if node < 0:
                return -1
        return node

    def stamps(self) -> np.ndarray:
        """Every node's stamp, root excluded (a copy, for tests and inspection)."""
        return np.array(self.stamp[1:], dtype=np.int64)

    def children(self, node: int) -> list[int]:
        out = []
        child = self.first_child[node]
        while child >= 0:
            out.append(child)
            child = self.next_sibling[child]
        return out

    # --- eviction -----------------------------------------------------------------------
    def evict(self, target_nodes: int) -> None:
        """Drop the least recently seen windows until at most `target_nodes` nodes remain."""
        stamps = np.frombuffer(self.stamp, dtype=np.int64)[1:]
        if stamps.size <= target_nodes:
            return
        # Keep stamps above the cutoff; a tie goes as a whole. The open windows are the
        # newest, and capacity >= 4 * depth**2 guarantees they stay.
        rank = stamps.size - target_nodes - 1
        cutoff = np.partition(stamps, rank)[rank]
        self._compact(np.concatenate([[True], stamps > cutoff]))

    def _compact(self, keep: np.ndarray) -> None:
        """Keep the nodes in `keep` (closed under ancestors) and renumber them."""
        new_id = np.cumsum(keep) - 1
        columns = {
            name: np.frombuffer(getattr(self, name), dtype=np.int64)[keep]
            for name in ("token", "count", "stamp")
        }
        old_parent = self._parents()[keep]
        parent = np.where(old_parent >= 0, new_id[np.maximum(old_parent, 0)], -1)
        self._install(parent, columns["token"], columns["count"], columns["stamp"])
        self._open = {s: new_id[nodes].tolist() for s, nodes in self._open.items()}

    def _install(
        self,
        parent: np.ndarray,
        token: np.ndarray,
        count: np.ndarray,
        stamp: np.ndarray,
        newest_first: bool = False,
    ) -> None:
        """The columns, links and child dict of nodes 0..n-1 (0 the root) given by `parent`,
        `token`, `count` and `stamp`; siblings linked newest first (as `_push` links them) or
        oldest first."""
        size = parent.size
        first_child, next_sibling = _links(parent, size, newest_first)
        for name, values in (
            ("token", token),
            ("count", count),
            ("stamp", stamp),
            ("first_child", first_child),
            ("next_sibling", next_sibling),
        ):
            setattr(self, name, array("q", values.astype(np.int64).tobytes()))
        keys = (parent[1:] << _TOKEN_BITS) | token[1:]
        self._children = dict(zip(keys.tolist(), range(1, size), strict=True))

    def _parents(self) -> np.ndarray:
        parent = np.full(len(self.count), -1, dtype=np.int64)
        keys = np.fromiter(self._children.keys(), dtype=np.int64, count=len(self._children))
        nodes = np.fromiter(self._children.values(), dtype=np.int64, count=len(self._children))
        parent[nodes] = keys >> _TOKEN_BITS
        return parent


def _links(
    parent: np.ndarray, size: int, newest_first: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """first_child / next_sibling linked lists for nodes 1..size-1 under `parent`, each
    parent's children in id order (`newest_first`: the reverse)."""
    first_child = np.full(size, -1, dtype=np.int64)
    next_sibling = np.full(size, -1, dtype=np.int64)
    nodes = np.arange(1, size)
    order = np.lexsort((-nodes if newest_first else nodes, parent[1:]))
    sorted_nodes, sorted_parents = nodes[order], parent[1:][order]
    same = sorted_parents[:-1] == sorted_parents[1:]
    next_sibling[sorted_nodes[:-1][same]] = sorted_nodes[1:][same]
    heads, first = np.unique(sorted_parents, return_index=True)
    first_child[heads] = sorted_nodes[first]
    return first_child, next_sibling
