"""Pure transitions: (snapshot, inputs) -> Result(snapshot', effects).

Inputs are data (sampled tokens, accepted paths, slots handed out by the allocator); effects
are data that the shell applies to the KV pool and the request table. Nothing here touches a
pool. Every length that changes is a `SeqLens`, so its total changes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.state.batch import Batch, DraftTrees, Mode
from engine.state.debug import DEBUG
from engine.state.effects import Effects, Result
from engine.state.finish import FinishReason, first_finish_flat, no_finish
from engine.state.running import Running
from engine.state.seqlens import INDEX_DTYPE, SeqLens, freeze, frozen_array, has_duplicates

_EMPTY = frozen_array([])


# --- scheduling: Running + inputs -> the Batch of one forward pass ---------------------------
def schedule_extend(
    running: Running,
    chunk_lens: Sequence[int] | np.ndarray,
    input_ids: Sequence[int] | np.ndarray,
    slots: np.ndarray,
    score_rows: np.ndarray | None = None,
) -> Batch:
    """The next chunk of each request's pending tokens (a whole prompt, or part of it);
    `score_rows`: new tokens whose logits the pass returns too (`Batch.score_rows`)."""
    return Batch(running, SeqLens(chunk_lens), input_ids, slots, score_rows=score_rows)


def schedule_decode(running: Running, slots: np.ndarray) -> Batch:
    """One token per request: its pending (last known) token."""
    return Batch(running, SeqLens.full(len(running), 1), running.last_tokens, slots)


def schedule_verify(running: Running, trees: DraftTrees, slots: np.ndarray) -> Batch:
    """Each request's draft tree, rooted at its pending token."""
    if len(trees.sizes) != len(running):
        raise ValueError(f"{len(trees.sizes)} draft trees for {len(running)} requests")
    roots = trees.tokens[trees.sizes.starts()]
    if not np.array_equal(roots, running.last_tokens):
        raise ValueError("each draft tree's root must be its request's pending token")
    return Batch(running, trees.sizes, trees.tokens, slots, trees)


# --- after the forward pass ----------------------------------------------------------------
def _sampled(tokens: object, count: int, what: str) -> np.ndarray:
    array = np.asarray(tokens, dtype=INDEX_DTYPE).reshape(-1)
    if array.shape[0] != count:
        raise ValueError(f"{count} requests {what} this pass; got {array.shape[0]} tokens")
    if DEBUG and array.size and int(array.min()) < 0:
        raise ValueError(f"token ids must be >= 0; got {array.tolist()[:16]}")
    return array


def extend(batch: Batch, sampled: np.ndarray) -> Result:
    """Commit an extend (or decode) pass. `sampled` holds one token per sampling request."""
    if batch.trees is not None:
        raise ValueError("a verify pass is committed with verify(), not extend()")
    samples = batch.samples
    counts = SeqLens.of_valid(freeze(samples.astype(INDEX_DTYPE)))
    sampled = freeze(_sampled(sampled, counts.total, "sample").copy())
    return _commit(batch.running, batch.seq_lens, sampled, counts, _extend_table(batch), _EMPTY)


