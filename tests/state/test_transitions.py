"""One hypothesis property test per transition, each checked against plain-Python arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from state_builders import (
    VOCAB,
    Rule,
    check_totals,
    path_to,
    ref_finish,
    rules_strategy,
    running_of,
    tree_lists,
)

from engine import state
from engine.state import DraftTrees, FinishReason, Mode, Running, SeqLens
from engine.state.debug import check_trusted, same_value

MAX_CONTEXT = 48
fast = settings(max_examples=60, deadline=None)


@st.composite
def runnings(
    draw: st.DrawFn, min_pending: int = 1, max_pending: int = 6, max_size: int = 5
) -> tuple[Running, list[Rule]]:
    """A Running of distinct requests; rids 10.., rows shuffled, every request pending >= 1."""
    size = draw(st.integers(0, max_size))
    rules = draw(st.lists(rules_strategy, min_size=size, max_size=size))
    prompt = draw(st.lists(st.integers(1, 12), min_size=size, max_size=size))
    output = draw(st.lists(st.integers(0, 6), min_size=size, max_size=size))
    pending = draw(st.lists(st.integers(min_pending, max_pending), min_size=size, max_size=size))
    token_lens = [p + o for p, o in zip(prompt, output, strict=True)]
    kv = [max(t - n, 0) for t, n in zip(token_lens, pending, strict=True)]
    rows = draw(st.permutations(range(size)))
    last = draw(st.lists(st.integers(0, VOCAB - 1), min_size=size, max_size=size))
    run = running_of(range(10, 10 + size), rows, kv, token_lens, prompt, last, rules, MAX_CONTEXT)
    return run, rules


def fresh_slots(count: int, start: int = 100) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.int64)


def check_emitted(
    run: Running, rules: list[Rule], index: int, offered: list[int], effects: state.Effects
) -> tuple[int, FinishReason]:
    """Request `index` was offered `offered` tokens: effects must match the reference."""
    rid = int(run.rids[index])
    kept, reason = ref_finish(
        offered, rules[index], int(run.num_output[index]), run.token_lens[index], run.max_context
    )
    assert effects.emitted().get(rid, []) == offered[:kept]
    assert effects.finished().get(rid, FinishReason.NONE) == reason
    return kept, reason


@fast
@given(case=runnings(), chunk_cap=st.integers(1, 8), data=st.data())
def test_extend_commits_chunks_and_samples_only_at_the_end(case, chunk_cap, data):
    run, rules = case
    chunks = np.minimum(run.pending_lens, chunk_cap)
    slots = fresh_slots(int(chunks.sum()))
    ids = np.arange(chunks.sum()) % VOCAB
    batch = state.schedule_extend(run, chunks, ids, slots)
    assert batch.seq_lens.tolist() == (run.kv_lens.lens + chunks).tolist()
    assert batch.positions.tolist() == [
        kv + j for kv, n in zip(run.kv_lens.tolist(), chunks, strict=True) for j in range(n)
    ]
    samples = (chunks == run.pending_lens).tolist()
    assert batch.samples.tolist() == samples
    assert batch.logit_rows.tolist() == (np.cumsum(chunks) - 1)[samples].tolist()
    assert batch.output_rows.tolist() == batch.logit_rows.tolist()  # no score rows
    total = int(chunks.sum())
    scored = data.draw(st.lists(st.integers(0, total - 1), unique=True)) if total else []
    if total and batch.mode == Mode.EXTEND:
        rows = np.sort(np.array(scored, dtype=np.int64))
        with_scores = state.schedule_extend(run, chunks, ids, slots, rows)
        assert with_scores.output_rows.tolist() == batch.logit_rows.tolist() + rows.tolist()
        if rows.size:  # out of order, out of range: refused
            with pytest.raises(ValueError, match="score_rows"):
                state.schedule_extend(
                    run, chunks, ids, slots, rows[::-1] if rows.size > 1 else rows + total
                )
    sampled = data.draw(
        st.lists(st.integers(0, VOCAB - 1), min_size=sum(samples), max_size=sum(samples))
    )
    result = state.extend(batch, sampled)
    check_totals(result)
    eff = result.effects
    assert eff.table_rows.tolist() == np.repeat(run.rows, chunks).tolist()
    assert eff.table_cols.tolist() == batch.positions.tolist()
    assert eff.table_slots.tolist() == slots.tolist()
    draws = iter(sampled)
    live = []
    for i in range(len(run)):
        offered = [next(draws)] if samples[i] else []
        kept, reason = check_emitted(run, rules, i, offered, eff)
        if reason == FinishReason.NONE:
            live.append(
                (int(run.rids[i]), run.kv_lens[i] + int(chunks[i]), run.token_lens[i] + kept)
            )
    after = result.running
    assert (
        list(
            zip(after.rids.tolist(), after.kv_lens.tolist(), after.token_lens.tolist(), strict=True)
        )
        == live
    )


@fast
@given(case=runnings(max_pending=4), data=st.data())
def test_extend_rejects_chunks_past_the_pending_tokens(case, data):
    run, _ = case
    if len(run) == 0:
        return
    chunks = run.pending_lens.copy()
    chunks[data.draw(st.integers(0, len(run) - 1))] += 1
    with pytest.raises(ValueError, match="exceed the pending tokens"):
        state.schedule_extend(run, chunks, np.zeros(chunks.sum()), fresh_slots(chunks.sum()))
    batch = state.schedule_extend(
        run, run.pending_lens, np.zeros(run.pending_lens.sum()), fresh_slots(run.pending_lens.sum())
    )
    with pytest.raises(ValueError, match="requests sample this pass"):
        state.extend(batch, np.zeros(len(run) + 1))


@fast
@given(case=runnings(max_pending=1), data=st.data())
def test_decode_gives_every_request_one_token(case, data):
    run, rules = case
    batch = state.schedule_decode(run, fresh_slots(len(run)))
    assert batch.mode == (Mode.DECODE if len(run) else Mode.IDLE)
    assert batch.input_ids.tolist() == run.last_tokens.tolist()
    assert batch.positions.tolist() == run.kv_lens.tolist()
    sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(run), max_size=len(run)))
    result = state.decode(batch, sampled)
    check_totals(result)
    assert result.effects.table_cols.tolist() == run.kv_lens.tolist()
    for i in range(len(run)):
        check_emitted(run, rules, i, [sampled[i]], result.effects)
    done = set(result.effects.finished_rids.tolist())
    assert result.effects.release_rows.tolist() == [
        r for r, rid in zip(run.rows.tolist(), run.rids.tolist(), strict=True) if rid in done
    ]
    assert result.effects.release_lens.tolist() == [
        kv + 1
        for kv, rid in zip(run.kv_lens.tolist(), run.rids.tolist(), strict=True)
        if rid in done
    ]
    assert (result.running.pending_lens == 1).all()


@fast
@given(case=runnings(max_pending=1), data=st.data())
def test_planning_ahead_agrees_with_the_commit(case, data):
    """decode_writes is the token-independent part of decode's effects, and the Running that
    assume_decoded plans for has the committed layout exactly when nobody finished."""
    run, _ = case
    batch = state.schedule_decode(run, fresh_slots(len(run)))
    sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(run), max_size=len(run)))
    result = state.decode(batch, sampled)
    writes = state.decode_writes(batch)
    for name in ("table_rows", "table_cols", "table_slots"):
        assert getattr(writes, name).tolist() == getattr(result.effects, name).tolist()
    assert writes.free_slots.size == writes.release_rows.size == writes.emitted_rids.size == 0
    planned = state.assume_decoded(batch)
    assert planned.kv_lens.total == sum(planned.kv_lens.tolist())
    nobody_left = result.effects.finished_rids.size == 0
    assert state.same_layout(planned, result.running) == nobody_left
    assert planned.kv_lens.tolist() == (run.kv_lens + batch.new_lens).tolist()


@fast
@given(case=runnings(max_pending=1), data=st.data())
def test_a_pass_planned_ahead_is_cut_to_the_requests_left(case, data):
    """Whatever the tokens, a decode commit leaves a part of the Running planned from it:
    kept_rows names the requests left, and the planned pass narrowed to them is the pass
    scheduled for the committed Running with their slots; the rest hold the others'."""
    run, _ = case
    batch = state.schedule_decode(run, fresh_slots(len(run)))
    sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(run), max_size=len(run)))
    committed = state.decode(batch, sampled).running
    planned = state.assume_decoded(batch)
    keep = state.kept_rows(planned, committed)
    assert keep is not None
    left = ~np.isin(run.rids, state.decode(batch, sampled).effects.finished_rids)
    assert keep.tolist() == np.flatnonzero(left).tolist()
    following = state.schedule_decode(planned, fresh_slots(len(planned)))
    kept = state.narrow(following, keep)
    gone = state.narrow(following, np.flatnonzero(~left))
    assert state.same_layout(kept.running, committed)
    assert kept.new_lens.total == len(committed)
    assert sorted([*kept.out_slots.tolist(), *gone.out_slots.tolist()]) == sorted(
        following.out_slots.tolist()
    )


