"""The prefix cache's radix tree: exact tests of each operation and error, one regression test
per leak we can imagine, and a hypothesis state machine against a plain-Python model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.shell.radix import RadixCache


def cache_of(*sequences: tuple[list[int], list[int]]) -> RadixCache:
    cache = RadixCache()
    for tokens, slots in sequences:
        cache.insert(tokens, slots)
    cache.check()
    return cache


def test_empty_cache_matches_nothing():
    cache = RadixCache()
    match = cache.match([1, 2, 3])
    assert match.length == 0 and match.slots.tolist() == []
    assert (cache.num_slots, cache.num_locked, cache.num_evictable) == (0, 0, 0)
    cache.check()


def test_match_returns_the_longest_cached_prefix_and_its_slots():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]), ([1, 2, 7], [11, 12, 17]))
    assert cache.match([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]
    assert cache.match([1, 2, 3, 9]).slots.tolist() == [11, 12, 13]
    assert cache.match([1, 2, 7]).slots.tolist() == [11, 12, 17]
    assert cache.match([2]).slots.tolist() == []
    assert cache.match(np.array([1, 2], dtype=np.int32)).slots.tolist() == [11, 12]


def test_match_slots_are_read_only():
    cache = cache_of(([1, 2], [5, 6]))
    with pytest.raises(ValueError, match="read-only"):
        cache.match([1, 2]).slots[0] = 9


def test_match_inside_an_edge_splits_nothing():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    cache.match([1, 2])
    assert len(cache._nodes()) == 1
    cache.check()


def test_insert_returns_the_callers_duplicates_and_keeps_its_own():
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    duplicates = cache.insert([1, 2, 3, 4], [21, 22, 23, 24])
    assert duplicates.tolist() == [21, 22, 23]
    assert cache.match([1, 2, 3, 4]).slots.tolist() == [11, 12, 13, 24]
    assert cache.num_slots == 4
    cache.check()


def test_insert_of_the_trees_own_slots_returns_none_of_them():
    """A request that matched a prefix inserts its row, the tree's slots first: those are the
    tree's own and must not come back to be freed."""
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    prefix = cache.match([1, 2, 3, 4, 5]).slots.tolist()
    assert cache.insert([1, 2, 3, 4, 5], prefix + [24, 25]).tolist() == []
    assert cache.num_slots == 5
    cache.check()


def test_insert_that_branches_inside_an_edge_splits_it():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    assert cache.insert([1, 2, 9], [31, 32, 39]).tolist() == [31, 32]
    assert len(cache._nodes()) == 3
    assert cache.match([1, 2, 3, 4]).slots.tolist() == [11, 12, 13, 14]
    assert cache.match([1, 2, 9]).slots.tolist() == [11, 12, 39]
    cache.check()


def test_insert_of_a_cached_prefix_changes_nothing():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    assert cache.insert([1, 2], [11, 12]).tolist() == []
    assert cache.insert([], []).tolist() == []
    assert len(cache._nodes()) == 1 and cache.num_slots == 4
    cache.check()


@pytest.mark.parametrize(
    ("tokens", "slots", "message"),
    [
        ([1, 2], [5], "1 slots for 2 tokens; give one slot per token"),
        ([1, 2], [5, 0], "slot 0 given; slots are >= 1"),
        ([1, 2], [5, -3], "slot -3 given; slots are >= 1"),
        ([1, -2], [5, 6], "token id -2 is negative"),
        ([1, 2], [5, 5], "a slot is given twice"),
        ([1.0, 2.0], [5, 6], "tokens must be a 1-D sequence of ints"),
        ([1, 2], [[5, 6]], "slots must be a 1-D sequence of ints"),
    ],
)
def test_insert_refuses_bad_input(tokens, slots, message):
    cache = RadixCache()
    with pytest.raises(ValueError, match=message):
        cache.insert(tokens, slots)
    assert cache.num_slots == 0


def test_insert_refuses_a_slot_the_tree_holds_elsewhere():
    cache = cache_of(([1, 2], [11, 12]))
    with pytest.raises(ValueError, match=r"slots \[11\] are already in the tree"):
        cache.insert([3, 4], [11, 14])
    with pytest.raises(ValueError, match=r"slots \[12\] are already in the tree"):
        cache.insert([1, 5], [12, 15])
    assert cache.num_slots == 2
    cache.check()


