"""Grammars on a byte vocabulary (token id i < 256 spells byte i): compiling and refusing
specs, matchers following committed tokens, masks, draft trees cut to what a grammar allows
and masked node by node."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from engine.shell.grammar import Grammars, Progress
from engine.shell.masks import apply_masks, unpack_words
from engine.spec import DraftTree, stack
from engine.spec.tree import unstack
from engine.state import StructuredOutputs

EOS = 2


def grammars() -> Grammars:
    return Grammars(None, 256, EOS)


def allowed(bitmask: np.ndarray, row: int = 0) -> set[int]:
    bits = np.unpackbits(bitmask[row : row + 1].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:256]).tolist())


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_regex_masks_follow_the_committed_tokens_and_end_complete() -> None:
    book = grammars()
    book.add(7, StructuredOutputs(regex="a[bc]d"))
    assert allowed(book.masks([7])) == {ord("a")}
    assert book.advance(7, ids("a")) is Progress.OPEN
    assert allowed(book.masks([7])) == {ord("b"), ord("c")}
    assert book.advance(7, ids("cd")) is Progress.COMPLETE
    assert allowed(book.masks([7])) == {EOS}  # complete: only EOS may follow
    book.remove(7)
    assert 7 not in book and not book


def test_a_token_outside_the_grammar_is_rejected_with_the_reason() -> None:
    book = grammars()
    book.add(1, StructuredOutputs(choice=("yes", "no")))
    assert book.advance(1, ids("x")) is Progress.REJECTED
    assert "doesn't satisfy the grammar" in book.error(1)


def test_unconstrained_rows_allow_every_token_and_none_means_no_work() -> None:
    book = grammars()
    assert book.masks([1, 2]) is None
    book.add(2, StructuredOutputs(regex="[0-9]"))
    bitmask = book.masks([1, 2, 3])
    assert allowed(bitmask, 0) == allowed(bitmask, 2) == set(range(256))
    assert allowed(bitmask, 1) == set(range(ord("0"), ord("9") + 1))


def test_a_pool_of_threads_computes_the_same_masks() -> None:
    one, pool = grammars(), Grammars(None, 256, EOS, parallel=True)
    specs = [StructuredOutputs(regex="[a-c]x"), StructuredOutputs(choice=("no", "yes"))]
    for book in (one, pool):
        for uid, spec in enumerate(specs):
            book.add(uid, spec)
        book.advance(0, ids("b"))
    assert np.array_equal(one.masks([0, 7, 1]), pool.masks([0, 7, 1]))
    assert one.stats["grammar_masks"] == pool.stats["grammar_masks"] == 2


def test_apply_masks_sets_what_a_row_does_not_allow_to_minus_infinity() -> None:
    book = grammars()
    book.add(5, StructuredOutputs(regex="[xy]"))
    logits = torch.randn(2, 300)  # wider than the grammar's vocabulary: the rest is blocked
    masked = apply_masks(logits, book.masks([9, 5]))
    assert torch.equal(masked[0, :256], logits[0, :256])
    assert torch.isinf(masked[0, 256:]).all()
    finite = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert finite == [ord("x"), ord("y")]


def test_the_device_unpacking_reads_the_bits_as_the_host_does() -> None:
    bitmask = np.random.default_rng(0).integers(-(2**31), 2**31, (3, 5)).astype(np.int32)
    host = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)
    assert torch.equal(unpack_words(torch.from_numpy(bitmask)), torch.from_numpy(host))


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        (dict(json={"type": "frobnicate"}), "structured_outputs.json", "frobnicate"),
        (dict(json={"$ref": "#/nowhere"}), "structured_outputs.json", "nowhere"),
        (dict(regex="[a-"), "structured_outputs.regex", "unclosed character class"),
        (dict(grammar="start: missing_rule"), "structured_outputs.grammar", "missing_rule"),
    ],
)
def test_specs_that_do_not_compile_are_refused_naming_the_field(
    spec: dict, field: str, says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says) as caught:
        grammars().compile(StructuredOutputs(**spec))
    assert caught.value.field == field


def test_a_json_schema_comes_out_compact_and_stops_when_closed() -> None:
    book = grammars()
    book.add(3, StructuredOutputs(json={"type": "object", "properties": {"a": {"enum": [1]}}}))
    assert allowed(book.masks([3])) == {ord("{")}
    assert book.advance(3, ids('{"a":1')) is Progress.OPEN
    assert ord(" ") not in allowed(book.masks([3]))
    assert book.advance(3, ids("}")) is Progress.COMPLETE


def test_prune_cuts_rejected_drafts_and_what_hangs_below_them() -> None:
    book = grammars()
    book.add(4, StructuredOutputs(regex="ab(c|d)e"))
    assert book.advance(4, ids("a")) is Progress.OPEN  # the root: the last committed token
    #  root 'a' -> 'b' -> 'c'                 kept
    #                     'c' -> 'e'          cut: it would complete the grammar
    #              'b' -> 'x'                 cut
    #       'a' -> 'q' -> 'b'                 cut with its parent
    tree = DraftTree(ids("abcexqb"), (-1, 0, 1, 2, 1, 0, 5))
    free = DraftTree(ids("abc"), (-1, 0, 1))  # an unconstrained request keeps its tree
    pruned = unstack(book.prune(stack([tree, free]), [4, 8]))
    assert pruned[0].tokens == tuple(ids("abc")) and pruned[0].parents == (-1, 0, 1)
    assert pruned[1].tokens == free.tokens
    assert book.stats["grammar_drafts_cut"] == 4
    assert allowed(book.masks([4])) == {ord("b")}  # the matcher is back where it was


def test_tree_masks_are_each_nodes_path_mask() -> None:
    book = grammars()
    spec = StructuredOutputs(regex="(ab|ac)[0-9]+")
    book.add(6, spec)
    # the root (X) is the pending token, which the matcher has already consumed
    trees = stack([DraftTree(ids("Xabc1"), (-1, 0, 1, 1, 2))])
    bitmask = book.tree_masks(trees, [6])
    reference = grammars()
    for node, path in enumerate(["", "a", "ab", "ac", "ab1"]):
        reference.add(node, spec)
        if path:
            reference.advance(node, ids(path))
        assert allowed(bitmask, node) == allowed(reference.masks([node])), path
    assert allowed(book.masks([6])) == {ord("a")}  # rolled back to the request's state


def test_pooled_tree_masks_fill_paths_in_parallel_the_same_as_the_walk() -> None:
    """With `parallel`, trees that are one path are filled by llguidance's pool (drafts
    and all), a branching tree by the walk; every row is the walk's, and the matchers end
    where they started."""
    spec = StructuredOutputs(regex="(ab|ac)[0-9]+")
    books = grammars(), Grammars(None, 256, EOS, parallel=True)
    trees = stack(
        [
            DraftTree(ids("Xab12"), (-1, 0, 1, 2, 3)),  # one path
            DraftTree(ids("Xabc1"), (-1, 0, 1, 1, 2)),  # branching
            DraftTree(ids("Yb"), (-1, 0)),  # one path, one draft
            DraftTree(ids("Z"), (-1,)),  # the root alone
            DraftTree(ids("Qzz"), (-1, 0, 1)),  # unconstrained
        ]
    )
    uids = [1, 2, 3, 4, 5]
    for book in books:
        for uid in uids[:4]:
            book.add(uid, spec)
        book.advance(3, ids("a"))
        book.advance(4, ids("ac"))
    serial, pooled = (book.tree_masks(trees, uids) for book in books)
    assert np.array_equal(serial, pooled)
    digits = set(range(ord("0"), ord("9") + 1))
    assert allowed(pooled, 1) == {ord("b"), ord("c")}  # after "a" on the path
    assert allowed(pooled, 2) == digits and allowed(pooled, 4) == digits | {EOS}
    assert allowed(pooled, 11) == allowed(pooled, 12) == digits  # uid 3 after "ab"; uid 4
    assert all(allowed(pooled, row) == set(range(256)) for row in (13, 14, 15))
    assert books[0].stats["grammar_masks"] == books[1].stats["grammar_masks"] == 13
    for book in books:  # rolled back to each request's state
        assert allowed(book.masks([1, 3])) == {ord("a")}
        assert allowed(book.masks([1, 3]), 1) == {ord("b"), ord("c")}
        assert allowed(book.masks([4])) == digits


def test_started_masks_are_filled_off_the_loops_thread_and_applied_later() -> None:
    """`start` returns before the masks are filled when `parallel` (a pool thread fills
    them, here held back until the loop has gone on); `apply` waits for them."""
    import threading

    book = Grammars(None, 256, EOS, parallel=True)
    book.add(0, StructuredOutputs(regex="[ab]+"))
    book.add(1, StructuredOutputs(regex="c"))
    go, filled_on = threading.Event(), []
    fill = book.fills.fill_rows

    def held(rows, bitmask):
        go.wait()
        filled_on.append(threading.current_thread())
        fill(rows, bitmask)

    book.fills.fill_rows = held
    pending = book.start([0, 9, 1])
    assert pending is not None and not pending.done  # the loop goes on meanwhile
    go.set()
    masked = pending.apply(torch.zeros(3, 260))
    assert filled_on and filled_on[0] is not threading.current_thread()
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [ord("a"), ord("b")]
    assert torch.isfinite(masked[1, :256]).all() and torch.isinf(masked[1, 256:]).all()
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [ord("c")]
    assert book.stats["grammar_masks"] == 2 and "grammar_mask_wait_seconds" in book.stats


def test_a_pass_advances_its_requests_matchers_together() -> None:
    """`advance_all`: each request past its committed tokens (one or several), by uid; after
    a fill on the pool's thread, as before it."""
    book = Grammars(None, 256, EOS, parallel=True)
    for uid, regex in {0: "ab", 1: "a[0-9]", 2: "x", 3: "abc"}.items():
        book.add(uid, StructuredOutputs(regex=regex))
    book.start([0, 1, 2, 3]).host()
    first = book.advance_all({0: ids("a"), 1: ids("a"), 2: ids("y"), 3: ids("ab")})
    assert first == {0: Progress.OPEN, 1: Progress.OPEN, 2: Progress.REJECTED, 3: Progress.OPEN}
    assert book.advance_all({0: ids("b"), 1: ids("7")}) == {
        0: Progress.COMPLETE,
        1: Progress.COMPLETE,
    }
    assert allowed(book.masks([3])) == {ord("c")}


