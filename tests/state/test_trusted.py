"""The trusted (fast) constructors that production runs give the values the checked
constructors give; under ENGINE_DEBUG a trusted value that breaks an invariant is caught."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from state_builders import VOCAB, Rule, finish_rules, rules_strategy

from engine.state import (
    MAX_TREE_NODES,
    DraftTrees,
    Effects,
    Running,
    SeqLens,
    debug,
    frozen_array,
)
from engine.state.debug import check_trusted, same_value, trusted

fast = settings(max_examples=60, deadline=None)
MAX_CONTEXT = 64
ids = st.lists(st.integers(0, 1000), max_size=8)


@contextlib.contextmanager
def production_mode() -> Iterator[None]:
    """The trusted constructors as they run with ENGINE_DEBUG=0: no checked rebuild."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(debug, "DEBUG", False)
        yield


def assert_same(first: object, second: object) -> None:
    assert type(first) is type(second)
    for field in attrs.fields(type(first)):
        mine, theirs = getattr(first, field.name), getattr(second, field.name)
        assert same_value(mine, theirs), f"{field.name}: {mine!r} != {theirs!r}"
        if isinstance(mine, np.ndarray):
            assert not mine.flags.writeable, f"{field.name} is writeable"


def test_the_switch_reads_engine_debug():
    # The suite sets ENGINE_DEBUG=1; test_production_mode runs these tests again with 0.
    assert debug.DEBUG == (os.environ.get("ENGINE_DEBUG", "0") not in ("", "0"))


@fast
@given(lens=st.lists(st.integers(0, 50), max_size=12))
def test_seqlens_fast_equals_checked(lens):
    with production_mode():
        quick = SeqLens.of_valid(frozen_array(lens))
    checked = SeqLens(lens)
    assert_same(quick, checked)
    assert quick == checked and quick.total == sum(lens) and quick.max == max(lens, default=0)


@st.composite
def running_columns(draw: st.DrawFn) -> dict[str, list[int]]:
    """The columns of a valid Running, as lists."""
    size = draw(st.integers(0, 6))
    token_lens = draw(st.lists(st.integers(1, MAX_CONTEXT), min_size=size, max_size=size))
    return dict(
        rids=draw(st.lists(st.integers(0, 10**6), min_size=size, max_size=size, unique=True)),
        rows=draw(st.permutations(range(size))),
        kv_lens=(kv_lens := [draw(st.integers(0, n)) for n in token_lens]),
        shared_lens=[draw(st.integers(0, n)) for n in kv_lens],
        token_lens=token_lens,
        prompt_lens=[draw(st.integers(1, n)) for n in token_lens],
        last_tokens=draw(st.lists(st.integers(0, VOCAB - 1), min_size=size, max_size=size)),
    )


@fast
@given(columns=running_columns(), data=st.data())
def test_running_fast_equals_checked(columns, data):
    size = len(columns["rids"])
    rules = finish_rules(data.draw(st.lists(rules_strategy, min_size=size, max_size=size)))
    checked = Running(
        columns["rids"],
        columns["rows"],
        SeqLens(columns["kv_lens"]),
        SeqLens(columns["token_lens"]),
        columns["prompt_lens"],
        columns["last_tokens"],
        rules,
        MAX_CONTEXT,
        columns["shared_lens"],
    )
    with production_mode():
        quick = Running.of_valid(
            frozen_array(columns["rids"]),
            frozen_array(columns["rows"]),
            SeqLens.of_valid(frozen_array(columns["kv_lens"])),
            SeqLens.of_valid(frozen_array(columns["token_lens"])),
            frozen_array(columns["prompt_lens"]),
            frozen_array(columns["last_tokens"]),
            rules,
            MAX_CONTEXT,
            frozen_array(columns["shared_lens"]),
        )
    assert_same(quick, checked)
    check_trusted(quick)  # what ENGINE_DEBUG adds: the checked rebuild agrees


@st.composite
def effects_columns(draw: st.DrawFn) -> dict[str, object]:
    """Consistent Effects columns (any subset of them), as lists and lists of lengths."""
    writes = draw(st.integers(0, 6))
    released = draw(st.integers(0, 4))
    shared = draw(st.integers(0, 3))
    emitted_lens = draw(st.lists(st.integers(0, 3), max_size=4))
    finished = draw(st.integers(0, 4))
    columns: dict[str, object] = dict(
        table_rows=draw(st.lists(st.integers(0, 9), min_size=writes, max_size=writes)),
        table_cols=draw(st.lists(st.integers(0, 63), min_size=writes, max_size=writes)),
        table_slots=draw(st.lists(st.integers(1, 999), min_size=writes, max_size=writes)),
        free_slots=draw(ids),
        release_rows=draw(st.lists(st.integers(0, 9), min_size=released, max_size=released)),
        release_lens=(
            release_lens := draw(st.lists(st.integers(0, 64), min_size=released, max_size=released))
        ),
        release_rids=draw(st.lists(st.integers(0, 99), min_size=released, max_size=released)),
        release_shared=[draw(st.integers(0, n)) for n in release_lens],
        release_cached=draw(st.lists(st.booleans(), min_size=released, max_size=released)),
        share_rids=draw(st.lists(st.integers(0, 99), min_size=shared, max_size=shared)),
        share_rows=draw(st.lists(st.integers(0, 9), min_size=shared, max_size=shared)),
        share_lens=draw(st.lists(st.integers(0, 64), min_size=shared, max_size=shared)),
        emitted_rids=draw(
            st.lists(st.integers(0, 99), min_size=len(emitted_lens), max_size=len(emitted_lens))
        ),
        emitted_lens=emitted_lens,
        emitted_tokens=draw(
            st.lists(
                st.integers(0, VOCAB - 1), min_size=sum(emitted_lens), max_size=sum(emitted_lens)
            )
        ),
        finished_rids=draw(st.lists(st.integers(0, 99), min_size=finished, max_size=finished)),
        finished_reasons=draw(st.lists(st.integers(1, 4), min_size=finished, max_size=finished)),
        retracted_rids=draw(ids),
    )
    # Fields left out take their defaults; the table writes and each CSR go together.
    groups = [
        ("table_rows", "table_cols", "table_slots"),
        ("free_slots",),
        ("release_rows", "release_lens", "release_rids", "release_shared", "release_cached"),
        ("share_rids", "share_rows", "share_lens"),
        ("emitted_rids", "emitted_lens", "emitted_tokens"),
        ("finished_rids", "finished_reasons"),
        ("retracted_rids",),
    ]
    kept = draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
    names = [name for group, keep in zip(groups, kept, strict=True) if keep for name in group]
    return {name: columns[name] for name in names}


