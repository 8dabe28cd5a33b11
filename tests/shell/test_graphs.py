"""The static (CUDA-graph) decode and verify path equals the eager path, padding included.

On CPU the graph runner runs its static-buffer path without capturing (capture=False), with
the Triton backend in the interpreter; on CUDA the same test captures real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import pdl
from engine.backends import triton_index
from engine.ops import gemv
from engine.shell.engine import Engine
from engine.shell.graphs import GraphRunner, default_batch_sizes
from engine.shell.kv import RequestTable
from engine.state import Mode, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(**overrides) -> Engine:
    return Engine(
        random_weights="tiny",
        attention_backend="triton",
        device=DEVICE,
        dtype="float32",
        kv_cache_slots=512,
        max_context=128,
        cuda_graph_max_batch=0,
        **overrides,
    )


def _prompts(count: int) -> list[list[int]]:
    # Repeating patterns, so the n-gram proposer finds drafts in the speculative case.
    return [[(7 * i + j % (3 + i)) % 250 + 3 for j in range(9 + 5 * i)] for i in range(count)]


def _count_replays(engine: Engine) -> list:
    """Every graph replay of `engine` appends its mode (proof the static path ran)."""
    replays: list = []
    for graph in engine.runner.graphs:
        real = graph.replay

        def replay(*args, real=real, mode=graph.mode):
            replays.append(mode)
            return real(*args)

        graph.replay = replay
    return replays


def _with_graphs(engine: Engine, max_batch: int, tree_nodes: int = 0) -> Engine:
    runner = engine.runner
    capture = DEVICE == "cuda"
    runner.graphs = [
        GraphRunner(runner.model, runner.backend, Mode.DECODE, max_batch, capture=capture)
    ]
    if tree_nodes:
        runner.graphs.append(
            GraphRunner(
                runner.model, runner.backend, Mode.VERIFY, max_batch, tree_nodes, capture=capture
            )
        )
    return engine


def test_batch_sizes_cover_every_batch_up_to_the_maximum():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(64)[-1] == 64


def test_each_graph_runs_under_the_pdl_setting_of_its_pass(monkeypatch):
    """Under `auto`, only the one-row decode pass of a model whose matrices all fit the
    one-row kernel runs with PDL (`top`); a mode set for the process applies to every pass."""
    runner = _engine().runner

    def settings(mode: Mode) -> dict:
        graphs = GraphRunner(runner.model, runner.backend, mode, 4, 3, capture=False)
        return graphs.pdl

    with pdl.using("auto"):
        assert settings(Mode.DECODE) == {1: "top", 2: "off", 4: "off"}
        assert settings(Mode.VERIFY) == {1: "off", 2: "off", 4: "off"}
        largest = max(w.numel() for w in runner.model.parameters() if w.dim() == 2)
        monkeypatch.setattr(gemv, "MAX_WEIGHT_ELEMENTS", largest - 1)  # one goes to cuBLAS
        assert settings(Mode.DECODE) == {1: "off", 2: "off", 4: "off"}
    with pdl.using("late"):
        assert settings(Mode.DECODE) == {1: "late", 2: "late", 4: "late"}
        assert settings(Mode.VERIFY) == {1: "late", 2: "late", 4: "late"}


def test_a_graph_pass_launches_under_its_setting(monkeypatch):
    """The static path's forward runs under the setting chosen for its batch size; the
    eager (extend) passes under the process's. Uncaptured, so that each pass runs the
    forward (a captured graph keeps the launches of its capture)."""
    engine = _engine()
    runner = engine.runner
    graphs = GraphRunner(runner.model, runner.backend, Mode.DECODE, 4, capture=False)
    runner.graphs = [graphs]
    graphs.pdl = {size: "late" if size == 1 else "exit" for size in graphs.sizes}
    seen = []
    model_forward = graphs.model.forward

    def forward(input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], pdl._state["setting"]))
        return model_forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(graphs.model, "forward", forward)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with pdl.using("auto"):  # the process's setting, whatever ENGINE_PDL says
        engine.generate(_prompts(1), params)
        engine.generate(_prompts(3), params)
    tokens_under = {setting: {n for n, s in seen if s == setting} for setting in ("late", "exit")}
    assert tokens_under == {"late": {1}, "exit": {4}}  # 3 requests padded to 4
    assert {s for _, s in seen} == {"late", "exit", "auto"}  # extend passes: the process's


@pytest.mark.parametrize("speculative", [False, True])
def test_graph_path_equals_eager_path_with_padding_and_overflow(speculative):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts(3)  # 3 requests: padded to 4 in graph mode
    eager = _engine(speculative=speculative, draft_budget=4).generate(prompts, params)
    graphed = _with_graphs(
        _engine(speculative=speculative, draft_budget=4), 4, tree_nodes=5 if speculative else 0
    )
    replays = _count_replays(graphed)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [o.token_ids for o in eager]
    assert replays, "no pass took the graph path"
    # More requests than the largest graph: those steps take the eager path.
    overflow = _with_graphs(
        _engine(speculative=speculative, draft_budget=4), 2, tree_nodes=5 if speculative else 0
    )
    overflow_replays = _count_replays(overflow)
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
    prompts = _prompts(3)
    eager = _engine(speculative=True, draft_budget=4).generate(prompts, params)
    monkeypatch.setattr(RequestTable.__init__, "__defaults__", ("cpu", True))
    engine = _engine(speculative=True, draft_budget=4)
    table, runner = engine.book.table, engine.runner
    assert table.mirrored and runner.table is table
    capture = DEVICE == "cuda"
    runner.graphs = [
        GraphRunner(runner.model, runner.backend, Mode.DECODE, 4, capture=capture, table=table),
        GraphRunner(runner.model, runner.backend, Mode.VERIFY, 4, 5, capture=capture, table=table),
    ]
    assert [graph.applies_writes for graph in runner.graphs] == [False, True]
    assert table.deferring
    staged: list[int] = []
    verify_graph = runner.graphs[1]
    real_stage = verify_graph._stage_writes

    def stage(writes):
        end = real_stage(writes)
        staged.append(int(writes[0]))
        return end

    monkeypatch.setattr(verify_graph, "_stage_writes", stage)
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
    replays = _count_replays(engine)
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
    prompts = _prompts(3)
    eager = _engine(speculative=speculative, draft_budget=4).generate(prompts, params)
    engine = _engine(speculative=speculative, draft_budget=4)
    runner = engine.runner
    runner.graphs = [GraphRunner(runner.model, runner.backend, Mode.DECODE, 4, capture=False)]
    if speculative:
        runner.graphs.append(
            GraphRunner(runner.model, runner.backend, Mode.VERIFY, 4, 5, capture=False)
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
