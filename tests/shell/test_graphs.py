"""The static (CUDA-graph) decode and verify path equals the eager path, padding included.

On CPU the graph runner runs its static-buffer path without capturing (capture=False), with
the Triton backend in the interpreter; on CUDA the same test captures real graphs.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from engine_checks import draft_in_turns
from graph_cases import DEVICE, count_replays, prompts_of, release, tiny_engine, with_graphs

from engine import pdl
from engine.backends import triton_index
from engine.ops import gemv_policy
from engine.shell.engine import Engine
from engine.shell.graphs import (
    GraphRunner,
    collection_paused,
    default_batch_sizes,
    graph_runners,
    verify_widths,
)
from engine.shell.table import RequestTable
from engine.state import (
    Batch,
    DraftTrees,
    FinishRules,
    Mode,
    Running,
    SamplingParams,
    schedule_verify,
)


def _verify_batch(engine: Engine, tree_sizes: list[int], context: int = 6) -> Batch:
    """A verify pass of one request per tree size (chains of drafts), each at `context`
    tokens of cache; `release` gives back what it takes."""
    book, count = engine.book, len(tree_sizes)
    rows = [book.table.alloc_row() for _ in range(count)]
    slots = book.slots.alloc(count * context)
    book.table.write(np.repeat(rows, context), np.tile(np.arange(context), count), slots)
    rules = FinishRules(
        np.full(count, 100), np.zeros(count), -np.ones(count), np.zeros((count, 0), dtype=np.int64)
    )
    last = np.arange(count) + 5
    lens = np.full(count, context + 1)
    running = Running.admitted(
        np.arange(count) + 1000, rows, lens, lens, last, rules, engine.max_context,
        kv_lens=np.full(count, context),
    )  # fmt: skip
    trees = DraftTrees.from_lists(
        [
            [int(t)] + [9 + j for j in range(size - 1)]
            for t, size in zip(last, tree_sizes, strict=True)
        ],
        [[-1] + list(range(size - 1)) for size in tree_sizes],
    )
    return schedule_verify(running, trees, book.slots.alloc(sum(tree_sizes)))


def test_a_verify_pass_replays_the_narrowest_graph_its_trees_fit():
    """Verify graphs at widths 4, 8 and the widest trees (13 nodes): a verify pass replays the
    narrowest its largest tree fits, and its logits are the eager pass's."""
    assert verify_widths(13) == [4, 8, 13]
    assert verify_widths(5) == [4, 5] and verify_widths(4) == [4] and verify_widths(2) == [2]
    engine = tiny_engine(speculative=True, draft_budget=12)
    runner = engine.runner
    graphs = graph_runners(runner.model, runner.backend, 4, 13, capture=DEVICE == "cuda")
    assert [(g.mode, g.per_request) for g in graphs] == [
        (Mode.DECODE, 1), (Mode.VERIFY, 4), (Mode.VERIFY, 8), (Mode.VERIFY, 13),
    ]  # fmt: skip
    cases = [([1], 4), ([4, 2], 4), ([5], 8), ([3, 8, 1], 8), ([9], 13), ([13, 2, 2, 2], 13)]
    for sizes, width in cases:
        batch = _verify_batch(engine, sizes)
        runner.graphs = graphs
        prepared = runner.prepare(batch)
        assert prepared.runner is not None and prepared.runner.per_request == width, sizes
        graphed = runner.launch(prepared, batch).clone()
        runner.graphs = []
        eager = runner.forward(batch)
        assert graphed.shape == (sum(sizes), runner.model.config.vocab_size)
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
        release(engine, batch)
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity


def test_batch_sizes_cover_every_batch_up_to_the_maximum():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(64)[-1] == 64