def test_kept_rows_refuses_anything_but_requests_leaving():
    rules = [Rule(9, 0, -1, ())] * 3
    run = running_of([1, 2, 3], [0, 1, 2], [3, 4, 5], [4, 5, 6], [3, 3, 3], [2, 2, 2], rules, 64)
    assert state.kept_rows(run, run).tolist() == [0, 1, 2]
    assert state.kept_rows(run, run.select([0, 2])).tolist() == [0, 2]
    assert state.kept_rows(run, run.select([2, 0])) is None  # reordered
    assert state.kept_rows(run.select([0, 1]), run) is None  # one came
    longer = state.assume_decoded(state.schedule_decode(run, fresh_slots(3)))
    assert state.kept_rows(run, longer.select([0, 1])) is None  # lengths moved on
    with pytest.raises(ValueError, match="name a request twice"):
        state.narrow(state.schedule_decode(run, fresh_slots(3)), [1, 1])


@fast
@given(case=runnings(max_pending=1))
def test_abandoning_a_pass_that_wrote_early_empties_those_entries(case):
    run, _ = case
    batch = state.schedule_decode(run, fresh_slots(len(run)))
    plain, undo = state.abandon(batch), state.abandon(batch, written=True)
    assert plain.free_slots.tolist() == undo.free_slots.tolist() == batch.out_slots.tolist()
    assert plain.table_rows.size == 0
    early = state.decode_writes(batch)
    assert undo.table_rows.tolist() == early.table_rows.tolist()
    assert undo.table_cols.tolist() == early.table_cols.tolist()
    assert not undo.table_slots.any()  # emptied: the padding slot
    for effects in (plain, undo):  # built unchecked: the checked constructor agrees
        check_trusted(effects)