def test_the_faster_way_to_fill_is_taken_and_the_other_retried_now_and_then() -> None:
    from engine.shell.masks import POOL, SERIAL, Faster

    faster = Faster()
    assert faster.pick() == POOL  # each way measured once first
    faster.record(POOL, 8.0, 4)  # 2 s a row
    assert faster.pick() == SERIAL
    faster.record(SERIAL, 4.0, 4)  # 1 s a row
    picks = [faster.pick() for _ in range(2 * Faster.PROBE)]
    assert picks.count(POOL) == 2 and picks.count(SERIAL) == 2 * Faster.PROBE - 2
    for _ in range(8):  # the pool turns faster: it is taken from then on
        faster.record(POOL, 0.1, 4)
    assert faster.pick() == POOL


def test_a_requests_matcher_is_a_copy_of_its_specs_start_made_once(monkeypatch) -> None:
    """The matcher at a spec's start is made once, when the spec is compiled (on the
    submitting thread); each request's matcher is a copy of it, which moves on its own."""
    import llguidance

    from engine.shell import grammar

    made = []
    matcher = llguidance.LLMatcher

    class Counting:  # llguidance.LLMatcher, counting the matchers made
        def __getattr__(self, name):
            return getattr(matcher, name)

        def __call__(self, *args, **kwargs):
            made.append(args[1])
            return matcher(*args, **kwargs)

    monkeypatch.setattr(grammar.llguidance, "LLMatcher", Counting())
    book = grammars()
    spec = StructuredOutputs(regex="a[bc]d")
    book.compile(spec)
    assert len(made) == 1
    for uid in range(4):
        book.add(uid, spec)
    assert len(made) == 1  # copies
    assert book.advance(0, ids("ab")) is Progress.OPEN
    assert allowed(book.masks([0])) == {ord("d")}
    assert allowed(book.masks([1])) == {ord("a")}  # the others (and the start) did not move
    book.add(9, spec, ids("ac"))
    assert allowed(book.masks([9])) == {ord("d")} and allowed(book.masks([2])) == {ord("a")}
    book.add(5, StructuredOutputs(regex="x"))  # a spec not compiled yet: compiled now
    assert len(made) == 2