def test_lock_counts_whole_nodes_and_unlock_releases_them():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    cache.lock("a", cache.match([1, 2, 3, 4]).handle)
    cache.lock("b", cache.match([1, 2, 3, 4]).handle)
    assert (cache.num_locked, cache.num_evictable) == (4, 0)
    assert cache.held_length("a") == 4
    cache.unlock("a")
    assert cache.num_locked == 4
    cache.unlock("b")
    assert (cache.num_locked, cache.num_evictable, cache.held_length("a")) == (0, 4, 0)
    cache.check()


def test_lock_inside_an_edge_splits_it_and_locks_the_head_only():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    cache.lock("a", cache.match([1, 2, 9]).handle)
    assert (cache.num_locked, cache.num_evictable, cache.held_length("a")) == (2, 2, 2)
    assert len(cache._nodes()) == 2
    cache.check()
    assert cache.evict(4).tolist() == [13, 14]
    assert cache.match([1, 2, 3]).slots.tolist() == [11, 12]


def test_an_empty_match_locks_nothing_but_its_holder():
    cache = cache_of(([1, 2], [11, 12]))
    cache.lock("a", cache.match([7]).handle)
    assert cache.num_locked == 0 and cache.held_length("a") == 0
    with pytest.raises(ValueError, match="already locks"):
        cache.lock("a", cache.match([1]).handle)
    cache.unlock("a")
    cache.check()


def test_lock_twice_for_one_holder_raises():
    cache = cache_of(([1, 2], [11, 12]))
    cache.lock("a", cache.match([1, 2]).handle)
    with pytest.raises(ValueError, match="holder 'a' already locks a prefix of 2 tokens"):
        cache.lock("a", cache.match([1]).handle)
    assert cache.num_locked == 2 and cache.held_length("a") == 2
    cache.check()


def test_unlock_of_a_holder_that_holds_nothing_raises():
    cache = cache_of(([1, 2], [11, 12]))
    with pytest.raises(ValueError, match="holder 'a' locks nothing"):
        cache.unlock("a")
    cache.lock("a", cache.match([1, 2]).handle)
    cache.unlock("a")
    with pytest.raises(ValueError, match="holder 'a' locks nothing"):
        cache.unlock("a")
    cache.check()


def test_a_handle_from_another_cache_is_refused():
    cache, other = cache_of(([1, 2], [11, 12])), cache_of(([1, 2], [11, 12]))
    with pytest.raises(ValueError, match="another RadixCache"):
        cache.lock("a", other.match([1, 2]).handle)
    assert cache.held_length("a") == 0
    cache.check()


def test_evict_frees_unlocked_leaves_in_lru_order():
    cache = cache_of(([1, 2], [11, 12]), ([3, 4], [13, 14]), ([5, 6], [15, 16]))
    cache.match([1, 2])  # now the most recently used
    assert cache.evict(1).tolist() == [13, 14]  # whole leaves: at least 1
    assert cache.evict(2).tolist() == [15, 16]
    assert cache.num_slots == 2
    cache.check()


def test_evict_takes_all_it_can_when_asked_for_more():
    cache = cache_of(([1, 2], [11, 12]), ([3, 4], [13, 14]))
    cache.lock("a", cache.match([3]).handle)
    assert sorted(cache.evict(100).tolist()) == [11, 12, 14]
    assert (cache.num_slots, cache.num_locked, cache.num_evictable) == (1, 1, 0)
    assert cache.evict(0).tolist() == [] and cache.evict(5).tolist() == []
    cache.check()


def test_evict_refuses_a_negative_count():
    with pytest.raises(ValueError, match="asked to evict -1 slots; the count must be >= 0"):
        RadixCache().evict(-1)


# One regression test per leak: each fails when its bug is put back (see the commit message).


def test_evict_never_frees_a_locked_prefix():
    cache = cache_of(([1, 2, 3], [11, 12, 13]), ([4, 5], [14, 15]))
    cache.lock("a", cache.match([1, 2, 3]).handle)
    cache.match([4, 5])
    assert cache.evict(5).tolist() == [14, 15]
    assert cache.match([1, 2, 3]).slots.tolist() == [11, 12, 13]
    cache.check()


def test_evict_reaches_a_parent_whose_children_are_gone():
    cache = cache_of(([1, 2], [11, 12]), ([1, 2, 3], [11, 12, 13]), ([1, 2, 4], [11, 12, 14]))
    assert sorted(cache.evict(4).tolist()) == [11, 12, 13, 14]
    assert cache.num_slots == 0
    cache.check()


def test_lock_counts_survive_a_split_of_a_locked_edge():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    cache.lock("a", cache.match([1, 2, 3, 4]).handle)
    cache.insert([1, 2, 9], [21, 22, 29])  # splits the locked edge after two tokens
    cache.check()
    assert cache.evict(10).tolist() == [29]
    cache.unlock("a")
    cache.check()
    assert sorted(cache.evict(10).tolist()) == [11, 12, 13, 14]