def test_planning_ahead_refuses_an_extend_pass():
    run = running_of([1], [0], [0], [3], [3], [2], [Rule(5, 0, -1, ())], MAX_CONTEXT)
    batch = state.schedule_extend(run, [3], [1, 2, 2], fresh_slots(3))
    with pytest.raises(ValueError, match="for decode and verify passes"):
        state.assume_decoded(batch)
    with pytest.raises(ValueError, match="for decode passes"):
        state.narrow(batch, [0])
    assert state.writes_whole(batch)


@fast
@given(case=runnings(), chunk_cap=st.integers(1, 8), data=st.data())
def test_an_extend_pass_writes_its_table_entries_early_or_at_its_commit_alike(
    case, chunk_cap, data
):
    """decode_writes of an extend pass is the token-independent part of extend's effects
    (the engine applies it while the pass runs); abandoning the pass empties those entries."""
    run, _ = case
    chunks = np.minimum(run.pending_lens, chunk_cap)
    batch = state.schedule_extend(
        run, chunks, np.arange(chunks.sum()) % VOCAB, fresh_slots(int(chunks.sum()))
    )
    count = int(batch.samples.sum())
    sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count))
    committed = state.extend(batch, sampled).effects
    early = state.decode_writes(batch)
    for name in ("table_rows", "table_cols", "table_slots"):
        assert getattr(early, name).tolist() == getattr(committed, name).tolist()
    assert early.free_slots.size == early.release_rows.size == early.emitted_rids.size == 0
    undo = state.abandon(batch, written=True)
    assert undo.table_rows.tolist() == early.table_rows.tolist()
    assert undo.table_cols.tolist() == early.table_cols.tolist()
    assert not undo.table_slots.any() and undo.free_slots.tolist() == batch.out_slots.tolist()


def test_decode_refuses_an_extend_pass():
    run = running_of([1], [0], [0], [3], [3], [2], [Rule(5, 0, -1, ())], MAX_CONTEXT)
    batch = state.schedule_extend(run, [3], [1, 2, 2], fresh_slots(3))
    with pytest.raises(ValueError, match="decode pass"):
        state.decode(batch, [1])


