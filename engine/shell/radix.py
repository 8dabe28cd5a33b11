"""The prefix cache: a token-level radix tree of committed token sequences and their KV slots.

Each slot in the tree is locked by the running requests whose prefix uses it (the count is kept
per node and checked against the holders by `check()`) or evictable, leaves first in LRU order.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

import attrs
import numpy as np

from engine.state import PADDING_SLOT
from engine.state.seqlens import INDEX_DTYPE, freeze, has_duplicates

IntSequence = Sequence[int] | np.ndarray
_NONE = freeze(np.zeros(0, dtype=INDEX_DTYPE))


class _Node:
    """One edge of the tree: its tokens and their slots, and the depth its path ends at.

    `end` never changes: a split puts a new node above this one, so a handle to a node keeps
    naming the same prefix. An evicted node keeps `parent` so an old handle can find out what
    of its prefix is still cached.
    """

    __slots__ = (
        "tokens",
        "slots",
        "parent",
        "children",
        "end",
        "lock_count",
        "last_access",
        "serial",
    )

    def __init__(
        self,
        tokens: np.ndarray,
        slots: np.ndarray,
        parent: _Node | None,
        last_access: int,
        serial: int,
    ) -> None:
        self.tokens = tokens
        self.slots = slots
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.end: int = (parent.end if parent is not None else 0) + tokens.size
        self.lock_count = 0
        self.last_access = last_access
        self.serial = serial  # creation order: breaks LRU ties reproducibly

    @property
    def evicted(self) -> bool:
        return self.parent is not None and self.parent.children.get(self.first_token) is not self

    @property
    def first_token(self) -> int:
        return int(self.tokens[0])


@attrs.frozen(eq=False)
class Handle:
    """Where a match ended: `length` tokens deep, inside (or at the end of) `node`'s edge."""

    node: _Node
    length: int


@attrs.frozen(eq=False)
class Match:
    """The longest cached prefix of a sequence: its slots (read-only) and the handle `lock`
    takes."""

    slots: np.ndarray
    handle: Handle
    num_unlocked: int = 0  # of those slots, how many nobody locks (evictable now)

    @property
    def length(self) -> int:
        return int(self.slots.size)


@attrs.frozen(eq=False)
class Peek:
    """The longest cached prefix of a sequence, found without using it: how many of its slots
    nobody locks (evictable now), and the handle `take` gathers it from (its length)."""

    num_unlocked: int
    handle: Handle

    @property
    def length(self) -> int:
        return self.handle.length


