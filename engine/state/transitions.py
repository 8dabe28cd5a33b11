"""Pure transitions: (snapshot, inputs) -> Result(snapshot', effects).

Inputs are data (sampled tokens, accepted paths, slots handed out by the allocator); effects
are data that the shell applies to the KV pool and the request table. Nothing here touches a
pool. Every length that changes is a `SeqLens`, so its total changes with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from engine.state.batch import Batch, DraftTrees, Mode
from engine.state.finish import FinishReason, first_finish
from engine.state.running import Running
from engine.state.seqlens import INDEX_DTYPE, SeqLens, frozen_array

_EMPTY = frozen_array([])


@attrs.frozen(eq=False)
class Effects:
    """What the shell must do after a transition, in this order:

    1. write `table_slots` into the request table at (`table_rows`, `table_cols`);
    2. free `free_slots` (slots that never entered the table: rejected drafts);
    3. for each released row, free its first `release_lens` table slots and release the row.
    `emitted_*` are the tokens each request gained (CSR over `emitted_rids`);
    `finished_*` the requests that left with a reason; `retracted_rids` those sent back to wait.
    """

    table_rows: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    table_cols: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    table_slots: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    free_slots: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    release_rows: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    release_lens: SeqLens = attrs.field(factory=SeqLens.empty)
    emitted_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    emitted_lens: SeqLens = attrs.field(factory=SeqLens.empty)
    emitted_tokens: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    finished_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    finished_reasons: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)
    retracted_rids: np.ndarray = attrs.field(default=_EMPTY, converter=frozen_array)

    def __attrs_post_init__(self) -> None:
        if not (self.table_rows.shape == self.table_cols.shape == self.table_slots.shape):
            raise ValueError("table writes need one row, column and slot each")
        if self.release_rows.shape[0] != len(self.release_lens):
            raise ValueError("each released row needs its length")
        if self.emitted_tokens.shape[0] != self.emitted_lens.total:
            raise ValueError("emitted tokens must match emitted_lens.total")
        if self.finished_rids.shape != self.finished_reasons.shape:
            raise ValueError("each finished request needs a reason")

    def emitted(self) -> dict[int, list[int]]:
        """rid -> tokens gained (for the shell's per-request histories)."""
        splits = np.split(self.emitted_tokens, self.emitted_lens.indptr()[1:-1])
        return {int(r): s.tolist() for r, s in zip(self.emitted_rids, splits, strict=True)}

    def finished(self) -> dict[int, FinishReason]:
        return {int(r): FinishReason(int(c))
                for r, c in zip(self.finished_rids, self.finished_reasons, strict=True)}


@attrs.frozen(eq=False)
class Result:
    running: Running
    effects: Effects


# --- scheduling: Running + inputs -> the Batch of one forward pass ---------------------------
def schedule_extend(running: Running, chunk_lens: Sequence[int] | np.ndarray,
                    input_ids: np.ndarray, slots: np.ndarray) -> Batch:
    """The next chunk of each request's pending tokens (a whole prompt, or part of it)."""
    return Batch(running, SeqLens(chunk_lens), input_ids, slots)


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
def extend(batch: Batch, sampled: np.ndarray) -> Result:
    """Commit an extend (or decode) pass. `sampled` holds one token per sampling request."""
    if batch.trees is not None:
        raise ValueError("a verify pass is committed with verify(), not extend()")
    samples = batch.samples
    sampled = np.asarray(sampled, dtype=INDEX_DTYPE).reshape(-1)
    if sampled.shape[0] != int(samples.sum()):
        raise ValueError(f"{int(samples.sum())} requests sample this pass; "
                         f"got {sampled.shape[0]} tokens")
    run = batch.running
    rows = np.repeat(run.rows, batch.new_lens.lens)
    kv_lens = batch.seq_lens
    emit_counts = samples.astype(INDEX_DTYPE)
    tokens = np.zeros((len(run), 1), dtype=INDEX_DTYPE)
    tokens[samples, 0] = sampled
    return _commit(batch, kv_lens, emit_counts, tokens, rows, batch.positions, batch.out_slots,
                   _EMPTY)


def decode(batch: Batch, sampled: np.ndarray) -> Result:
    """Commit a decode pass: every request gains its sampled token."""
    if batch.mode not in (Mode.DECODE, Mode.IDLE):
        raise ValueError(f"decode() commits a decode pass; this pass is {batch.mode.value}")
    return extend(batch, sampled)


def verify(batch: Batch, accepted_lens: Sequence[int] | np.ndarray, accepted_nodes: np.ndarray,
           bonus: np.ndarray) -> Result:
    """Commit a verify pass: per request the accepted path (local node ids below the root,
    root to leaf, CSR by `accepted_lens`) and the bonus token the target chose after it."""
    trees = batch.trees
    if trees is None:
        raise ValueError("verify() needs a verify pass (a batch with draft trees)")
    run = batch.running
    accepted = SeqLens(accepted_lens)
    nodes = np.asarray(accepted_nodes, dtype=INDEX_DTYPE).reshape(-1)
    bonus = np.asarray(bonus, dtype=INDEX_DTYPE).reshape(-1)
    if len(accepted) != len(run) or nodes.shape[0] != accepted.total or bonus.shape[0] != len(run):
        raise ValueError(f"verify needs {len(run)} accepted lengths and bonus tokens and "
                         f"accepted_lens.total nodes; got {len(accepted)}, {bonus.shape[0]}, "
                         f"{nodes.shape[0]}")
    path_lens = accepted.grow(1)  # root + accepted drafts
    path_owner = path_lens.segment_ids()
    depth = path_lens.offsets_within()
    path_local = np.zeros(path_lens.total, dtype=INDEX_DTYPE)
    path_local[depth > 0] = nodes
    tree_start = trees.sizes.starts()[path_owner]
    if (path_local >= trees.sizes.lens[path_owner]).any():
        raise ValueError("an accepted node is outside its request's draft tree")
    path_flat = tree_start + path_local
    parent_ok = trees.parents[path_flat[depth > 0]] == path_local[np.flatnonzero(depth > 0) - 1]
    if not parent_ok.all():
        raise ValueError("accepted nodes must form a path from the root, each the child of the last")
    on_path = np.zeros(trees.sizes.total, dtype=bool)
    on_path[path_flat] = True
    kv_lens = run.kv_lens + path_lens
    width = accepted.max + 1
    tokens = np.zeros((len(run), width), dtype=INDEX_DTYPE)
    draft_depth = depth[depth > 0]
    tokens[path_owner[depth > 0], draft_depth - 1] = trees.tokens[path_flat[depth > 0]]
    tokens[np.arange(len(run)), accepted.lens] = bonus
    return _commit(batch, kv_lens, path_lens.lens, tokens, run.rows[path_owner],
                   run.kv_lens.lens[path_owner] + depth, batch.out_slots[path_flat],
                   batch.out_slots[~on_path])


def _commit(batch: Batch, kv_lens: SeqLens, emit_counts: np.ndarray, tokens: np.ndarray,
            table_rows: np.ndarray, table_cols: np.ndarray, table_slots: np.ndarray,
            free_slots: np.ndarray) -> Result:
    """Append the emitted tokens, apply the finish check, and drop finished requests."""
    run = batch.running
    width = tokens.shape[1]
    valid = np.arange(width)[None, :] < emit_counts[:, None]
    kept, reason = first_finish(tokens, valid, run.num_output, run.token_lens.lens, run.rules,
                                run.max_context)
    token_lens = run.token_lens.grow(kept)
    has_new = kept > 0
    last_index = np.maximum(kept - 1, 0)
    last_tokens = np.where(has_new, tokens[np.arange(len(run)), last_index], run.last_tokens)
    keep_mask = np.arange(width)[None, :] < kept[:, None]
    done = reason != FinishReason.NONE
    # A finished request keeps no KV: its row is released with everything committed to it.
    effects = Effects(
        table_rows=table_rows, table_cols=table_cols, table_slots=table_slots,
        free_slots=free_slots,
        release_rows=run.rows[done], release_lens=kv_lens.select(done),
        emitted_rids=run.rids[has_new], emitted_lens=SeqLens(kept[has_new]),
        emitted_tokens=tokens[keep_mask],
        finished_rids=run.rids[done], finished_reasons=reason[done],
    )
    live = np.flatnonzero(~done) if done.any() else slice(None)
    after = Running(run.rids[live], run.rows[live], kv_lens.select(live) if done.any() else kv_lens,
                    token_lens.select(live) if done.any() else token_lens,
                    run.prompt_lens[live], last_tokens[live],
                    run.rules.select(live) if done.any() else run.rules, run.max_context)
    return Result(after, effects)


# --- requests leaving ------------------------------------------------------------------------
def _leave(running: Running, indices: Sequence[int] | np.ndarray) -> tuple[Running, np.ndarray]:
    mask = np.zeros(len(running), dtype=bool)
    idx = np.asarray(indices, dtype=INDEX_DTYPE).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= len(running)):
        raise IndexError(f"indices {idx.tolist()} out of range for a batch of {len(running)}")
    if np.unique(idx).size != idx.size:
        raise ValueError(f"indices {idx.tolist()} name a request twice")
    mask[idx] = True
    return running.select(~mask), mask


