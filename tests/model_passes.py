"""Shared by the model and ops tests: a minimal greedy driver over the state core, the KV book
and an attention backend, and fixtures around it (imported by their conftest.py files)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from engine.backends import KVPool, get_backend
from engine.model import LlamaModel
from engine.shell.kv import KVBook
from engine.state import (
    DraftTrees,
    FinishRules,
    Running,
    decode,
    extend,
    schedule_decode,
    schedule_extend,
    schedule_verify,
)


def run_greedy(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    eos: int = -1,
    backend_name: str = "torch",
) -> list[list[int]]:
    """All prompts in one batch: one extend pass, then decode passes until all finish."""
    config = model.config
    max_context = max(len(p) for p in prompts) + max_new
    capacity = sum(len(p) for p in prompts) + len(prompts) * max_new
    book = KVBook(capacity, len(prompts), max_context)
    pool = KVPool.allocate(
        config.num_layers,
        capacity + 1,
        config.num_kv_heads,
        config.head_dim,
        model.dtype,
        book.table.device,
    )
    backend = get_backend(backend_name, pool)
    n = len(prompts)
    rules = FinishRules([max_new] * n, [0] * n, [eos] * n, np.zeros((n, 0), dtype=np.int64))
    rows = [book.table.alloc_row() for _ in prompts]
    running = Running.admitted(
        list(range(n)),
        rows,
        [len(p) for p in prompts],
        [len(p) for p in prompts],
        [p[-1] for p in prompts],
        rules,
        max_context,
    )
    input_ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    batch = schedule_extend(
        running, [len(p) for p in prompts], input_ids, book.slots.alloc(input_ids.shape[0])
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    step = extend
    while True:
        result = step(batch, _greedy_tokens(model, backend, batch))
        book.apply(result.effects)
        for rid, tokens in result.effects.emitted().items():
            outputs[rid].extend(tokens)
        running = result.running
        book.check(running)
        if len(running) == 0:
            return outputs
        batch, step = schedule_decode(running, book.slots.alloc(len(running))), decode


def _greedy_tokens(model: LlamaModel, backend: object, batch: object) -> np.ndarray:
    metadata = backend.plan(batch)
    with torch.no_grad():
        hidden = model(
            torch.from_numpy(batch.input_ids.copy()),
            torch.from_numpy(batch.positions.copy()),
            metadata,
            backend,
        )
        logits = model.logits(hidden[torch.from_numpy(batch.logit_rows.copy())])
    return logits.argmax(dim=-1).numpy()


def chunked_logits_of(model: LlamaModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, computed as successive extend chunks of one request."""
    config = model.config
    book = KVBook(len(ids), 1, len(ids))
    pool = KVPool.allocate(
        config.num_layers,
        len(ids) + 1,
        config.num_kv_heads,
        config.head_dim,
        model.dtype,
        book.table.device,
    )
    backend = get_backend("torch", pool)
    rules = FinishRules([len(ids)], [0], [-1], np.zeros((1, 0), dtype=np.int64))
    running = Running.admitted(
        [0], [book.table.alloc_row()], [len(ids)], [len(ids)], [ids[-1]], rules, len(ids)
    )
    pieces, start = [], 0
    for size in chunks:
        chunk = np.asarray(ids[start : start + size])
        batch = schedule_extend(running, [size], chunk, book.slots.alloc(size))
        with torch.no_grad():
            hidden = model(
                torch.from_numpy(chunk),
                torch.from_numpy(batch.positions.copy()),
                backend.plan(batch),
                backend,
            )
        pieces.append(model.logits(hidden))
        start += size
        if start < len(ids):  # an unfinished prompt samples nothing
            result = extend(batch, np.zeros(0, dtype=np.int64))
            book.apply(result.effects)
            running = result.running
    return torch.cat(pieces)


def extend_then_next(
    model: LlamaModel, prompts: list[list[int]], device: str = "cpu", then: str = "decode"
) -> list[torch.Tensor]:
    """Hidden states of one extend pass over `prompts` and one pass after it: a decode, or
    (then="verify") a verify of a small draft tree per request."""
    config, count = model.config, len(prompts)
    lens = [len(p) for p in prompts]
    book = KVBook(sum(lens) + 5 * count, count, max(lens) + 5, device)
    pool = KVPool.allocate(
        config.num_layers,
        sum(lens) + 5 * count + 1,
        config.num_kv_heads,
        config.head_dim,
        model.dtype,
        book.table.device,
    )
    backend = get_backend("torch", pool)
    rules = FinishRules(
        [4] * count, [0] * count, [-1] * count, np.zeros((count, 0), dtype=np.int64)
    )
    running = Running.admitted(
        list(range(count)),
        [book.table.alloc_row() for _ in prompts],
        lens,
        lens,
        [p[-1] for p in prompts],
        rules,
        max(lens) + 5,
    )
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    batch = schedule_extend(running, lens, ids, book.slots.alloc(ids.shape[0]))
    hiddens = []
    for step in (extend, None):
        with torch.no_grad():
            hiddens.append(
                model(
                    torch.from_numpy(batch.input_ids.copy()).to(device),
                    torch.from_numpy(batch.positions.copy()).to(device),
                    backend.plan(batch),
                    backend,
                )
            )
        if step is None:
            return hiddens
        sampled = np.arange(count, dtype=np.int64) + 3
        result = step(batch, sampled)
        book.apply(result.effects)
        if then == "decode":
            batch = schedule_decode(result.running, book.slots.alloc(count))
        else:  # trees of 1-4 nodes: a chain, branches, and a root alone
            shapes = [[-1, 0, 0, 1], [-1, 0], [-1], [-1, 0, 1]]
            parents = [shapes[i % len(shapes)] for i in range(count)]
            tokens = [
                [int(sampled[i])] + [5 + i + j for j in range(len(p) - 1)]
                for i, p in enumerate(parents)
            ]
            trees = DraftTrees.from_lists(tokens, parents)
            batch = schedule_verify(result.running, trees, book.slots.alloc(trees.sizes.total))
    return hiddens


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine, OpenMP threads spinning against other
    processes make a small matmul ~20x slower. Both sides of every comparison use it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def greedy_runner() -> Callable[..., list[list[int]]]:
    return run_greedy


@pytest.fixture
def chunked_logits() -> Callable[..., torch.Tensor]:
    return chunked_logits_of


@pytest.fixture
def two_passes() -> Callable[..., list[torch.Tensor]]:
    return extend_then_next