@st.composite
def verify_cases(draw: st.DrawFn):
    run, rules = draw(runnings(max_pending=1))
    trees = [draw(tree_lists(int(root), max_size=10)) for root in run.last_tokens]
    paths = [path_to(p, draw(st.integers(0, len(p) - 1))) for _, p in trees]
    bonus = draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(run), max_size=len(run)))
    return run, rules, trees, paths, bonus


def verify_inputs(trees, paths):
    draft = DraftTrees.from_lists([t for t, _ in trees], [p for _, p in trees])
    nodes = np.array([n for p in paths for n in p], dtype=np.int64)
    return draft, [len(p) for p in paths], nodes


@fast
@given(case=verify_cases())
def test_verify_commits_the_accepted_path_and_frees_the_rest(case):
    run, rules, trees, paths, bonus = case
    draft, accepted_lens, nodes = verify_inputs(trees, paths)
    slots = fresh_slots(draft.sizes.total)
    batch = state.schedule_verify(run, draft, slots)
    assert batch.mode == (Mode.VERIFY if len(run) else Mode.IDLE)
    assert batch.seq_lens.tolist() == (run.kv_lens.lens + draft.sizes.lens).tolist()
    result = state.verify(batch, accepted_lens, nodes, bonus)
    check_totals(result)
    # the lengths as a SeqLens (a verify walk's outcome) commit the same
    same = state.verify(batch, SeqLens(accepted_lens), nodes, bonus)
    assert same_value(same.effects, result.effects) and same_value(same.running, result.running)
    eff = result.effects
    own = np.split(slots, draft.sizes.indptr()[1:-1]) if len(run) else []
    want_table, want_free = [], []
    for i, ((tokens, _parents), path) in enumerate(zip(trees, paths, strict=True)):
        assert draft.depths[draft.sizes.starts()[i] + np.array(path, dtype=int)].tolist() == list(
            range(1, len(path) + 1)
        )
        kv, row = run.kv_lens[i], int(run.rows[i])
        want_table += [(row, kv + d, int(own[i][n])) for d, n in enumerate([0, *path])]
        want_free += [int(s) for n, s in enumerate(own[i]) if n not in {0, *path}]
        check_emitted(run, rules, i, [tokens[n] for n in path] + [bonus[i]], eff)
    got = list(
        zip(eff.table_rows.tolist(), eff.table_cols.tolist(), eff.table_slots.tolist(), strict=True)
    )
    assert got == want_table
    assert eff.free_slots.tolist() == want_free
    assert len(eff.free_slots) + len(eff.table_slots) == len(slots)
    assert (result.running.pending_lens == 1).all()


@fast
@given(case=verify_cases())
def test_planning_after_a_verify_pass_agrees_with_its_commit(case):
    """A verify pass's early writes are its roots' slots at the committed lengths: part of
    the commit's writes whatever is accepted, but not all of them (`writes_whole`). The
    Running planned from it (`assume_decoded`) has the committed layout exactly when no
    request accepted a draft and none finished; abandoning the pass empties the roots'
    entries and frees every slot of its trees."""
    run, _rules, trees, paths, bonus = case
    draft, accepted_lens, nodes = verify_inputs(trees, paths)
    batch = state.schedule_verify(run, draft, fresh_slots(draft.sizes.total))
    result = state.verify(batch, accepted_lens, nodes, bonus)
    early = state.decode_writes(batch)
    committed = set(
        zip(
            result.effects.table_rows.tolist(),
            result.effects.table_cols.tolist(),
            result.effects.table_slots.tolist(),
            strict=True,
        )
    )
    roots = list(
        zip(
            early.table_rows.tolist(),
            early.table_cols.tolist(),
            early.table_slots.tolist(),
            strict=True,
        )
    )
    assert roots == [
        (int(row), int(kv), int(batch.out_slots[start]))
        for row, kv, start in zip(run.rows, run.kv_lens.lens, draft.sizes.starts(), strict=True)
    ]
    assert committed.issuperset(roots)
    assert early.free_slots.size == early.release_rows.size == early.emitted_rids.size == 0
    assert state.writes_whole(batch) == (batch.mode != Mode.VERIFY)
    planned = state.assume_decoded(batch)
    assert planned.kv_lens.tolist() == (run.kv_lens.lens + 1).tolist()
    assert planned.token_lens.tolist() == (run.token_lens.lens + 1).tolist()
    nothing_accepted = not any(accepted_lens)
    nobody_left = result.effects.finished_rids.size == 0
    assert state.same_layout(planned, result.running) == (nothing_accepted and nobody_left)
    # moved on by the accepted drafts (a walk on the device found them): the commit's
    # layout wherever nobody finished; the requests left kept theirs where some did
    if batch.mode == Mode.VERIFY:  # (roots alone make a decode pass)
        moved = state.assume_decoded(batch, np.asarray(accepted_lens))
        assert state.same_layout(moved, result.running) == nobody_left
        left = set(result.running.rids.tolist())
        keep = state.kept_rows(moved, result.running)
        assert keep is not None
        assert keep.tolist() == [i for i, rid in enumerate(run.rids.tolist()) if rid in left]
    undo = state.abandon(batch, written=True)
    assert undo.table_rows.tolist() == early.table_rows.tolist()
    assert undo.table_cols.tolist() == early.table_cols.tolist()
    assert not undo.table_slots.any() and undo.free_slots.tolist() == batch.out_slots.tolist()
    check_trusted(undo)