def test_each_graph_runs_under_the_pdl_setting_of_its_pass(monkeypatch):
    """Under `auto`, a graph pass whose layers' products all run in the package's matrix
    kernels, none on a weight past `pdl.AUTO_MAX_WEIGHT_ELEMENTS`, runs with PDL (`top`): on
    every launch up to `pdl.AUTO_MAX_ROWS` rows, on every launch but the products up to
    `pdl.AUTO_BESIDE_MAX_ROWS`; any other off. A mode set for the process applies to every
    pass."""
    runner = tiny_engine().runner

    def settings(mode: Mode, width: int = 3) -> dict:
        graphs = GraphRunner(runner.model, runner.backend, mode, 4, width, capture=False)
        return graphs.pdl

    on, off = ("top", None), ("off", None)
    beside = ("top", pdl._kinds_state["kinds"] - {"products"})
    with pdl.using("auto"):
        assert settings(Mode.DECODE) == {1: on, 2: on, 4: on}
        assert settings(Mode.VERIFY) == {1: on, 2: on, 4: beside}  # 3, 6 and 12 rows
        assert settings(Mode.VERIFY, 8) == {1: on, 2: off, 4: off}  # 8, 16 and 32 rows
        assert settings(Mode.VERIFY, 13) == {1: beside, 2: off, 4: off}  # 13, 26, 52 rows
        largest = max(w.numel() for w in runner.model.layer_products())
        # a product of the layers on a weight larger than PDL was measured to pay on (a
        # large model's: its launches of many programs lose with PDL)
        with monkeypatch.context() as patched:
            patched.setattr(pdl, "AUTO_MAX_WEIGHT_ELEMENTS", largest - 1)
            assert settings(Mode.DECODE) == {1: off, 2: off, 4: off}
            assert settings(Mode.VERIFY) == {1: off, 2: off, 4: off}
        # one product of the layers goes to cuBLAS at one row
        monkeypatch.setattr(gemv_policy, "MAX_WEIGHT_ELEMENTS", largest - 1)
        assert settings(Mode.DECODE) == {1: off, 2: on, 4: on}
        # and at every row count
        monkeypatch.setattr(gemv_policy, "ROWS_MAX_WEIGHT_ELEMENTS", largest - 1)
        monkeypatch.setattr(gemv_policy, "ROWS_WIDE_MAX_WEIGHT_ELEMENTS", largest - 1)
        assert settings(Mode.DECODE) == {1: off, 2: off, 4: off}
        assert settings(Mode.VERIFY) == {1: off, 2: off, 4: off}
    with pdl.using("late"):
        late = ("late", None)
        assert settings(Mode.DECODE) == {1: late, 2: late, 4: late}
        assert settings(Mode.VERIFY) == {1: late, 2: late, 4: late}


def test_a_graph_pass_launches_under_its_setting(monkeypatch):
    """The static path's forward runs under the setting chosen for its batch size; the
    eager (extend) passes under the process's. Uncaptured, so that each pass runs the
    forward (a captured graph keeps the launches of its capture)."""
    engine = tiny_engine()
    runner = engine.runner
    graphs = GraphRunner(runner.model, runner.backend, Mode.DECODE, 4, capture=False)
    runner.graphs = [graphs]
    beside = frozenset({"attention", "ops"})
    graphs.pdl = {size: ("late", None) if size == 1 else ("exit", beside) for size in graphs.sizes}
    seen, kinds = [], {}
    model_forward = graphs.model.forward

    def forward(input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], pdl._state["setting"]))
        kinds.setdefault(pdl._state["setting"], set()).add(pdl._kinds_state["kinds"])
        return model_forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(graphs.model, "forward", forward)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with pdl.using("auto"):  # the process's setting, whatever ENGINE_PDL says
        engine.generate(prompts_of(1), params)
        engine.generate(prompts_of(3), params)
    tokens_under = {setting: {n for n, s in seen if s == setting} for setting in ("late", "exit")}
    assert tokens_under == {"late": {1}, "exit": {4}}  # 3 requests padded to 4
    assert {s for _, s in seen} == {"late", "exit", "auto"}  # extend passes: the process's
    process = pdl._kinds_state["kinds"]  # all unless ENGINE_PDL_KINDS says otherwise
    assert kinds == {"late": {process}, "exit": {beside}, "auto": {process}}