def as_fields(columns: dict[str, object], array: object) -> dict[str, object]:
    """Lengths as SeqLens, flags as bool arrays, the rest through `array`."""

    def field(name: str, value: object) -> object:
        if name.endswith("_lens"):
            return SeqLens(value)
        if name == "release_cached" and array is frozen_array:
            return frozen_array(value, bool)
        return array(value)

    return {name: field(name, value) for name, value in columns.items()}


@fast
@given(columns=effects_columns())
def test_effects_fast_equals_checked(columns):
    checked = Effects(**as_fields(columns, list))
    with production_mode():
        quick = Effects.of_valid(**as_fields(columns, frozen_array))
    assert_same(quick, checked)
    check_trusted(quick)


@st.composite
def flat_trees(draw: st.DrawFn, valid: bool = True) -> tuple[list[int], list[int], list[int]]:
    """(sizes, tokens, parents) of draft trees in batch order; with `valid` False, sometimes
    one entry broken (an empty or oversized tree, a root with a parent, a parent not before
    its node, a negative token)."""
    sizes = draw(st.lists(st.integers(1, MAX_TREE_NODES), max_size=5))
    parents = [
        p for size in sizes for p in [-1, *(draw(st.integers(0, i - 1)) for i in range(1, size))]
    ]
    tokens = draw(st.lists(st.integers(0, 1000), min_size=len(parents), max_size=len(parents)))
    if not valid and parents:
        at = draw(st.integers(0, len(parents) - 1))
        kind = draw(st.sampled_from(["parent", "token", "size"]))
        if kind == "parent":  # at the edges of what is allowed: itself, just after, < 0
            local = at - max(start for start in itertools.accumulate([0, *sizes]) if start <= at)
            parents[at] = draw(st.sampled_from([local, local + 1, -1 if local else 0, -2]))
        elif kind == "token":
            tokens[at] = -1
        else:
            sizes[draw(st.integers(0, len(sizes) - 1))] = draw(st.sampled_from([0, 64]))
    return sizes, tokens, parents


@fast
@given(trees=flat_trees())
def test_draft_trees_from_flat_equals_checked(trees):
    sizes, tokens, parents = trees
    checked = DraftTrees(SeqLens(sizes), tokens, parents)
    with production_mode():
        quick = DraftTrees.from_flat(sizes, tokens, parents)
    assert_same(quick, checked)
    check_trusted(quick)


@settings(max_examples=150, deadline=None)
@given(trees=flat_trees(valid=False))
def test_draft_trees_from_flat_refuses_what_the_checked_constructor_refuses(trees):
    sizes, tokens, parents = trees
    try:
        checked = DraftTrees(SeqLens(sizes), tokens, parents)
    except ValueError:
        with production_mode(), pytest.raises(ValueError):
            DraftTrees.from_flat(sizes, tokens, parents)
    else:
        with production_mode():
            assert_same(DraftTrees.from_flat(sizes, tokens, parents), checked)


def test_fields_are_checked_in_both_modes():
    lens = frozen_array([1, 2])
    for mode in (contextlib.nullcontext(), production_mode()):
        with mode:
            with pytest.raises(TypeError, match="no fields"):
                trusted(SeqLens, lens=lens, total=3, sum=3)
            with pytest.raises(TypeError, match="needs its field total"):
                trusted(SeqLens, lens=lens)


@pytest.mark.skipif(not debug.DEBUG, reason="the checked rebuild runs under ENGINE_DEBUG")
def test_under_engine_debug_a_broken_trusted_value_is_caught():
    lens = frozen_array([1, 2])
    with pytest.raises(AssertionError, match="total"):
        trusted(SeqLens, lens=lens, total=4)  # a stale total
    with pytest.raises(AssertionError, match="converter"):
        SeqLens.of_valid(np.array([1, 2]))  # writeable: a snapshot would share it
    with pytest.raises(ValueError, match=">= 0"):
        SeqLens.of_valid(frozen_array([1, -2]))
    with pytest.raises(ValueError, match="exceed"):
        one = frozen_array([1])
        rules = finish_rules([Rule(max_new=8, min_new=0, eos=-1, stops=())])
        Running.of_valid(one, one, SeqLens([5]), SeqLens([4]), one, one, rules, 64, one)
    with pytest.raises(ValueError, match="emitted tokens"):
        Effects.of_valid(emitted_tokens=frozen_array([3]))
