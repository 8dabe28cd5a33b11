"""Extend (prompt and mixed) passes replayed from CUDA graphs equal the eager path: a graph per
token count, cached prefixes, chunks that do not sample, the engine's own graphs in both
precisions. On CPU the graph runner runs its static-buffer path without capturing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_cases import DEVICE, count_replays, prompts_of, release, tiny_engine, with_graphs

from engine.shell import runtime
from engine.shell.engine import Engine
from engine.shell.graphs import GraphRunner, extend_sizes, graph_runners
from engine.state import Batch, FinishRules, Mode, Running, SamplingParams, schedule_extend


def test_extend_sizes_cover_every_pass_up_to_the_most_tokens():
    assert extend_sizes(0) == []
    assert extend_sizes(16) == [16] and extend_sizes(40) == [16, 32, 40]
    assert extend_sizes(1024)[-3:] == [512, 768, 1024]
    with pytest.raises(ValueError, match="extend_tokens=0 for extend passes"):
        GraphRunner(tiny_engine().runner.model, tiny_engine().runner.backend, Mode.EXTEND, 4)


def _extend_batch(engine: Engine, chunks: list[int], prefixes: list[int]) -> Batch:
    """An extend pass of one request per chunk, each after a cached prefix of `prefixes`
    tokens (its slots in the table); of two or more, the last chunk stops short of its
    prompt's end (it does not sample). `release` gives back what it takes."""
    book, count = engine.book, len(chunks)
    rows = [book.table.alloc_row() for _ in range(count)]
    for row, prefix in zip(rows, prefixes, strict=True):
        if prefix:
            book.table.write(np.full(prefix, row), np.arange(prefix), book.slots.alloc(prefix))
    rules = FinishRules(
        np.full(count, 100), np.zeros(count), -np.ones(count), np.zeros((count, 0), dtype=np.int64)
    )
    token_lens = np.array(prefixes) + np.array(chunks)
    if count > 1:
        token_lens[-1] += 3  # a prompt chunk short of its end
    running = Running.admitted(
        np.arange(count) + 2000, rows, token_lens, token_lens, np.full(count, 5), rules,
        engine.max_context, kv_lens=np.array(prefixes),
    )  # fmt: skip
    ids = np.arange(sum(chunks), dtype=np.int64) % 200 + 3
    return schedule_extend(running, np.array(chunks), ids, book.slots.alloc(sum(chunks)))


