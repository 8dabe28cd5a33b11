"""Attention test cases built through the real state API: a KVBook fills req_to_token, the
transitions make the Batch, and the pool holds fresh random K/V under shuffled slots."""

from __future__ import annotations

import os

import attrs
import numpy as np
import torch

from engine.backends import KVPool
from engine.shell.kv import KVBook
from engine.state import (
    DraftTrees,
    FinishRules,
    Running,
    schedule_decode,
    schedule_extend,
    schedule_verify,
)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# The interpreter's bf16 is wrong, so CPU runs use fp32/fp16; the GPU runs bf16.
DTYPES = [torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 2e-3 if ON_CUDA else 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
MAX_BATCH = 16 if ON_CUDA else 4
MAX_PREFIX = 300 if ON_CUDA else 64
MAX_NEW = 200 if ON_CUDA else 40
MAX_TREE = 16 if ON_CUDA else 12
# hypothesis examples per property, drawn after the explicit ones (the same every run: the
# profile in tests/conftest.py); the GPU suite lowers it under compute-sanitizer
EXAMPLES = int(os.environ.get("ENGINE_TEST_EXAMPLES", 25 if ON_CUDA else 8))


@attrs.frozen(eq=False)
class Case:
    batch: object
    pool: KVPool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def random_trees(rng: np.random.Generator, sizes: list[int], roots: np.ndarray) -> DraftTrees:
    tokens, parents = [], []
    for size, root in zip(sizes, roots.tolist(), strict=True):
        parents.append([-1] + [int(rng.integers(0, j)) for j in range(1, size)])
        tokens.append([root] + rng.integers(1, 1000, size - 1).tolist())
    return DraftTrees.from_lists(tokens, parents)


def make_case(
    mode: str,
    prefix_lens: list[int],
    new_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str = DEVICE,
    spare_slots: int = 5,
    spare_rows: int = 3,
) -> Case:
    """mode 'extend' (new_lens tokens each), 'decode' (one each, new_lens ignored) or
    'verify' (trees of new_lens nodes). Slots and rows are handed out in a random order."""
    rng = np.random.default_rng(seed)
    n = len(prefix_lens)
    new_lens = [1] * n if mode == "decode" else list(new_lens)
    pending = new_lens if mode == "extend" else [1] * n
    token_lens = [p + w for p, w in zip(prefix_lens, pending, strict=True)]
    max_context = max(p + w for p, w in zip(prefix_lens, new_lens, strict=True)) + 4
    capacity = sum(prefix_lens) + sum(new_lens) + spare_slots
    book = KVBook(capacity, n + spare_rows, max_context, device)
    book.slots.free(rng.permutation(book.slots.alloc(capacity)))
    all_rows = [book.table.alloc_row() for _ in range(n + spare_rows)]
    for row in rng.permutation(all_rows).tolist():
        book.table.release_row(row)
    rows = np.array([book.table.alloc_row() for _ in range(n)], dtype=np.int64)
    prefix_slots = book.slots.alloc(sum(prefix_lens))
    book.table.write(
        np.repeat(rows, prefix_lens),
        np.concatenate([np.arange(p) for p in prefix_lens]).astype(np.int64),
        prefix_slots,
    )
    rules = FinishRules([10**6] * n, [0] * n, [-1] * n, np.zeros((n, 0), dtype=np.int64))
    last_tokens = rng.integers(1, 1000, n)
    running = Running.admitted(
        list(range(100, 100 + n)),
        rows,
        token_lens,
        token_lens,
        last_tokens,
        rules,
        max_context,
        kv_lens=prefix_lens,
    )
    slots = book.slots.alloc(sum(new_lens))
    if mode == "extend":
        batch = schedule_extend(running, new_lens, rng.integers(1, 1000, sum(new_lens)), slots)
    elif mode == "decode":
        batch = schedule_decode(running, slots)
    else:
        batch = schedule_verify(running, random_trees(rng, new_lens, last_tokens), slots)
    return Case(
        batch,
        *random_tensors(
            book, batch.new_lens.total, num_kv_heads, group, head_dim, dtype, seed, device
        ),
    )


def random_tensors(
    book: KVBook,
    num_tokens: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str,
) -> tuple:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    pool = KVPool.allocate(
        1, book.slots.capacity + 1, num_kv_heads, head_dim, dtype, book.table.device
    )
    pool.k_cache[0].copy_(randn(*pool.k_cache[0].shape))
    pool.v_cache[0].copy_(randn(*pool.v_cache[0].shape))
    q = randn(num_tokens, num_kv_heads * group, head_dim)
    return (
        pool,
        q,
        randn(num_tokens, num_kv_heads, head_dim),
        randn(num_tokens, num_kv_heads, head_dim),
    )


def clone_pool(pool: KVPool) -> KVPool:
    return KVPool(
        tuple(t.clone() for t in pool.k_cache),
        tuple(t.clone() for t in pool.v_cache),
        pool.req_to_token,
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