def test_unlock_releases_the_whole_path():
    cache = cache_of(([1, 2], [11, 12]), ([1, 2, 3, 4], [11, 12, 13, 14]))
    cache.lock("a", cache.match([1, 2, 3, 4]).handle)
    cache.unlock("a")
    cache.check()
    assert cache.num_evictable == 4
    assert sorted(cache.evict(4).tolist()) == [11, 12, 13, 14]


def test_second_holder_does_not_count_locked_slots_twice():
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    cache.lock("a", cache.match([1, 2, 3]).handle)
    cache.lock("b", cache.match([1, 2]).handle)
    assert (cache.num_locked, cache.num_evictable) == (3, 0)
    cache.unlock("a")
    assert (cache.num_locked, cache.num_evictable) == (2, 1)
    cache.check()


def test_reinsert_returns_every_duplicate_slot():
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    assert cache.insert([1, 2, 3], [21, 22, 23]).tolist() == [21, 22, 23]
    assert cache.match([1, 2, 3]).slots.tolist() == [11, 12, 13]
    cache.check()


def test_a_match_evicted_before_its_lock_is_refused():
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    handle = cache.match([1, 2, 3]).handle
    cache.evict(3)
    cache.insert([1, 2, 3], [21, 22, 23])  # the same tokens, other slots
    with pytest.raises(ValueError, match="evicted before it was locked"):
        cache.lock("a", handle)
    assert cache.num_locked == 0
    cache.check()


def test_a_match_whose_edge_was_split_and_tail_evicted_still_locks_its_prefix():
    cache = cache_of(([1, 2, 3, 4], [11, 12, 13, 14]))
    handle = cache.match([1, 2, 9]).handle  # ends inside the edge, after [1, 2]
    cache.insert([1, 2, 7], [21, 22, 27])  # splits the edge at 2
    assert sorted(cache.evict(3).tolist()) == [13, 14, 27]
    cache.lock("a", handle)
    assert (cache.num_locked, cache.held_length("a")) == (2, 2)
    cache.check()


@pytest.mark.parametrize(
    ("branch", "evicted"), [([1, 2, 3, 7], [13, 14, 15, 27]), ([1, 2, 8], [13, 14, 15, 28])]
)
def test_a_split_at_or_after_the_match_end_locks_exactly_the_match(branch, evicted):
    """The handle's node became the tail of a split that put the match's end in the head."""
    cache = cache_of(([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]))
    handle = cache.match([1, 2, 9]).handle
    cache.insert(branch, [20 + token for token in branch])
    cache.lock("a", handle)
    assert (cache.num_locked, cache.held_length("a")) == (2, 2)
    cache.check()
    assert sorted(cache.evict(10).tolist()) == evicted
    assert cache.match([1, 2, 3]).slots.tolist() == [11, 12]


def test_a_split_before_the_match_end_locks_exactly_the_match():
    cache = cache_of(([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]))
    handle = cache.match([1, 2, 3, 9]).handle
    cache.insert([1, 7], [21, 27])
    cache.lock("a", handle)
    assert (cache.num_locked, cache.held_length("a")) == (3, 3)
    cache.check()
    assert sorted(cache.evict(10).tolist()) == [14, 15, 27]


def lru_twins(*sequences):
    """Two caches built alike: what one does with match, the other with peek and take."""
    return cache_of(*sequences), cache_of(*sequences)


@pytest.mark.parametrize("split_at", [None, 1, 2, 3, 4])
def test_take_of_a_peek_is_the_match_even_after_a_lock_split_its_edge(split_at):
    """Admission peeks every waiting request, then locks the prefixes of those it admits in
    turn: a lock may split the edge a later peek ended in, above or below its end."""
    sequences = (([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]), ([1, 2, 7], [21, 22, 27]))
    matched, taken = lru_twins(*sequences)
    peek = taken.peek([1, 2, 3, 4, 9])
    assert (peek.length, peek.num_unlocked) == (4, 4)
    for cache in (matched, taken):
        if split_at is not None:
            cache.lock("other", cache.match([1, 2, 3, 4, 5][:split_at]).handle)
        cache.match([1, 2, 7])  # a use since: the LRU order then shows what the take touched
    match, took = matched.match([1, 2, 3, 4, 9]), taken.take(peek)
    assert took.slots.tolist() == match.slots.tolist() == [11, 12, 13, 14]
    assert took.num_unlocked == match.num_unlocked
    assert not took.slots.flags.writeable
    matched.lock("a", match.handle)
    taken.lock("a", took.handle)
    for cache in (matched, taken):
        cache.check()
        assert (cache.held_length("a"), cache.num_locked) == (4, 4)
        cache.unlock("a")
        if split_at is not None:
            cache.unlock("other")
    assert taken.evict(10).tolist() == matched.evict(10).tolist()  # the same LRU order