def test_an_extend_pass_replays_the_smallest_graph_it_fits():
    """Extend graphs of 16, 32 and 40 tokens (up to 4 requests): an extend pass, with cached
    prefixes and a chunk that does not sample, replays the smallest graph that holds its
    tokens and requests, its logits (the sampling rows') equal the eager pass's; a pass over
    40 tokens or 4 requests runs eagerly."""
    engine = tiny_engine()
    runner = engine.runner
    graphs = graph_runners(
        runner.model, runner.backend, 4, capture=DEVICE == "cuda", extend_tokens=40
    )
    assert [(g.mode, g.sizes) for g in graphs] == [
        (Mode.DECODE, [1, 2, 4]), (Mode.EXTEND, [16, 32, 40]),
    ]  # fmt: skip
    extend = graphs[1]
    assert [(g.batch_size, g.num_tokens) for g in extend.graphs.values()] == [
        (4, 16), (4, 32), (4, 40),
    ]  # fmt: skip
    for graph in extend.graphs.values():  # the pass each graph captures: finite logits
        captured = extend._forward(graph, extend._plan(graph, extend._dummy_batch(4)))
        assert captured.shape == (4, runner.model.config.vocab_size)
        assert torch.isfinite(captured).all()
    cases = [
        ([5], [0], 16), ([16], [7], 16), ([9, 1, 4], [3, 0, 20], 16), ([17], [0], 32),
        ([20, 3, 2, 5], [0, 9, 1, 0], 32), ([33, 2], [0, 4], 40), ([41], [0], None),
        ([2, 2, 2, 2, 2], [0, 0, 0, 0, 0], None),
    ]  # fmt: skip
    for chunks, prefixes, tokens in cases:
        batch = _extend_batch(engine, chunks, prefixes)
        runner.graphs = graphs
        prepared = runner.prepare(batch)
        if tokens is None:
            assert prepared.runner is None, chunks
        else:
            assert prepared.runner is extend and prepared.graph.num_tokens == tokens, chunks
        graphed = runner.launch(prepared, batch).clone()
        runner.graphs = []
        eager = runner.forward(batch)
        samples = max(len(chunks) - 1, 1)
        assert graphed.shape == (samples, runner.model.config.vocab_size)
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
        release(engine, batch)
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine captures graphs on CUDA only")
def test_the_engine_replays_extend_graphs_when_asked():
    """`cuda_graph_max_tokens`: the engine's own runner captures extend graphs, prompts
    replay them, and tokens equal the eager engine's."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = prompts_of(3)
    eager = tiny_engine().generate(prompts, params)
    engine = tiny_engine(cuda_graph_max_batch=4, cuda_graph_max_tokens=64)
    engine.runner.graphs = [g for g in engine.runner.graphs if g.mode == Mode.EXTEND]
    assert [g.sizes for g in engine.runner.graphs] == [[16, 32, 64]]
    replays = count_replays(engine)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in eager]
    assert Mode.EXTEND in replays
    engine.check()


@pytest.mark.skipif(DEVICE != "cuda", reason="half-precision graphs of the Triton kernels")
def test_extend_graphs_capture_in_half_precision():
    """In bf16 (where a Hopper GPU's extend attention reads q, K and V through tensor-memory
    descriptors, whose offsets are 32-bit while a graph's are int64) the engine captures its
    extend graphs (the default) and prompts replay them. (The kernel's outputs with a graph's
    offsets, bit for bit: `test_extend_tensor_memory_loads_match_pointer_loads`; bf16
    products on a padded pass may round apart from an eager pass's, so tokens are not
    compared here.)"""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = prompts_of(3)
    engine = tiny_engine(dtype="bfloat16", cuda_graph_max_batch=4, cuda_graph_max_tokens=64)
    replays = count_replays(engine)
    assert [len(o.token_ids) for o in engine.generate(prompts, params)] == [6, 6, 6]
    assert Mode.EXTEND in replays
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity


def test_extend_graphs_stop_at_the_longest_pass_the_scheduler_plans(monkeypatch):
    """The runtime asks for extend graphs up to `cuda_graph_max_tokens`, or up to the longest
    extend pass the scheduler plans where that is shorter (`most_extend_tokens`: the chunk
    size, or half of it beside every other request's decode): a graph past it would never
    replay."""
    asked, real = [], runtime.ModelRunner

    def recording(*args, **kwargs):
        asked.append(kwargs["graph_max_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "ModelRunner", recording)
    tiny_engine(chunk_size=32, max_running_requests=4)
    tiny_engine(chunk_size=32, max_running_requests=40)  # 16 prompt tokens beside 39 decodes
    tiny_engine(chunk_size=32, cuda_graph_max_tokens=16)
    tiny_engine()  # 1024 tokens by default, and so many a pass may have
    assert asked == [32, 55, 16, 1024]


def _staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Submit a prompt every third step (the later ones prefill beside the earlier ones'
    decodes: mixed passes), step to the end; the outputs, every slot and row back."""
    requests, steps = [], 0
    while len(requests) < len(prompts) or engine.has_work:
        if len(requests) < len(prompts) and steps % 3 == 0:
            requests.append(engine._submit(prompts[len(requests)], params, None, None))
        engine.step()
        engine.check()
        steps += 1
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    return [r.output_ids for r in requests]


def test_extend_graphs_serve_chunks_mixed_passes_and_cached_prefixes():
    """Prompts sharing a prefix (the prefix cache's), chunked at 24 tokens, arriving while
    others decode (mixed passes), over extend graphs of up to 32 tokens: the outputs are the
    eager engine's, passes of every kind replay the extend graphs, nothing leaks."""
    shared = [(5 * j) % 200 + 3 for j in range(20)]
    prompts = [shared + [(11 * i + j) % 200 + 3 for j in range(4 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    settings = dict(chunk_size=24, mixed_chunk_size=24)
    eager = _staggered(tiny_engine(**settings), prompts, params)
    engine = with_graphs(tiny_engine(**settings), 4, extend_tokens=32)
    extend = engine.runner.graphs[-1]
    seen = []  # (tokens, requests, requests that do not sample) of each extend replay
    real_replay = extend.replay

    def replay(graph, batch, *args):
        requests = len(batch.running)
        seen.append((batch.new_lens.total, requests, requests - batch.logit_rows.shape[0]))
        return real_replay(graph, batch, *args)

    extend.replay = replay
    assert _staggered(engine, prompts, params) == eager
    assert engine.stats["cached_prompt_tokens"] > 0, "no prompt reused the shared prefix"
    assert any(requests > 1 for _, requests, _ in seen), "no mixed pass replayed a graph"
    assert any(short for _, _, short in seen), "no chunk short of its prompt's end did"
    assert any(tokens > 16 for tokens, _, _ in seen), "no pass replayed the 32-token graph"