def _extend_table(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An extend pass's table writes (rows, columns, slots): each new token's slot at its
    position in its request's row. One definition for the commit and for `decode_writes`."""
    rows = freeze(np.repeat(batch.running.rows, batch.new_lens.lens))
    return rows, batch.positions, batch.out_slots


def decode(batch: Batch, sampled: np.ndarray) -> Result:
    """Commit a decode pass: every request gains its sampled token."""
    if batch.mode not in (Mode.DECODE, Mode.IDLE):
        raise ValueError(f"decode() commits a decode pass; this pass is {batch.mode.value}")
    run = batch.running
    sampled = freeze(_sampled(sampled, len(run), "decode").copy())
    return _commit(run, batch.seq_lens, sampled, batch.new_lens, _decode_table(batch), _EMPTY)


def _decode_table(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decode pass's table writes (rows, columns, slots): each request's new slot at its
    committed length. One definition for the commit and for `decode_writes`."""
    return batch.running.rows, batch.running.kv_lens.lens, batch.out_slots


def _root_table(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A verify pass's table writes that every outcome makes (rows, columns, slots): each
    tree's root (the request's pending token) at its committed length. `verify` writes them
    with the accepted path; `decode_writes` alone."""
    trees = batch.trees
    assert trees is not None
    run = batch.running
    return run.rows, run.kv_lens.lens, freeze(batch.out_slots[trees.sizes.starts()])


def decode_writes(batch: Batch) -> Effects:
    """The part of a pass's commit effects that does not depend on its tokens: for a decode
    or extend pass (`decode`, `extend`), each new token's slot written at its position in its
    request's row; for a verify pass (`verify`), each root's slot at its committed length
    (the accepted drafts' slots are the walk's to choose). The engine applies it while the
    pass still runs: for a decode or verify pass, so the next decode pass can be planned
    meanwhile (`assume_decoded`); for an extend pass, so the host does it while the device
    computes. Applying the full effects after it rewrites the same entries; for a decode or
    extend pass these are all of them (`writes_whole`), so the commit may skip them."""
    if batch.mode == Mode.EXTEND:
        rows, cols, slots = _extend_table(batch)
    elif batch.mode in (Mode.DECODE, Mode.IDLE):
        rows, cols, slots = _decode_table(batch)
    else:
        rows, cols, slots = _root_table(batch)
    return Effects.of_valid(table_rows=rows, table_cols=cols, table_slots=slots)


def writes_whole(batch: Batch) -> bool:
    """Whether `decode_writes(batch)` are all the table writes its commit makes (decode and
    extend passes), so that a commit after them need not write the table again; a verify
    pass's commit writes its accepted paths too."""
    return batch.mode != Mode.VERIFY


def assume_decoded(batch: Batch, accepted: np.ndarray | None = None) -> Running:
    """The Running a decode pass, or a verify pass in which no draft is accepted, leads to if
    no request finishes, with each request's pending token not known yet (its old one stands
    in). Only its lengths, rows and order are used: to plan the next decode pass while this
    one runs. The engine uses that plan only if the committed Running has the same requests,
    rows and lengths (`same_layout`): after a verify pass, only where every request kept its
    root alone. `accepted` (a verify pass only): per request the drafts accepted, which the
    device found before the host's walk (a pass launched on them is laid out for this
    Running once the host knows them)."""
    run = batch.running
    if accepted is not None and batch.mode != Mode.VERIFY:
        raise ValueError(
            f"assume_decoded() takes accepted drafts after a verify pass; this pass is "
            f"{batch.mode.value}"
        )
    if batch.mode == Mode.VERIFY:  # each request one token further (its root's), or more
        grown: int | np.ndarray = 1
        if accepted is not None:
            grown = _accepted_counts(batch, accepted) + 1
        kv_lens, token_lens = run.kv_lens.grow(grown), run.token_lens.grow(grown)
    elif batch.mode in (Mode.DECODE, Mode.IDLE):
        kv_lens, token_lens = batch.seq_lens, run.token_lens + batch.new_lens
    else:
        raise ValueError(
            f"assume_decoded() is for decode and verify passes; this pass is {batch.mode.value}"
        )
    return Running.of_valid(
        run.rids,
        run.rows,
        kv_lens,
        token_lens,
        run.prompt_lens,
        run.last_tokens,
        run.rules,
        run.max_context,
        run.shared_lens,
    )


def _accepted_counts(batch: Batch, accepted: np.ndarray) -> np.ndarray:
    """`accepted` checked against verify pass `batch`: one count a request, each at least 0
    and below its tree's size."""
    counts = np.asarray(accepted, dtype=INDEX_DTYPE).reshape(-1)
    trees = batch.trees
    assert trees is not None
    if counts.shape[0] != len(batch.running):
        raise ValueError(
            f"{counts.shape[0]} accepted counts for the {len(batch.running)} requests of the "
            "verify pass"
        )
    if ((counts < 0) | (counts >= trees.sizes.lens)).any():
        raise ValueError(
            f"accepted counts {counts.tolist()[:16]} must lie in 0..tree size - 1 "
            f"(sizes {trees.sizes.lens.tolist()[:16]})"
        )
    return counts


def same_layout(first: Running, second: Running) -> bool:
    """Same requests in the same order, on the same rows, with the same committed lengths:
    a pass planned for one serves the other (only the pending tokens may differ)."""
    return first is second or (
        len(first) == len(second)
        and _same_column(first.rids, second.rids)
        and _same_column(first.rows, second.rows)
        and _same_column(first.kv_lens.lens, second.kv_lens.lens)
    )


def _same_column(first: np.ndarray, second: np.ndarray) -> bool:
    """Equal columns: most often the same read-only array, which a transition passes on
    unchanged (a decode pass's committed lengths are the planned ones), so that is checked
    first; the engine asks this a few times a step."""
    return first is second or np.array_equal(first, second)


def kept_rows(planned: Running, committed: Running) -> np.ndarray | None:
    """The indices in `planned` of `committed`'s requests, where `committed` is `planned` with
    some requests gone and nothing else changed (the rest in the same order, on the same rows,
    with the same committed lengths; `same_layout` when none is gone); None otherwise. A pass
    planned for `planned` serves `committed` once cut to those rows (`narrow`)."""
    keep = np.flatnonzero(np.isin(planned.rids, committed.rids))
    if keep.size != len(committed) or not same_layout(planned.select(keep), committed):
        return None
    return keep


def narrow(batch: Batch, indices: Sequence[int] | np.ndarray) -> Batch:
    """Decode pass `batch` with only the requests at `indices` (in that order), each with the
    slot it was given: a pass launched before some of its requests left serves the rest, and
    the part of those that left is abandoned (`abandon`)."""
    if batch.mode not in (Mode.DECODE, Mode.IDLE):
        raise ValueError(f"narrow() is for decode passes; this pass is {batch.mode.value}")
    idx = _distinct(indices, len(batch.running))
    running = batch.running.select(idx)
    return Batch(running, SeqLens.full(idx.size, 1), batch.input_ids[idx], batch.out_slots[idx])


def verify(
    batch: Batch,
    accepted_lens: SeqLens | Sequence[int] | np.ndarray,
    accepted_nodes: np.ndarray,
    bonus: np.ndarray,
) -> Result:
    """Commit a verify pass: per request the accepted path (local node ids below the root,
    root to leaf, CSR by `accepted_lens`) and the bonus token the target chose after it."""
    trees = batch.trees
    if trees is None:
        raise ValueError("verify() needs a verify pass (a batch with draft trees)")
    run = batch.running
    # a SeqLens (a verify walk's outcome) is checked already: no copy of its lengths
    accepted = accepted_lens if isinstance(accepted_lens, SeqLens) else SeqLens(accepted_lens)
    nodes = np.asarray(accepted_nodes, dtype=INDEX_DTYPE).reshape(-1)
    bonus = np.asarray(bonus, dtype=INDEX_DTYPE).reshape(-1)
    if bonus.size and int(bonus.min()) < 0:
        raise ValueError(f"bonus tokens must be token ids >= 0; got {bonus.tolist()[:16]}")
    if len(accepted) != len(run) or nodes.shape[0] != accepted.total or bonus.shape[0] != len(run):
        raise ValueError(
            f"verify needs {len(run)} accepted lengths and bonus tokens and "
            f"accepted_lens.total nodes; got {len(accepted)}, {bonus.shape[0]}, "
            f"{nodes.shape[0]}"
        )
    # The path of request i: its root, then its accepted nodes (flat, CSR by path_lens).
    path_lens = accepted.grow(1)
    path_indptr = path_lens.indptr()
    path_owner = path_lens.segment_ids()
    depth = np.arange(path_lens.total, dtype=INDEX_DTYPE) - path_indptr[path_owner]
    is_draft = depth > 0
    path_local = np.zeros(path_lens.total, dtype=INDEX_DTYPE)
    path_local[is_draft] = nodes
    if ((nodes < 0) | (nodes >= trees.sizes.lens[path_owner[is_draft]])).any():
        raise ValueError("an accepted node is outside its request's draft tree")
    path_flat = trees.sizes.starts()[path_owner] + path_local
    draft_flat = path_flat[is_draft]
    if (trees.parents[draft_flat] != path_local[:-1][is_draft[1:]]).any():
        raise ValueError(
            "accepted nodes must form a path from the root, each the child of the last"
        )
    rejected = np.ones(trees.sizes.total, dtype=bool)
    rejected[path_flat] = False
    # Emitted: each accepted draft's token, then the bonus token (one per path entry).
    emitted = np.empty(path_lens.total, dtype=INDEX_DTYPE)
    emitted[:-1] = trees.tokens[path_flat[1:]]
    emitted[path_indptr[1:] - 1] = bonus
    table = (
        freeze(run.rows[path_owner]),
        freeze(run.kv_lens.lens[path_owner] + depth),
        freeze(batch.out_slots[path_flat]),
    )
    return _commit(
        run,
        run.kv_lens + path_lens,
        freeze(emitted),
        path_lens,
        table,
        freeze(batch.out_slots[rejected]),
        path_owner,
        depth,
    )


def _commit(
    run: Running,
    kv_lens: SeqLens,
    tokens: np.ndarray,
    counts: SeqLens,
    table: tuple[np.ndarray, np.ndarray, np.ndarray],
    free_slots: np.ndarray,
    owner: np.ndarray | None = None,
    depth: np.ndarray | None = None,
) -> Result:
    """Append the tokens each request emits (flat `tokens`, CSR by `counts`; `owner`/`depth`
    when the caller has them), apply the finish check, and drop finished requests."""
    kept, reason = first_finish_flat(
        tokens,
        counts,
        run.num_output,
        run.token_lens.lens,
        run.rules,
        run.max_context,
        owner,
        None if depth is None else depth + 1,
    )
    if kept is not counts.lens:  # a request stopped inside its tokens: keep its prefix only
        owner = counts.segment_ids() if owner is None else owner
        depth = counts.offsets_within() if depth is None else depth
        tokens = freeze(tokens[depth < kept[owner]])
        counts = SeqLens.of_valid(freeze(kept))
    if counts.total == len(run) and counts.max == 1:  # one token each (decode): no gathers
        last_tokens, emitted_rids, emitted_lens = tokens, run.rids, counts
    else:
        has_new = counts.lens > 0
        ends = counts.indptr()[1:] - 1
        if has_new.all():
            last_tokens, emitted_rids, emitted_lens = freeze(tokens[ends]), run.rids, counts
        else:
            ended = tokens[np.maximum(ends, 0)] if tokens.size else 0
            last_tokens = freeze(np.where(has_new, ended, run.last_tokens))
            emitted_rids, emitted_lens = freeze(run.rids[has_new]), counts.select(has_new)
    emitted: dict[str, np.ndarray | SeqLens] = dict(
        table_rows=table[0],
        table_cols=table[1],
        table_slots=table[2],
        free_slots=free_slots,
        emitted_rids=emitted_rids,
        emitted_lens=emitted_lens,
        emitted_tokens=tokens,
    )
    return _close(run, reason, kv_lens, run.token_lens + counts, last_tokens, emitted)


def _close(
    run: Running,
    reason: np.ndarray,
    kv_lens: SeqLens,
    token_lens: SeqLens,
    last_tokens: np.ndarray,
    emitted: dict[str, np.ndarray | SeqLens],
) -> Result:
    """The next Running (finished requests dropped) and the effects: what was emitted, and
    the rows of finished requests released with everything committed to them."""
    if reason is no_finish(len(run)) or not reason.any():  # NONE is 0: nobody leaves
        after = Running.of_valid(
            run.rids,
            run.rows,
            kv_lens,
            token_lens,
            run.prompt_lens,
            last_tokens,
            run.rules,
            run.max_context,
            run.shared_lens,
        )
        return Result(after, Effects.of_valid(**emitted))
    done = reason != FinishReason.NONE
    live = np.flatnonzero(~done)
    after = Running(
        run.rids[live],
        run.rows[live],
        kv_lens.select(live),
        token_lens.select(live),
        run.prompt_lens[live],
        last_tokens[live],
        run.rules.select(live),
        run.max_context,
        run.shared_lens[live],
    )
    # A finished request keeps no KV: its row is released with everything committed to it.
    effects = Effects.of_valid(
        release_rows=freeze(run.rows[done]),
        release_lens=kv_lens.select(done),
        release_rids=freeze(run.rids[done]),
        release_shared=freeze(run.shared_lens[done]),
        release_cached=freeze(np.ones(int(done.sum()), dtype=bool)),
        finished_rids=freeze(run.rids[done]),
        finished_reasons=freeze(reason[done].astype(INDEX_DTYPE)),
        **emitted,
    )
    return Result(after, effects)


# --- requests leaving ------------------------------------------------------------------------
def _distinct(indices: Sequence[int] | np.ndarray, size: int) -> np.ndarray:
    """`indices` into a batch of `size` requests, each in range and named once."""
    idx = np.asarray(indices, dtype=INDEX_DTYPE).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise IndexError(f"indices {idx.tolist()} out of range for a batch of {size}")
    if has_duplicates(idx):
        raise ValueError(f"indices {idx.tolist()} name a request twice")
    return idx


def _leave(running: Running, indices: Sequence[int] | np.ndarray) -> tuple[Running, np.ndarray]:
    mask = np.zeros(len(running), dtype=bool)
    mask[_distinct(indices, len(running))] = True
    return running.select(~mask), mask


def retract(running: Running, indices: Sequence[int] | np.ndarray) -> Result:
    """Requests leave under memory pressure: their committed tokens go to the prefix cache
    (with it on; evictable, since nobody locks them) or their slots are freed; they wait, and
    match their prefix again when they come back."""
    rest, gone = _leave(running, indices)
    effects = Effects(retracted_rids=running.rids[gone], **_releases(running, gone, cached=True))
    return Result(rest, effects)


def _releases(running: Running, gone: np.ndarray, cached: bool) -> dict[str, Any]:
    """The release columns for the requests of `running` at mask `gone`."""
    return dict(
        release_rows=running.rows[gone],
        release_lens=running.kv_lens.select(gone),
        release_rids=running.rids[gone],
        release_shared=running.shared_lens[gone],
        release_cached=np.full(int(gone.sum()), cached),
    )


def finish(running: Running, indices: Sequence[int] | np.ndarray, reason: FinishReason) -> Result:
    """Requests leave with `reason` (a stop string matched, an abort, an error); each row is
    released (`Effects`, step 4)."""
    if reason == FinishReason.NONE:
        raise ValueError("finish() needs a reason: STOP, LENGTH, ABORT or ERROR")
    rest, gone = _leave(running, indices)
    rids = running.rids[gone]
    # A failed request's KV is not trusted for reuse; every other end caches what it committed.
    effects = Effects(
        **_releases(running, gone, cached=reason != FinishReason.ERROR),
        finished_rids=rids,
        finished_reasons=np.full(rids.shape[0], int(reason), dtype=np.int8),
    )
    return Result(rest, effects)


def abort(running: Running, indices: Sequence[int] | np.ndarray) -> Result:
    """`finish(running, indices, FinishReason.ABORT)`: the client went away."""
    return finish(running, indices, FinishReason.ABORT)


def abandon(batch: Batch, written: bool = False) -> Effects:
    """A pass that will not be committed (its forward failed, or a plan made ahead is not
    used): free the slots it was given. `written`: the pass's `decode_writes` may have been
    applied already (while it ran); those table entries, past each request's committed
    length, are emptied again."""
    # the batch's own read-only columns, and a zeroed copy frozen here: no checks to repeat
    if not written:
        return Effects.of_valid(free_slots=batch.out_slots)
    writes = decode_writes(batch)
    return Effects.of_valid(
        table_rows=writes.table_rows,
        table_cols=writes.table_cols,
        table_slots=freeze(np.zeros_like(writes.table_slots)),
        free_slots=batch.out_slots,
    )


def merge(first: Running, second: Running) -> Running:
    """`first` followed by `second` (`Running.merge`): a pass's requests rejoin the others."""
    return first.merge(second)


# --- the prefix cache ---------------------------------------------------------------------
def admit(running: Running, entering: Running, prefix_slots: np.ndarray) -> Result:
    """`entering` requests join `running`. Each starts with the cached prefix it matched
    (`entering.shared_lens` tokens, whose slots, flat in batch order, are `prefix_slots`,
    locked for it by the shell when it matched): they are written at the start of its row."""
    if not np.array_equal(entering.shared_lens, entering.kv_lens.lens):
        raise ValueError("an entering request's committed KV is its shared prefix, no more")
    slots = frozen_array(prefix_slots)
    prefix = entering.kv_lens
    if slots.shape[0] != prefix.total:
        raise ValueError(f"{prefix.total} prefix tokens need as many slots; got {slots.shape[0]}")
    effects = Effects(
        table_rows=np.repeat(entering.rows, prefix.lens),
        table_cols=prefix.offsets_within(),
        table_slots=slots,
    )
    return Result(running.merge(entering), effects)


def share(running: Running, indices: Sequence[int] | np.ndarray) -> Result:
    """The requests at `indices` hand their committed KV so far to the prefix cache (a prompt
    prefilled in chunks: later requests can match it before this one finishes). They keep it
    locked: their shared length becomes their committed length."""
    idx = np.asarray(indices, dtype=INDEX_DTYPE).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= len(running)):
        raise IndexError(f"indices {idx.tolist()} out of range for a batch of {len(running)}")
    if has_duplicates(idx):
        raise ValueError(f"indices {idx.tolist()} name a request twice")
    shared = running.shared_lens.copy()
    shared[idx] = running.kv_lens.lens[idx]
    after = Running.of_valid(
        running.rids,
        running.rows,
        running.kv_lens,
        running.token_lens,
        running.prompt_lens,
        running.last_tokens,
        running.rules,
        running.max_context,
        freeze(shared),
    )
    effects = Effects(
        share_rids=running.rids[idx],
        share_rows=running.rows[idx],
        share_lens=running.kv_lens.select(idx),
    )
    return Result(after, effects)