def test_take_of_an_empty_peek_gathers_nothing():
    cache = cache_of(([1, 2], [11, 12]))
    took = cache.take(cache.peek([3, 1, 2]))
    assert took.length == 0 and took.num_unlocked == 0
    cache.check()


def test_take_of_a_peek_evicted_since_is_refused():
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    peek = cache.peek([1, 2, 3])
    cache.evict(3)
    with pytest.raises(ValueError, match="evicted before it was taken"):
        cache.take(peek)


def test_a_lookup_of_a_negative_token_ends_there():
    """Lookups do not scan for negative ids (the tree holds none: insert refuses them)."""
    cache = cache_of(([1, 2, 3], [11, 12, 13]))
    assert cache.match([1, -2, 3]).slots.tolist() == [11]
    assert cache.peek(np.array([1, 2, -3])).length == 2
    assert cache.match([-1]).length == 0


# The state machine: requests start (match + lock + own slots), finish (insert + unlock) or
# abort; fresh sequences are inserted; matches are locked later; the cache evicts when the
# pool runs dry. The model: a dict from each cached prefix to its last token's slot.

CAPACITY = 24
FAMILIES = ([5, 6, 7, 8, 9, 10], [5, 6, 1, 2], [3, 4, 3, 4, 3], [9])
HOLDERS = ("r0", "r1", "r2", "r3")
sequences = st.builds(
    lambda family, cut, tail: FAMILIES[family][: cut % (len(FAMILIES[family]) + 1)] + tail,
    st.integers(0, len(FAMILIES) - 1),
    st.integers(0, 6),
    st.lists(st.integers(0, 3), max_size=4),
)


