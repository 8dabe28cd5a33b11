"""The original scenario: speculative verify on a batch larger than the largest captured
verify graph, for many rounds with real acceptance. Outputs equal non-speculative greedy and
every slot comes back. On CUDA this runs the Triton backend with captured graphs (and is run
under compute-sanitizer by scripts/gpu_suite.sh); on CPU, the torch backend."""

from __future__ import annotations

import os

import numpy as np
import torch

from engine.shell.engine import Engine
from engine.state import SamplingParams

CUDA = torch.cuda.is_available()
# The GPU suite runs this under memcheck twice: without torch's caching allocator (every
# allocation's bounds visible; graphs then run their static path uncaptured) and with it.
GRAPH_MAX_BATCH = int(os.environ.get("ENGINE_TEST_GRAPH_MAX_BATCH", "4"))
# A configured draft cost: the trees, and so the acceptance and step counts asserted, do not
# follow the machine's timings (a measured cost does; not what these tests are about).
DRAFT_COST = 0.1


def _engine(speculative: bool) -> Engine:
    return Engine(
        random_weights="tiny",
        dtype="float32",
        device="cuda" if CUDA else "cpu",
        attention_backend="triton" if CUDA else "torch",
        kv_cache_slots=4096,
        max_context=512,
        max_running_requests=16,
        cuda_graph_max_batch=GRAPH_MAX_BATCH,
        cuda_graph_max_tokens=0,  # decode and verify graphs: this file's subject (and time)
        speculative=speculative,
        draft_budget=12,
        draft_cost=DRAFT_COST,
    )


def test_verify_beyond_the_largest_graph_equals_greedy_and_frees_everything():
    count, longest = (12, 240) if CUDA else (8, 40)
    prompts = [
        [(5 * i + j % (2 + i % 5)) % 250 + 3 for j in range(6 + 7 * i)] for i in range(count)
    ]
    # Different lengths: the batch shrinks from 12 (> 4, eager) to below 4 (graphs).
    step = longest // (count + 1)
    params = [SamplingParams(max_tokens=longest - step * i, ignore_eos=True) for i in range(count)]
    plain = _engine(speculative=False).generate(prompts, params)
    spec_engine = _engine(speculative=True)
    spec = spec_engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    metrics = spec_engine.metrics()
    assert metrics["spec_accepted_tokens_total"] > 0
    if CUDA:
        assert metrics["spec_steps_total"] >= 100
    spec_engine.check()
    assert spec_engine.book.num_available == spec_engine.book.slots.capacity


def test_steps_without_any_draft_run_as_plain_decode(monkeypatch):
    prompts = [[3 + (7 * i + j * 13) % 240 for j in range(12)] for i in range(3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = _engine(speculative=False).generate(prompts, params)
    engine = _engine(speculative=True)
    zeros = lambda running, adaptive=None: np.zeros(len(running), np.int64)  # noqa: E731
    monkeypatch.setattr(engine.spec, "budgets", zeros)
    out = engine.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    modes = {mode for mode, _ in engine.step_times}
    assert "decode" in modes and "verify" not in modes
    assert engine.metrics()["spec_steps_total"] > 0
    engine.check()