class RadixCache:
    """Committed token sequences and their slots, page size 1.

    A match splits nothing: a match ending inside an edge splits it only when it is locked (or
    when an insert branches there), so lock counts are always whole-node counts. Every
    operation but `evict` and `check` costs time in the sequence's length, not the tree's size.
    """

    def __init__(self) -> None:
        empty = freeze(np.zeros(0, dtype=INDEX_DTYPE))
        self._root = _Node(empty, empty, None, 0, 0)
        self._clock = 0  # logical time: ticks once per match, insert and lock
        self._num_nodes_made = 1
        self._holders: dict[Hashable, _Node] = {}
        # is_cached[slot]: the tree holds `slot` (grown to the largest slot inserted); a mask,
        # not a set, so that a whole edge's slots are added, removed and looked up at once
        self._is_cached = np.zeros(0, dtype=bool)
        self._num_cached = 0
        self._num_locked = 0

    @property
    def num_slots(self) -> int:
        return self._num_cached

    @property
    def num_locked(self) -> int:
        return self._num_locked

    @property
    def num_evictable(self) -> int:
        return self.num_slots - self._num_locked

    def held_length(self, holder: Hashable) -> int:
        """How many tokens of prefix `holder` has locked (0: it holds none)."""
        node = self._holders.get(holder)
        return 0 if node is None else node.end

    def holders(self) -> dict[Hashable, int]:
        """Each holder and the length of the prefix it locks."""
        return {holder: node.end for holder, node in self._holders.items()}

    def cached_slots(self) -> np.ndarray:
        """The slots the tree holds, ascending."""
        return np.flatnonzero(self._is_cached).astype(INDEX_DTYPE, copy=False)

    def match(self, tokens: IntSequence, touch: bool = True) -> Match:
        """The longest cached prefix of `tokens`. `touch`: count it as a use (LRU); a peek
        (to order waiting requests) does not."""
        return self.take(self.peek(tokens), touch)

    def peek(self, tokens: IntSequence) -> Peek:
        """The longest cached prefix of `tokens` found, not used: its length, its
        `num_unlocked` and the handle `take` gathers its slots from (to order and count
        waiting requests, many per step, without gathering). Nothing changes."""
        key = _key_array(tokens)
        node, length, unlocked = self._root, 0, 0
        while length < key.size:  # `_descend`, counting as it goes (no lists: many a step)
            child = node.children.get(int(key[length]))
            if child is None:
                break
            count = _common_length(child.tokens, key[length:])
            length += count
            unlocked += count if child.lock_count == 0 else 0
            node = child
            if count < child.tokens.size:
                break
        return Peek(unlocked, Handle(node, length))

    def take(self, peek: Peek, touch: bool = True) -> Match:
        """What `match(tokens, touch)` returns now for the `tokens` that `peek` was given,
        without descending again: nothing may have been evicted or inserted since (locks,
        and the splits they make, may). `touch`: its nodes count as used (LRU)."""
        node = peek.handle.node
        if node.evicted:
            raise ValueError("a peeked prefix was evicted before it was taken; match again")
        # the deepest node of the match: a lock since the peek may have split the handle's
        # edge above where the match ends
        while node is not self._root and _parent(node).end >= peek.length:
            node = _parent(node)
        deepest = node
        if touch:
            self._clock += 1
        pieces: list[np.ndarray] = []
        unlocked, count = 0, peek.length - (node.end - node.tokens.size)
        while node is not self._root:
            if touch:
                node.last_access = self._clock
            pieces.append(node.slots[:count] if count < node.tokens.size else node.slots)
            unlocked += count if node.lock_count == 0 else 0
            node = _parent(node)
            count = node.tokens.size
        if not pieces:
            return Match(self._root.slots, Handle(self._root, 0), 0)
        slots = pieces[0] if len(pieces) == 1 else np.concatenate(pieces[::-1])
        if slots.flags.writeable:
            freeze(slots)
        return Match(slots, Handle(deepest, peek.length), unlocked)

    def insert(self, tokens: IntSequence, slots: IntSequence) -> np.ndarray:
        """Cache a committed sequence. Returns the caller's slots that duplicate ones the tree
        already holds for the same positions (the caller frees them); the tree keeps its own,
        and the slots of the new suffix now belong to the tree."""
        return self.insert_match(tokens, slots)[0]

    def insert_match(self, tokens: IntSequence, slots: IntSequence) -> tuple[np.ndarray, Match]:
        """`insert`, and the match of the whole sequence after it (what `match(tokens)`
        returns then: the tree's slots for it, and the handle `lock` takes), found in the
        same descent."""
        key = _token_array(tokens)
        values = _slot_array(slots, key.size)
        path, matched = self._descend(key)
        length = sum(matched)
        pieces = [node.slots[:count] for node, count in zip(path, matched, strict=True)]
        cached = np.concatenate(pieces) if len(pieces) > 1 else pieces[0] if pieces else _NONE
        duplicates = values[:length][values[:length] != cached]
        self._refuse_cached(np.concatenate([duplicates, values[length:]]))
        self._clock += 1
        parent = self._root
        if path:
            parent = path[-1]
            if length < key.size and matched[-1] < parent.tokens.size:
                parent = self._split(parent, matched[-1])
        # what nobody locks: the new leaf, and the path's unlocked nodes (a split's head has
        # its node's lock count)
        unlocked = sum(c for n, c in zip(path, matched, strict=True) if n.lock_count == 0)
        end = parent
        if length < key.size:
            end = self._add_leaf(parent, key[length:], values[length:])
            cached = np.concatenate([cached, end.slots])
            unlocked += end.slots.size
        self._touch(parent)
        return duplicates, Match(freeze(cached), Handle(end, key.size), unlocked)

    def lock(self, holder: Hashable, handle: Handle) -> None:
        """`holder` (a running request) uses the prefix `handle` names until `unlock`."""
        if holder in self._holders:
            raise ValueError(
                f"holder {holder!r} already locks a prefix of {self.held_length(holder)} "
                "tokens; a holder locks one prefix at a time (unlock it first)"
            )
        node = self._resolve(handle)
        self._holders[holder] = node
        self._clock += 1
        self._touch(node)
        while node is not self._root:
            if node.lock_count == 0:
                self._num_locked += node.tokens.size
            node.lock_count += 1
            node = _parent(node)

    def unlock(self, holder: Hashable) -> None:
        node = self._holders.pop(holder, None)
        if node is None:
            raise ValueError(f"holder {holder!r} locks nothing; only a holder that locked unlocks")
        while node is not self._root:
            if node.lock_count <= 0:
                raise AssertionError(f"lock count {node.lock_count} below zero on unlock")
            node.lock_count -= 1
            if node.lock_count == 0:
                self._num_locked -= node.tokens.size
            node = _parent(node)

    def evict(self, num_slots: int) -> np.ndarray:
        """Free at least `num_slots` slots (all evictable ones if fewer), whole unlocked leaves
        in LRU order; a parent whose last child goes becomes a leaf. Returns the freed slots."""
        if num_slots < 0:
            raise ValueError(f"asked to evict {num_slots} slots; the count must be >= 0")
        heap = [(n.last_access, n.serial, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed: list[np.ndarray] = []
        num_freed = 0
        while num_freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            parent = self._remove_leaf(node)
            freed.append(node.slots)
            num_freed += node.slots.size
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return np.concatenate(freed) if freed else np.zeros(0, dtype=INDEX_DTYPE)

    def check(self) -> None:
        """Raise AssertionError on any broken invariant (a full scan: for tests and debug)."""
        nodes = list(self._nodes())
        for node in nodes:
            _check_node(node)
        all_slots = [n.slots for n in nodes]
        flat = np.concatenate(all_slots) if all_slots else np.zeros(0, dtype=INDEX_DTYPE)
        if has_duplicates(flat):
            raise AssertionError("a slot appears twice in the tree")
        if (flat <= PADDING_SLOT).any():
            raise AssertionError(f"the tree holds slot {int(flat.min())}; slots are >= 1")
        if flat.size != self._num_cached or not np.array_equal(np.sort(flat), self.cached_slots()):
            raise AssertionError("the tree's slot set differs from the slots of its nodes")
        self._check_locks(nodes)

    def _check_locks(self, nodes: list[_Node]) -> None:
        holders_through: dict[int, int] = {}
        for holder, node in self._holders.items():
            while node is not self._root:
                if node.evicted:
                    raise AssertionError(f"holder {holder!r} locks an evicted node")
                holders_through[id(node)] = holders_through.get(id(node), 0) + 1
                node = _parent(node)
        for node in nodes:
            if node.lock_count != holders_through.get(id(node), 0):
                raise AssertionError(
                    f"lock count {node.lock_count} != {holders_through.get(id(node), 0)} "
                    "holders whose prefix passes through the node"
                )
        locked = sum(n.tokens.size for n in nodes if n.lock_count > 0)
        if locked != self._num_locked:
            raise AssertionError(f"num_locked {self._num_locked} != {locked} locked slots")

    def _descend(self, key: np.ndarray) -> tuple[list[_Node], list[int]]:
        """The nodes along `key`'s cached prefix and how many tokens of each it matches (all
        but the last match their whole edge)."""
        path: list[_Node] = []
        matched: list[int] = []
        node, length = self._root, 0
        while length < key.size:
            child = node.children.get(int(key[length]))
            if child is None:
                break
            count = _common_length(child.tokens, key[length:])
            path.append(child)
            matched.append(count)
            length += count
            if count < child.tokens.size:
                break
            node = child
        return path, matched

    def _resolve(self, handle: Handle) -> _Node:
        """The node that ends exactly at the handle's length (splitting its edge if needed),
        as long as what the match returned is still cached."""
        node = handle.node
        while node.evicted:
            node = _parent(node)
        if node.end < handle.length:
            raise ValueError(
                f"the match of {handle.length} tokens was evicted before it was locked; "
                "match again and lock the new handle"
            )
        while node is not self._root and _parent(node).end >= handle.length:
            node = _parent(node)
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self._root:
            raise ValueError("the handle comes from another RadixCache")
        if node is not self._root and node.end > handle.length:
            node = self._split(node, handle.length - _parent(node).end)
        return node

    def _split(self, node: _Node, count: int) -> _Node:
        """Put a new node holding the first `count` tokens of `node`'s edge above it. The new
        node inherits the lock count and access time: every path through `node` runs
        through it."""
        if not 0 < count < node.tokens.size:
            raise AssertionError(f"split of a {node.tokens.size}-token edge at {count}")
        parent = _parent(node)
        head = self._new_node(node.tokens[:count], node.slots[:count], parent, node.last_access)
        head.lock_count = node.lock_count
        node.tokens = freeze(node.tokens[count:].copy())
        node.slots = freeze(node.slots[count:].copy())
        node.parent = head
        head.children[node.first_token] = node
        parent.children[head.first_token] = head
        return head

    def _add_leaf(self, parent: _Node, tokens: np.ndarray, slots: np.ndarray) -> _Node:
        leaf = self._new_node(tokens, slots, parent, self._clock)
        parent.children[leaf.first_token] = leaf
        top = int(slots.max())
        if top >= self._is_cached.size:  # grown geometrically: amortised O(1) per slot
            grown = np.zeros(max(top + 1, 2 * self._is_cached.size), dtype=bool)
            grown[: self._is_cached.size] = self._is_cached
            self._is_cached = grown
        self._is_cached[slots] = True
        self._num_cached += slots.size
        return leaf

    def _new_node(
        self, tokens: np.ndarray, slots: np.ndarray, parent: _Node, last_access: int
    ) -> _Node:
        node = _Node(
            freeze(tokens.copy()), freeze(slots.copy()), parent, last_access, self._num_nodes_made
        )
        self._num_nodes_made += 1
        return node

    def _remove_leaf(self, node: _Node) -> _Node:
        parent = _parent(node)
        del parent.children[node.first_token]
        self._is_cached[node.slots] = False
        self._num_cached -= node.slots.size
        return parent

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return node is not self._root and not node.children and node.lock_count == 0

    def _touch(self, node: _Node) -> None:
        while node is not self._root:
            node.last_access = self._clock
            node = _parent(node)

    def _refuse_cached(self, slots: np.ndarray) -> None:
        """Raise ValueError if the tree holds any of `slots` (slots >= 1)."""
        if not slots.size:
            return
        known = slots[slots < self._is_cached.size]
        owned = known[self._is_cached[known]]
        if owned.size:
            raise ValueError(
                f"slots {owned[:8].tolist()} are already in the tree at other positions; a "
                "slot has one owner (insert the tree's own slot for a cached position, or a "
                "free one)"
            )

    def _nodes(self) -> list[_Node]:
        """Every node but the root, parents before children."""
        found: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found


def _parent(node: _Node) -> _Node:
    if node.parent is None:
        raise AssertionError("the root has no parent")
    return node.parent


def _check_node(node: _Node) -> None:
    parent = _parent(node)
    if node.tokens.size == 0:
        raise AssertionError("a node other than the root has an empty edge")
    if node.slots.size != node.tokens.size:
        raise AssertionError(f"a node has {node.slots.size} slots for {node.tokens.size} tokens")
    if parent.children.get(node.first_token) is not node:
        raise AssertionError("a node is not its parent's child under its first token")
    if node.end != parent.end + node.tokens.size:
        raise AssertionError(f"a node ends at {node.end}, not {parent.end + node.tokens.size}")
    if node.last_access > parent.last_access and parent.parent is not None:
        raise AssertionError("a node was used after its parent (LRU would evict the parent first)")
    if node.lock_count > parent.lock_count and parent.parent is not None:
        raise AssertionError("a node has more locks than its parent")


def _common_length(edge: np.ndarray, key: np.ndarray) -> int:
    """How many leading tokens `edge` and `key` share; their first tokens are equal (a child
    is found by its first token), so a one-token edge needs no comparison."""
    size = min(edge.size, key.size)
    if size <= 1:
        return size
    differ = edge[:size] != key[:size]
    first = int(differ.argmax())  # the first True (0 when there is none)
    return first if differ[first] else size


def _key_array(tokens: IntSequence) -> np.ndarray:
    """Tokens to look up (`match`, `peek`): no scan for negative ids, which the tree never
    holds (`insert` refuses them), so that a lookup ends before any."""
    if type(tokens) is np.ndarray and tokens.dtype == INDEX_DTYPE and tokens.ndim == 1:
        return tokens
    return _int_array(tokens, "tokens")


def _token_array(tokens: IntSequence) -> np.ndarray:
    array = _int_array(tokens, "tokens")
    if array.size and array.min() < 0:
        raise ValueError(f"token id {int(array.min())} is negative; token ids are >= 0")
    return array


def _slot_array(slots: IntSequence, num_tokens: int) -> np.ndarray:
    array = _int_array(slots, "slots")
    if array.size != num_tokens:
        raise ValueError(f"{array.size} slots for {num_tokens} tokens; give one slot per token")
    if array.size and array.min() <= PADDING_SLOT:
        raise ValueError(f"slot {int(array.min())} given; slots are >= 1 (0 is the padding slot)")
    if has_duplicates(array):
        raise ValueError("a slot is given twice; each token has its own slot")
    return array


def _int_array(values: IntSequence, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=INDEX_DTYPE)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D sequence of ints; got {array.dtype} {array.shape}")
    return array.astype(INDEX_DTYPE, copy=False)