class RadixMachine(RuleBasedStateMachine):
    pending = Bundle("pending")

    @initialize()
    def start_empty(self):
        self.cache = RadixCache()
        self.free = list(range(CAPACITY, 0, -1))
        self.model: dict[tuple[int, ...], int] = {}
        self.running: dict[str, tuple[list[int], list[int], list[int]]] = {}
        self.evicted_since: list[set[tuple[int, ...]]] = []

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self.free):
            self.evict(count - len(self.free))
        if count > len(self.free):
            return None
        taken, self.free = self.free[len(self.free) - count :], self.free[: len(self.free) - count]
        return taken

    def expect_match(self, tokens: list[int]) -> list[int]:
        slots = []
        while tuple(tokens[: len(slots) + 1]) in self.model and len(slots) < len(tokens):
            slots.append(self.model[tuple(tokens[: len(slots) + 1])])
        return slots

    def model_insert(self, tokens: list[int], slots: list[int]) -> list[int]:
        """The model after an insert; returns the duplicates the cache must return."""
        expected = []
        for position, slot in enumerate(slots):
            cached = self.model.setdefault(tuple(tokens[: position + 1]), slot)
            if cached != slot:
                expected.append(slot)
        return expected

    def insert(self, tokens: list[int], slots: list[int]) -> None:
        expected = self.model_insert(tokens, slots)
        assert self.cache.insert(tokens, slots).tolist() == expected
        self.free.extend(expected)

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {
            tuple(tokens[:length])
            for tokens, prefix, _ in self.running.values()
            for length in range(1, 1 + len(prefix))
        }

    @rule(tokens=sequences)
    def match(self, tokens):
        expected = self.expect_match(tokens)
        locked = self.locked_prefixes()
        unlocked = sum(tuple(tokens[: i + 1]) not in locked for i in range(len(expected)))
        peek = self.cache.peek(tokens)
        assert (peek.length, peek.num_unlocked) == (len(expected), unlocked)
        match = self.cache.match(tokens)
        assert match.slots.tolist() == expected and match.num_unlocked == unlocked

    @rule(tokens=sequences)
    def insert_fresh(self, tokens):
        slots = self.alloc(len(tokens))
        if slots is not None:
            self.insert(tokens, slots)

    @precondition(lambda self: len(self.running) < len(HOLDERS))
    @rule(tokens=sequences, data=st.data(), peeked=st.booleans())
    def start(self, tokens, data, peeked):
        """`peeked`: as the engine admits, a peek's take rather than a second match."""
        holder = data.draw(st.sampled_from([h for h in HOLDERS if h not in self.running]))
        match = self.cache.take(self.cache.peek(tokens)) if peeked else self.cache.match(tokens)
        assert match.slots.tolist() == self.expect_match(tokens)
        self.cache.lock(holder, match.handle)
        own = self.alloc(len(tokens) - match.length)
        if own is None:
            self.cache.unlock(holder)
            return
        self.running[holder] = (tokens, match.slots.tolist(), own)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), commit=st.booleans())
    def finish_or_abort(self, data, commit):
        holder = data.draw(st.sampled_from(sorted(self.running)))
        tokens, prefix, own = self.running.pop(holder)
        if commit:
            self.insert(tokens, prefix + own)
        else:
            self.free.extend(own)
        self.cache.unlock(holder)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def share(self, data):
        """A running request hands its tokens to the cache and locks all of them (as
        `KVBook` does for a prompt prefilled in chunks): `insert_match`'s match is the one
        `match` would return, and its handle locks the whole sequence."""
        holder = data.draw(st.sampled_from(sorted(self.running)))
        tokens, prefix, own = self.running[holder]
        expected = self.model_insert(tokens, prefix + own)
        duplicates, match = self.cache.insert_match(tokens, prefix + own)
        assert duplicates.tolist() == expected
        self.free.extend(expected)
        assert match.slots.tolist() == self.expect_match(tokens) and match.length == len(tokens)
        locked = self.locked_prefixes()
        unlocked = sum(tuple(tokens[: i + 1]) not in locked for i in range(len(tokens)))
        assert match.num_unlocked == unlocked
        self.cache.unlock(holder)
        self.cache.lock(holder, match.handle)
        assert self.cache.held_length(holder) == len(tokens)
        self.running[holder] = (tokens, match.slots.tolist(), [])

    @rule(target=pending, tokens=sequences)
    def match_for_later(self, tokens):
        match = self.cache.match(tokens)
        self.evicted_since.append(set())
        return (match, tuple(tokens[: match.length]), self.evicted_since[-1])

    @precondition(lambda self: len(self.running) < len(HOLDERS))
    @rule(pending=consumes(pending), data=st.data())
    def lock_later(self, pending, data):
        match, prefix, evicted = pending
        holder = data.draw(st.sampled_from([h for h in HOLDERS if h not in self.running]))
        if prefix in evicted:
            with pytest.raises(ValueError, match="evicted before it was locked"):
                self.cache.lock(holder, match.handle)
            return
        assert match.slots.tolist() == self.expect_match(list(prefix))
        self.cache.lock(holder, match.handle)
        assert self.cache.held_length(holder) == len(prefix)
        self.running[holder] = (list(prefix), match.slots.tolist(), [])

    @rule(num_slots=st.integers(0, CAPACITY))
    def evict(self, num_slots):
        evictable, locked = self.cache.num_evictable, self.locked_slots()
        freed = self.cache.evict(num_slots).tolist()
        assert len(freed) >= min(num_slots, evictable)
        assert len(freed) >= num_slots or self.cache.num_evictable == 0
        assert not set(freed) & locked, "a locked slot was evicted"
        gone = {prefix for prefix, slot in self.model.items() if slot in set(freed)}
        assert len(gone) == len(freed)
        for prefix in gone:
            del self.model[prefix]
        for evicted in self.evicted_since:
            evicted.update(gone)
        self.free.extend(freed)

    def locked_slots(self) -> set[int]:
        return {slot for _, prefix, _ in self.running.values() for slot in prefix}

    @invariant()
    def tree_is_sound(self):
        self.cache.check()

    @invariant()
    def slots_are_conserved(self):
        owned = [slot for _, _, own in self.running.values() for slot in own]
        assert len(self.free) + self.cache.num_slots + len(owned) == CAPACITY
        assert len(set(self.free) | set(owned) | set(self.model.values())) == CAPACITY
        assert self.cache.num_slots == len(self.model)

    @invariant()
    def locks_match_the_model(self):
        assert self.cache.num_locked == len(self.locked_prefixes())
        for holder, (_, prefix, _) in self.running.items():
            assert self.cache.held_length(holder) == len(prefix)

    @invariant()
    def tree_holds_what_the_model_holds(self):
        assert all(len(prefix) == 1 or prefix[:-1] in self.model for prefix in self.model)
        tree_slots = {slot for node in self.cache._nodes() for slot in node.slots.tolist()}
        assert tree_slots == set(self.model.values())


RadixMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50)
TestRadixMachine = RadixMachine.TestCase