@pytest.mark.parametrize("speculative", [False, True])
def test_graph_path_equals_eager_path_with_padding_and_overflow(speculative):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = prompts_of(3)  # 3 requests: padded to 4 in graph mode
    eager = tiny_engine(speculative=speculative, draft_budget=4).generate(prompts, params)
    graphed = with_graphs(
        tiny_engine(speculative=speculative, draft_budget=4),
        4,
        tree_nodes=5 if speculative else 0,
        extend_tokens=48,  # the three prompts' 42 tokens in one pass
    )
    replays = count_replays(graphed)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [o.token_ids for o in eager]
    assert Mode.EXTEND in replays and Mode.DECODE in replays
    # More requests than the largest graph: those steps take the eager path.
    overflow = with_graphs(
        tiny_engine(speculative=speculative, draft_budget=4), 2, tree_nodes=5 if speculative else 0
    )
    overflow_replays = count_replays(overflow)
    assert [o.token_ids for o in overflow.generate(prompts, params)] == [o.token_ids for o in eager]
    if not speculative:  # equal lengths: all three leave together, every pass is eager
        assert not overflow_replays, "3 requests over graphs of 2 took a graph"
    for engine in (graphed, overflow):
        engine.check()
        assert engine.book.num_available == engine.book.slots.capacity


def test_table_writes_wait_for_the_verify_pass_that_reads_the_table(monkeypatch):
    """With a device mirror apart from the host table (CUDA's; forced here on CPU), the
    table's writes wait on the host and each verify replay applies them before its pass
    builds its kv indices; every other pass (decode graphs, eager passes) finds them applied
    when planned, and a decode replay applies writes made after its plan. Tokens equal the
    eager path's, verify replays staged writes, no pass builds its kv indices with writes
    waiting, and the mirror ends equal to the host table."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = prompts_of(3)
    eager = tiny_engine(speculative=True, draft_budget=4).generate(prompts, params)
    monkeypatch.setattr(RequestTable.__init__, "__defaults__", ("cpu", True))
    engine = tiny_engine(speculative=True, draft_budget=4)
    table, runner = engine.book.table, engine.runner
    assert table.mirrored and runner.table is table
    capture = DEVICE == "cuda"
    runner.graphs = graph_runners(runner.model, runner.backend, 4, 5, capture, table)
    assert [graph.applies_writes for graph in runner.graphs] == [False, True, True]
    assert table.deferring
    staged: list[int] = []

    def staging(real):
        def stage(writes):
            end = real(writes)
            staged.append(int(writes[0]))
            return end

        return stage

    for verify_graph in runner.graphs[1:]:  # widths 4 and 5
        monkeypatch.setattr(verify_graph, "_stage_writes", staging(verify_graph._stage_writes))
    real_plan = runner.backend.plan
    planned = set()

    def plan(batch, *args, **kwargs):  # only a verify graph's plan may leave writes waiting
        planned.add((batch.mode, kwargs.get("buffers") is not None))
        if batch.mode != Mode.VERIFY or kwargs.get("buffers") is None:
            assert not table.num_pending
        return real_plan(batch, *args, **kwargs)

    monkeypatch.setattr(runner.backend, "plan", plan)
    decode_graph = runner.graphs[0]
    real_prepare = decode_graph.prepare

    def prepare(batch):  # a write after the plan (a slot again): its replay applies it first
        planned = real_prepare(batch)
        row = batch.running.rows[:1]
        table.write(row, np.zeros(1, dtype=np.int64), table.host[row, 0].copy())
        return planned

    monkeypatch.setattr(decode_graph, "prepare", prepare)
    real_build = runner.backend.build_kv_indices

    def build(metadata):  # uncaptured (CPU): at every replay
        assert not table.num_pending, "a pass read the table with writes waiting"
        return real_build(metadata)

    monkeypatch.setattr(runner.backend, "build_kv_indices", build)
    replays = count_replays(engine)
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens == [o.token_ids for o in eager]
    assert Mode.VERIFY in replays and Mode.DECODE in replays
    assert (Mode.EXTEND, False) in planned
    assert any(staged), "no verify replay took the table's writes"
    assert np.array_equal(table.device.cpu().numpy(), table.host)
    engine.check()


@pytest.mark.parametrize("speculative", [False, True])
def test_a_graph_pass_builds_its_kv_indices_in_the_pass(monkeypatch, speculative):
    """Planning a graph pass stages its arrays and launches nothing: its kv indices are
    built by the pass (inside the captured graph), once a replay, so outputs are the eager
    path's. Uncaptured here, so each replay runs the forward and is counted."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = prompts_of(3)
    eager = tiny_engine(speculative=speculative, draft_budget=4).generate(prompts, params)
    engine = tiny_engine(speculative=speculative, draft_budget=4)
    runner = engine.runner
    runner.graphs = graph_runners(
        runner.model, runner.backend, 4, 5 if speculative else 0, capture=False
    )
    launches: list[str] = []
    where = ["host"]
    real_launch = triton_index.launch_kv_indices

    def launch(*args, **kwargs):
        launches.append(where[0])
        return real_launch(*args, **kwargs)

    def inside(real, label: str):  # `real`, with launches in it counted as `label`'s
        def marked(*args):
            where[0] = label
            try:
                return real(*args)
            finally:
                where[0] = "host"

        return marked

    for graphs in runner.graphs:
        graphs.prepare = inside(graphs.prepare, "plan")
        graphs.replay = inside(graphs.replay, "replay")
    monkeypatch.setattr(triton_index, "launch_kv_indices", launch)  # eager plans' and passes'
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in eager]
    assert "replay" in launches, "no graph pass built its kv indices"
    assert "plan" not in launches, "a graph plan launched the kv-index kernel"