def test_allows_checks_a_token_without_moving_the_matcher() -> None:
    book = grammars()
    book.add(3, StructuredOutputs(regex="a[bc]d"))
    assert book.allows(3, ord("a")) and not book.allows(3, ord("b"))
    assert not book.allows(3, 300) and not book.allows(3, -1)  # past the vocabulary
    assert allowed(book.masks([3])) == {ord("a")}  # not moved
    book.add(4, StructuredOutputs(regex="[0-9]{1,3}"))
    book.advance(4, ids("12"))  # may end or go on: EOS as allowed as a digit, as in a mask
    assert allowed(book.masks([4])) == {EOS, *ids("0123456789")}
    assert book.allows(4, EOS) and book.allows(4, ord("3")) and not book.allows(4, ord("a"))
    assert book.advance(3, ids("acd")) is Progress.COMPLETE
    assert book.allows(3, EOS) and not book.allows(3, ord("a"))  # complete: only EOS


def test_a_refused_check_starts_masked_runs_that_double_and_an_allowed_one_ends_them() -> None:
    book = grammars()
    book.add(4, StructuredOutputs(regex="[0-9]+"))

    def pattern(passes: int) -> str:  # "c": checked first, "m": masked first
        return "".join("c" if book.checks_first(4) else "m" for _ in range(passes))

    assert pattern(3) == "ccc"  # nothing refused yet
    for expected in ("c", "mc", "mmc", "mmmmc"):  # a first refusal alone starts no run
        book.note_check(4, allowed=False)
        assert pattern(len(expected)) == expected
    book.note_check(4, allowed=True)  # an allowed token ends the runs
    assert pattern(2) == "cc"
    book.note_check(4, allowed=False)
    assert pattern(2) == "cc"  # refused once since: no run
    book.note_check(4, allowed=False)
    assert pattern(2) == "mc"  # twice in a row: a new run starts from one
    for _ in range(10):  # runs stop growing at MASKED_FIRST_MAX
        book.note_check(4, allowed=False)
    assert pattern(65) == "m" * 64 + "c"
    assert book.stats["grammar_tokens_masked_first"] == 1 + 2 + 4 + 1 + 64
    book.note_check(4, allowed=False)
    book.remove(4)  # a finished request leaves nothing behind
    assert book._masked_runs == {}
