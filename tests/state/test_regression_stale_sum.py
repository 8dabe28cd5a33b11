"""Regression test for the bug this project exists to remove: after speculative verify the
length sum went stale, a kv_indices buffer sized from it was overrun. 1000 verify rounds with
random trees and random acceptance; after each, total == sum and a buffer sized from the
total is filled exactly, with a guard band after it left untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from state_builders import Rule, path_to, random_tree, running_of

from engine import state
from engine.backends.base import KVPool
from engine.backends.torch_backend import TorchBackend
from engine.shell.kv import KVBook
from engine.state import DraftTrees

NUM_REQUESTS = 16
ROUNDS = 1000
MAX_TREE = 12
MAX_CONTEXT = 16 + ROUNDS * MAX_TREE + 8  # room for the longest possible acceptance
GUARD = 64
SENTINEL = -7


def kernel_fill(buffer: np.ndarray, meta, table: np.ndarray, rows: np.ndarray) -> None:
    """What a kv-index kernel does: per request, write seq_len entries at kv_indptr[i],
    reading only the metadata's device tensors (as a GPU kernel would)."""
    kv_indptr = meta.kv_indptr.tolist()
    seq_lens = [end - start for start, end in zip(kv_indptr[:-1], kv_indptr[1:], strict=True)]
    prefix_lens, qo_indptr = meta.prefix_lens.tolist(), meta.qo_indptr.tolist()
    out_slots = meta.out_slots.numpy()
    for i, row in enumerate(rows.tolist()):
        start, prefix = kv_indptr[i], prefix_lens[i]
        buffer[start : start + prefix] = table[row, :prefix]
        new = out_slots[qo_indptr[i] : qo_indptr[i + 1]]
        buffer[start + prefix : start + seq_lens[i]] = new[: seq_lens[i] - prefix]


def expected_indices(batch: state.Batch, table: np.ndarray) -> np.ndarray:
    run = batch.running
    new = np.split(batch.out_slots, batch.new_lens.indptr()[1:-1])
    parts = [
        np.concatenate([table[row, :kv], own])
        for row, kv, own in zip(run.rows.tolist(), run.kv_lens.tolist(), new, strict=True)
    ]
    return np.concatenate(parts)


def check_round(batch: state.Batch, backend: TorchBackend, book: KVBook) -> None:
    for seq in (batch.seq_lens, batch.new_lens, batch.running.kv_lens, batch.running.token_lens):
        assert seq.total == sum(seq.tolist())
    total = batch.seq_lens.total
    meta = backend.plan(batch)
    assert meta.kv_indices.shape[0] == total == int(meta.kv_indptr[-1])
    # each request's span in the metadata is its own length, from the state, not the indptr
    assert int(meta.kv_indptr[0]) == 0
    assert (
        np.diff(meta.kv_indptr.numpy()).tolist()
        == (batch.running.kv_lens.lens + batch.new_lens.lens).tolist()
    )
    want = expected_indices(batch, book.table.host)
    assert np.array_equal(meta.kv_indices.numpy(), want)
    buffer = np.full(total + GUARD, SENTINEL, dtype=np.int64)
    kernel_fill(buffer, meta, book.table.host, batch.running.rows)
    assert (buffer[total:] == SENTINEL).all(), "a write landed past the buffer sized from total"
    assert np.array_equal(buffer[:total], want)


@pytest.fixture
def one_torch_thread():
    """Small CPU ops run faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_1000_verify_rounds_keep_total_equal_to_sum_and_fill_buffers_exactly(one_torch_thread):
    rng = np.random.default_rng(2)
    capacity = NUM_REQUESTS * MAX_CONTEXT
    book = KVBook(capacity, NUM_REQUESTS, MAX_CONTEXT)
    pool = KVPool.allocate(1, capacity + 1, 1, 1, torch.float32, book.table.device)
    backend = TorchBackend(pool)
    prompts = rng.integers(0, 50, size=(NUM_REQUESTS, 4))
    rows = [book.table.alloc_row() for _ in range(NUM_REQUESTS)]
    run = running_of(
        range(NUM_REQUESTS),
        rows,
        [0] * NUM_REQUESTS,
        [4] * NUM_REQUESTS,
        [4] * NUM_REQUESTS,
        prompts[:, -1],
        [Rule(10**6, 0, -1, ())] * NUM_REQUESTS,
        MAX_CONTEXT,
    )
    prefill = state.schedule_extend(
        run, [4] * NUM_REQUESTS, prompts.reshape(-1), book.slots.alloc(4 * NUM_REQUESTS)
    )
    check_round(prefill, backend, book)
    result = state.extend(prefill, rng.integers(0, 50, NUM_REQUESTS))
    book.apply(result.effects)
    run = result.running
    for _ in range(ROUNDS):
        trees = [
            random_tree(rng, int(root), int(rng.integers(1, MAX_TREE + 1)))
            for root in run.last_tokens
        ]
        draft = DraftTrees.from_lists([t for t, _ in trees], [p for _, p in trees])
        batch = state.schedule_verify(run, draft, book.slots.alloc(draft.sizes.total))
        check_round(batch, backend, book)
        paths = [path_to(p, int(rng.integers(0, len(p)))) for _, p in trees]
        nodes = np.array([n for p in paths for n in p], dtype=np.int64)
        result = state.verify(
            batch, [len(p) for p in paths], nodes, rng.integers(0, 50, NUM_REQUESTS)
        )
        book.apply(result.effects)
        run = result.running
        assert len(run) == NUM_REQUESTS
        assert run.kv_lens.total == sum(run.kv_lens.tolist())
        book.check(run)
    assert run.kv_lens.total > NUM_REQUESTS * ROUNDS  # the batch really grew every round