def test_a_pass_launched_at_a_commit_replays_after_the_commits_writes(monkeypatch):
    """Launching ahead with a device mirror of the table (CUDA's; forced here on CPU), the
    pass launched once a speculative step's pass commits (`Engine._launch_next`: a decode
    pass after a verify pass, a verify pass after either) replays its graph after the
    commit's table writes (a verify pass's accepted paths): tokens equal the eager path's
    and the mirror ends equal to the host table. With the proposer's drafts (a repeating
    prompt: paths accepted), and with drafts in turns whatever the model's tokens (every
    kind of launch on any device)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, *prompts_of(2)]
    eager = tiny_engine(speculative=True, draft_budget=4).generate(prompts, params)
    monkeypatch.setattr(RequestTable.__init__, "__defaults__", ("cpu", True))
    kinds = set()
    for in_turns in (False, True):
        # (not after a verify pass walked on the device: `test_walk_ahead.py`)
        engine = tiny_engine(speculative=True, draft_budget=4, launch_ahead=True, walk_ahead=False)
        if in_turns:
            draft_in_turns(engine, turn=4)
        table, runner = engine.book.table, engine.runner
        runner.graphs = graph_runners(runner.model, runner.backend, 4, 5, DEVICE == "cuda", table)
        real, launched, replays = engine._launch_next, [], count_replays(engine)

        def launch_next(verify, real=real, engine=engine, launched=launched, replays=replays):
            before = engine.ahead.launched
            real(verify)
            if engine.ahead.launched and not before:  # replayed at its launch: the last one
                launched.append((len(replays), engine.ahead.prepared.batch.mode))

        engine._launch_next = launch_next
        _replays_as_eager(engine, prompts, params, eager)
        assert all(replays[at - 1] == mode for at, mode in launched)
        kinds |= {(replays[at - 2], mode) for at, mode in launched}
    assert kinds >= {(Mode.VERIFY, Mode.DECODE), (Mode.VERIFY, Mode.VERIFY)}, kinds


def test_a_verify_pass_launched_ahead_replays_after_the_decode_pass_it_follows(monkeypatch):
    """`verify_ahead` with a device mirror of the table (CUDA's; forced here on CPU): the
    verify pass launched while a decode pass launched ahead runs replays the verify graph
    right after that decode replay, its roots' input ids copied from the decode pass's
    tokens on the device (`ahead.root_ids`): tokens equal the eager path's, the mirror ends
    equal to the host table, no slot is lost."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, *prompts_of(2)]
    eager = tiny_engine(speculative=True, draft_budget=4).generate(prompts, params)
    monkeypatch.setattr(RequestTable.__init__, "__defaults__", ("cpu", True))
    engine = tiny_engine(speculative=True, draft_budget=4, launch_ahead=True, verify_ahead=True)
    draft_in_turns(engine)  # verify passes launched ahead on any device
    table, runner = engine.book.table, engine.runner
    runner.graphs = graph_runners(runner.model, runner.backend, 4, 5, DEVICE == "cuda", table)
    real, launched = engine._verify_ahead, []

    def verify_ahead(*args):
        done = real(*args)
        if done:  # replayed at its launch: the last replay
            launched.append(len(replays))
        return done

    engine._verify_ahead = verify_ahead
    replays = count_replays(engine)
    _replays_as_eager(engine, prompts, params, eager)
    assert launched, "no verify pass was launched ahead"
    assert all(replays[at - 2 : at] == [Mode.DECODE, Mode.VERIFY] for at in launched)


def _replays_as_eager(engine: Engine, prompts: list, params: SamplingParams, eager: list) -> None:
    """`engine` (on graphs, with the table's device mirror) generates the tokens of the eager
    run `eager`; its mirror ends equal to the host table, no slot is lost."""
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens == [o.token_ids for o in eager]
    assert np.array_equal(engine.book.table.device.cpu().numpy(), engine.book.table.host)
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity


def test_the_collector_is_paused_while_graphs_capture() -> None:
    """`collection_paused` collects what is garbage on entry, runs no collection inside (the
    collector off), and restores the collector's state after, on an error too."""

    class Node:
        pass

    assert gc.isenabled()
    node = Node()
    node.self = node  # a cycle: only the collector frees it
    dead = weakref.ref(node)
    del node
    with collection_paused():
        assert dead() is None and not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs")
def test_graphs_capture_while_dead_engines_await_the_collector(monkeypatch) -> None:
    """Engines dropped in reference cycles hold CUDA graphs that only the collector frees; a
    graph's finalizer inside another's capture is refused ("operation not permitted when
    stream is capturing") and invalidates that capture. With the collector's automatic runs
    off until then, and a collection where each capture's forward runs (as the collector
    runs when an allocation crosses its threshold, if enabled), the engine captures its
    graphs and generates what an engine without graphs does."""
    thresholds = gc.get_threshold()
    gc.set_threshold(0)  # no automatic collection: the dead engines wait for the capture
    forward = GraphRunner._forward

    def collecting_forward(self, *args, **kwargs):
        if gc.isenabled() and torch.cuda.is_current_stream_capturing():
            gc.collect()
        return forward(self, *args, **kwargs)

    try:
        for _ in range(2):
            cycle: list = [with_graphs(tiny_engine(), 4)]
            cycle.append(cycle)
            del cycle
        monkeypatch.setattr(GraphRunner, "_forward", collecting_forward)
        engine = with_graphs(tiny_engine(), 4)
    finally:
        gc.set_threshold(*thresholds)
        monkeypatch.setattr(GraphRunner, "_forward", forward)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = prompts_of(3)
    assert [c.token_ids for c in engine.generate(prompts, params)] == [
        c.token_ids for c in tiny_engine().generate(prompts, params)
    ]