def test_a_stop_id_inside_the_accepted_path_ends_the_request_there():
    run = running_of([7], [0], [4], [5], [3], [1], [Rule(20, 0, -1, (6,))], MAX_CONTEXT)
    draft = DraftTrees.from_lists([[1, 2, 6, 3]], [[-1, 0, 1, 2]])
    batch = state.schedule_verify(run, draft, fresh_slots(4))
    result = state.verify(batch, [3], [1, 2, 3], [4])
    assert result.effects.emitted() == {7: [2, 6]}
    assert result.effects.finished() == {7: FinishReason.STOP}
    assert result.effects.release_lens.tolist() == [8]  # all path KV goes with the request
    assert len(result.running) == 0


BAD_PATHS = [  # (accepted_lens, nodes, what the message says)
    ([1], [2], "path from the root"),  # node 2's parent is 1, not the root
    ([2], [1, 3], "path from the root"),  # 3 is a child of the root, not of 1
    ([1], [0], "path from the root"),  # the root cannot be accepted as a draft
    ([1], [4], "outside"),
    ([1], [-1], "outside"),  # a negative id used to wrap into another tree
    ([2], [1], "accepted"),  # counts disagree
]


@pytest.mark.parametrize("accepted_lens, nodes, message", BAD_PATHS)
def test_verify_rejects_paths_that_are_not_root_paths(accepted_lens, nodes, message):
    rules = [Rule(20, 0, -1, ())] * 2
    run = running_of([1, 2], [0, 1], [4, 4], [5, 5], [3, 3], [1, 5], rules, MAX_CONTEXT)
    draft = DraftTrees.from_lists([[1, 2, 3, 4], [5, 6, 7]], [[-1, 0, 1, 0], [-1, 0, 0]])
    batch = state.schedule_verify(run, draft, fresh_slots(7))
    with pytest.raises(ValueError, match=message):
        state.verify(batch, [*accepted_lens, 0], nodes, [0, 0])


@fast
@given(trees=st.lists(tree_lists(0, max_size=20), min_size=1, max_size=4))
def test_draft_tree_depths_and_ancestor_bits_follow_the_parents(trees):
    draft = DraftTrees.from_lists([t for t, _ in trees], [p for _, p in trees])
    want_depths, want_bits = [], []
    for _, parents in trees:
        for node in range(len(parents)):
            path = [0, *path_to(parents, node)]
            want_depths.append(len(path) - 1)
            want_bits.append(sum(1 << n for n in path))
    assert draft.depths.tolist() == want_depths
    assert draft.ancestor_bits.tolist() == want_bits


def test_a_chain_of_63_nodes_has_every_ancestor_bit():
    chain = DraftTrees.from_lists([list(range(63))], [list(range(-1, 62))])
    assert chain.depths.tolist() == list(range(63))
    assert chain.ancestor_bits.tolist() == [(1 << (n + 1)) - 1 for n in range(63)]


def test_verify_needs_trees_rooted_at_the_pending_tokens():
    run = running_of([1], [0], [4], [5], [3], [1], [Rule(20, 0, -1, ())], MAX_CONTEXT)
    with pytest.raises(ValueError, match="root"):
        state.schedule_verify(run, DraftTrees.from_lists([[2, 3]], [[-1, 0]]), fresh_slots(2))
    with pytest.raises(ValueError, match="tokens and"):
        DraftTrees.from_lists([[1, 2], [1, 3]], [[-1], [-1, 0, 0]])