def retract(running: Running, indices: Sequence[int] | np.ndarray) -> Result:
    """Requests leave under memory pressure: every slot freed; they wait to be recomputed."""
    rest, gone = _leave(running, indices)
    effects = Effects(release_rows=running.rows[gone], release_lens=running.kv_lens.select(gone),
                      retracted_rids=running.rids[gone])
    return Result(rest, effects)


def finish(running: Running, indices: Sequence[int] | np.ndarray,
           reason: FinishReason) -> Result:
    """Requests leave with `reason` (a stop string matched, or an abort); every slot freed."""
    if reason == FinishReason.NONE:
        raise ValueError("finish() needs a reason: STOP, LENGTH or ABORT")
    rest, gone = _leave(running, indices)
    rids = running.rids[gone]
    effects = Effects(release_rows=running.rows[gone], release_lens=running.kv_lens.select(gone),
                      finished_rids=rids,
                      finished_reasons=np.full(rids.shape[0], int(reason), dtype=np.int8))
    return Result(rest, effects)


def abort(running: Running, indices: Sequence[int] | np.ndarray) -> Result:
    return finish(running, indices, FinishReason.ABORT)


def abandon(batch: Batch) -> Effects:
    """A pass that will not be committed (its forward failed): free the slots it was given."""
    return Effects(free_slots=batch.out_slots)


def filter_batch(running: Running, keep: Sequence[int] | np.ndarray) -> Running:
    return running.select(keep)


def merge(first: Running, second: Running) -> Running:
    return first.merge(second)
