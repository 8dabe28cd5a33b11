"""What the graph tests share (`test_graphs.py`: decode and verify graphs;
`test_extend_graphs.py`: extend graphs; `test_padded_passes.py`): a tiny engine on the
Triton backend, its graph runners swapped in, replays counted, and the slots and rows a
hand-built batch takes given back."""

from __future__ import annotations

import torch

from engine.shell.engine import Engine
from engine.shell.graphs import graph_runners
from engine.state import Batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_engine(**overrides) -> Engine:
    settings = dict(
        random_weights="tiny",
        attention_backend="triton",
        device=DEVICE,
        dtype="float32",
        kv_cache_slots=512,
        max_context=128,
        cuda_graph_max_batch=0,
    )
    return Engine(**(settings | overrides))


def prompts_of(count: int) -> list[list[int]]:
    # Repeating patterns, so the n-gram proposer finds drafts in the speculative case.
    return [[(7 * i + j % (3 + i)) % 250 + 3 for j in range(9 + 5 * i)] for i in range(count)]


def count_replays(engine: Engine) -> list:
    """Every graph replay of `engine` appends its mode (proof the static path ran)."""
    replays: list = []
    for graph in engine.runner.graphs:
        real = graph.replay

        def replay(*args, real=real, mode=graph.mode):
            replays.append(mode)
            return real(*args)

        graph.replay = replay
    return replays


def with_graphs(
    engine: Engine, max_batch: int, tree_nodes: int = 0, extend_tokens: int = 0
) -> Engine:
    runner = engine.runner
    runner.graphs = graph_runners(
        runner.model,
        runner.backend,
        max_batch,
        tree_nodes,
        capture=DEVICE == "cuda",
        extend_tokens=extend_tokens,
    )
    return engine


def release(engine: Engine, batch: Batch) -> None:
    book = engine.book
    book.slots.free(batch.out_slots)
    for row, length in zip(
        batch.running.rows.tolist(), batch.running.kv_lens.tolist(), strict=True
    ):
        book.slots.free(book.table.host[row, :length])
        book.table.release_row(row)