@fast
@given(case=runnings(), data=st.data())
def test_retract_finish_abort_release_every_slot(case, data):
    run, _ = case
    indices = data.draw(
        st.lists(st.integers(0, max(len(run) - 1, 0)), max_size=len(run), unique=True)
    )
    reason = data.draw(
        st.sampled_from([None, FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT])
    )
    result = (
        state.retract(run, indices)
        if reason is None
        else state.abort(run, indices)
        if reason == FinishReason.ABORT
        else state.finish(run, indices, reason)
    )
    gone = sorted(indices)
    check_totals(result)
    eff = result.effects
    assert eff.release_rows.tolist() == run.rows[gone].tolist()
    assert eff.release_lens.tolist() == run.kv_lens.lens[gone].tolist()
    left = [i for i in range(len(run)) if i not in indices]
    assert result.running.rids.tolist() == run.rids[left].tolist()
    assert result.running.kv_lens.total == int(run.kv_lens.lens[left].sum())
    if reason is None:
        assert eff.retracted_rids.tolist() == run.rids[gone].tolist() and not eff.finished()
    else:
        assert eff.finished() == dict.fromkeys(run.rids[gone].tolist(), reason)
    assert eff.emitted() == {}


def test_leaving_needs_a_reason_and_valid_distinct_indices():
    run = running_of(
        [1, 2], [0, 1], [2, 2], [3, 3], [3, 3], [1, 1], [Rule(5, 0, -1, ())] * 2, MAX_CONTEXT
    )
    with pytest.raises(ValueError, match="needs a reason"):
        state.finish(run, [0], FinishReason.NONE)
    with pytest.raises(IndexError, match="out of range"):
        state.retract(run, [2])
    with pytest.raises(ValueError, match="twice"):
        state.abort(run, [1, 1])


@fast
@given(first=runnings(), second=runnings(), data=st.data())
def test_filter_and_merge_keep_lengths_and_sums_exact(first, second, data):
    a, _ = first
    b = second[0].select(np.arange(len(second[0])))
    b = Running(
        b.rids + 100,
        b.rows + 100,
        b.kv_lens,
        b.token_lens,
        b.prompt_lens,
        b.last_tokens,
        b.rules,
        b.max_context,
    )
    merged = state.merge(a, b)
    assert merged.kv_lens.tolist() == a.kv_lens.tolist() + b.kv_lens.tolist()
    assert merged.token_lens.total == a.token_lens.total + b.token_lens.total
    assert merged.rules.stop_ids.shape[1] == max(
        a.rules.stop_ids.shape[1], b.rules.stop_ids.shape[1]
    )
    keep = data.draw(st.lists(st.integers(0, len(merged) - 1), unique=True)) if len(merged) else []
    kept = merged.select(keep)
    assert kept.rids.tolist() == merged.rids[np.array(keep, dtype=int)].tolist()
    assert kept.kv_lens.total == sum(merged.kv_lens.tolist()[k] for k in keep)
    if len(a):
        with pytest.raises(ValueError, match="share a request"):
            state.merge(a, a)


def test_negative_token_ids_are_rejected_where_they_enter():
    """An ignored EOS is -1, so the finish check relies on token ids being >= 0."""
    import pytest

    from engine.state import DraftTrees

    with pytest.raises(ValueError, match=">= 0"):
        DraftTrees.from_lists([[5, -1]], [[-1, 0]])


def test_one_token_each_is_no_decode_where_a_request_has_nothing_pending():
    """Two requests, pending 2 and 0: one new token each adds up to the two pending tokens,
    but the second has none to compute. It was taken for a decode pass (its seq_lens were
    the token lengths, no longer prefix + new per request)."""
    rules = state.FinishRules(
        np.full(2, 100), np.zeros(2), -np.ones(2), np.zeros((2, 0), dtype=np.int64)
    )
    run = Running.admitted(
        np.array([1, 2]),
        np.array([0, 1]),
        np.array([5, 5]),
        np.array([5, 5]),
        np.array([7, 7]),
        rules,
        64,
        kv_lens=np.array([3, 5]),
    )
    assert run.pending_lens.tolist() == [2, 0]
    with pytest.raises(ValueError, match="exceed the pending tokens"):
        state.schedule_extend(run, np.array([1, 1]), np.zeros(2), fresh_slots(2))
