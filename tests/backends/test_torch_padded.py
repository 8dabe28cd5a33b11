"""The torch backend's padded all-requests attention, and the CPU kernel it uses for decode
and verify passes, equal its per-request oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.backends import KVPool, get_backend
from engine.backends.base import host_metadata
from engine.backends.torch_backend import TorchBackend, build_kv_indices
from engine.kv import KVBook
from engine.state import (
    DraftTrees,
    FinishRules,
    Running,
    schedule_decode,
    schedule_extend,
    schedule_verify,
)

KERNEL = cpu_kernels.status()


def _setup(prefix_lens, seed=0, head_dim=16):
    rng = np.random.default_rng(seed)
    n = len(prefix_lens)
    book = KVBook(512, n, 128)
    pool = KVPool.allocate(1, 513, 2, head_dim, torch.float32, book.table.device)
    for cache in (*pool.k_cache, *pool.v_cache):
        cache.normal_()
    rows = [book.table.alloc_row() for _ in range(n)]
    for row, length in zip(rows, prefix_lens, strict=True):
        if length:
            book.table.write(np.full(length, row), np.arange(length),
                             book.slots.alloc(length)[rng.permutation(length)])
    rules = FinishRules([99] * n, [0] * n, [-1] * n, np.zeros((n, 0), dtype=np.int64))
    return book, pool, rows, rules, rng


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    not KERNEL.available, reason=f"CPU kernels: {KERNEL.reason}"))])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # 24: masked tails; 64, 128: blocked
@pytest.mark.parametrize("mode", ["extend", "decode", "verify"])
def test_padded_attention_equals_per_request(mode, head_dim, kernel, monkeypatch):
    monkeypatch.setattr(TorchBackend, "use_cpu_kernel", kernel)
    prefix_lens = [0, 7, 30, 1] if mode != "decode" else [3, 7, 30, 1]
    book, pool, rows, rules, rng = _setup(prefix_lens, head_dim=head_dim)
    n = len(prefix_lens)
    if mode == "extend":
        new = [5, 1, 9, 3]
        running = Running.admitted(range(n), rows, [p + c for p, c in zip(prefix_lens, new)],
                                   [p + c for p, c in zip(prefix_lens, new)], [1] * n, rules,
                                   128, kv_lens=prefix_lens)
        batch = schedule_extend(running, new, rng.integers(0, 50, sum(new)),
                                book.slots.alloc(sum(new)))
    elif mode == "decode":
        running = Running.admitted(range(n), rows, [p + 1 for p in prefix_lens],
                                   [p + 1 for p in prefix_lens], [4] * n, rules, 128,
                                   kv_lens=prefix_lens)
        batch = schedule_decode(running, book.slots.alloc(n))
    else:
        running = Running.admitted(range(n), rows, [p + 1 for p in prefix_lens],
                                   [p + 1 for p in prefix_lens], [4] * n, rules, 128,
                                   kv_lens=prefix_lens)
        trees = DraftTrees.from_lists([[4, 1, 2, 3], [4], [4, 5, 6], [4, 7]],
                                      [[-1, 0, 0, 1], [-1], [-1, 0, 1], [-1, 0]])
        batch = schedule_verify(running, trees, book.slots.alloc(trees.sizes.total))
    backend = get_backend("torch", pool)
    meta = backend.plan(batch)
    assert bool(meta.extra.get("cpu_kernel")) == (kernel and mode != "extend")
    # on the CPU the plan builds kv_indices on the host: the same as the tensor version
    tensors = host_metadata(batch, "cpu")
    assert torch.equal(meta.kv_indices, build_kv_indices(
        pool.req_to_token, torch.from_numpy(batch.running.rows.copy()), tensors["prefix_lens"],
        tensors["kv_indptr"], tensors["qo_indptr"], tensors["out_slots"],
        batch.seq_lens.total))
    total = batch.new_lens.total
    q = torch.randn(total, 6, head_dim)[:, 1:5]  # a view: tokens strided, as from qkv
    k, v = torch.randn(total, 2, head_dim), torch.randn(total, 2, head_dim)
    padded = backend.forward(0, q, k, v, meta)
    oracle = backend.forward_per_request(0, q, meta, head_dim ** -0.5)
    torch.testing.assert_close(padded, oracle, rtol=1e-5, atol=1e-5)
