"""What a serving process does once its engine is ready (`engine.shell.startup`): the warm-up,
and the freeze, which lives in the shell so that what imports it (`profile_steps.py`,
`bench_gc.py`) runs where the server's packages are not installed (the GPU image has no
uvicorn or FastAPI)."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoServerPackages(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("uvicorn", "fastapi", "starlette"):
                raise ImportError(f"{name} is not installed here")
            return None

    sys.meta_path.insert(0, NoServerPackages())
    sys.path.insert(0, "benchmarks")
    import profile_steps, bench_gc  # noqa: F401
    from engine.shell.startup import freeze_startup_objects  # noqa: F401
    print("imported")
    """
)


def test_the_benchmarks_that_freeze_import_without_the_server_packages():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("imported")


def test_warm_up_runs_greedy_and_sampled_requests_and_leaves_the_engine_as_it_found_it():
    from engine.shell.engine import Engine
    from engine.shell.startup import WARM_UP_PROMPT, warm_up
    from engine.state import SamplingParams

    engine = Engine(random_weights="tiny", device="cpu", speculative=True)
    free = engine.book.num_available
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, params: (
        calls.append((prompts, params)) or generate(prompts, params)
    )
    warm_up(engine)
    greedy, sampled = calls
    prompt = [t % engine.runtime.vocab_size for t in WARM_UP_PROMPT]
    assert greedy[0] == [prompt, prompt[1:] + prompt[:1]]
    assert [p.greedy for p in greedy[1]] == [True, True]
    assert [p.max_tokens for p in greedy[1]] == [8, 6]  # one leaves before the other
    assert sampled[0] == [prompt[::-1]] and not sampled[1].greedy
    assert not engine.has_work and not engine.stats
    assert engine.book.num_available == free  # its prompts' slots: cached, evictable
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids


def test_warm_up_takes_a_pass_launched_ahead_without_a_request_that_left(monkeypatch):
    """The gather of a launched pass's rows (`Launched.select`) runs once in the warm-up:
    its first use in a CUDA process held the device 10-19 ms (`profile_steps.py`)."""
    from engine.shell import logits
    from engine.shell.engine import Engine
    from engine.shell.startup import warm_up

    engine = Engine(random_weights="tiny", device="cpu", launch_ahead=True)
    taken = []
    select = logits.Launched.select
    monkeypatch.setattr(
        logits.Launched, "select", lambda self, rows: taken.append(len(rows)) or select(self, rows)
    )
    warm_up(engine)
    assert taken == [1]  # the longer request's row, once the shorter left


def test_warm_up_runs_the_products_on_one_cuda_device_only(monkeypatch):
    from engine.model.llama import LlamaModel
    from engine.shell import startup
    from engine.shell.engine import Engine
    from engine.shell.runner import TOKEN_ALIGN
    from engine.shell.startup import warm_up

    warmed = []
    monkeypatch.setattr(
        LlamaModel, "warm_products", lambda self, counts, rows: warmed.append((counts, rows))
    )
    engine = Engine(random_weights="tiny", device="cpu", chunk_size=100, max_running_requests=5)
    warm_up(engine)
    assert warmed == []  # the CPU has no library kernels to load
    monkeypatch.setattr(engine, "generate", lambda prompts, params: None)  # CUDA from here
    monkeypatch.setattr(engine.runtime, "device", torch.device("cuda"))
    gathers = []
    monkeypatch.setattr(startup, "warm_row_gathers", lambda *args: gathers.append(args))
    warm_up(engine)
    assert gathers == [(torch.device("cuda"), engine.runtime.vocab_size, 5)]
    ((counts, rows),) = warmed
    # every padded token count of a pass: up to the budget and a decode per request
    assert list(counts) == list(range(TOKEN_ALIGN, 105 + TOKEN_ALIGN, TOKEN_ALIGN))
    assert list(rows) == [1, 2, 3, 4, 5]
    warmed.clear()
    monkeypatch.setattr(
        engine, "config", attrs.evolve(engine.config, speculative=True, draft_budget=30)
    )
    warm_up(engine)
    assert max(warmed[0][0]) == 160  # 5 trees of 31 nodes: 155 tokens, padded


def test_warm_up_fits_a_small_context():
    from engine.shell.engine import Engine
    from engine.shell.startup import warm_up

    for max_context in (2, 12):
        engine = Engine(random_weights="tiny", device="cpu", max_context=max_context)
        warm_up(engine)
        assert not engine.has_work


def test_warm_up_refuses_an_engine_with_work_and_loses_none_of_it():
    from engine.shell.engine import Engine
    from engine.shell.startup import warm_up
    from engine.state import SamplingParams

    engine = Engine(random_weights="tiny", device="cpu")
    sink: queue.SimpleQueue = queue.SimpleQueue()
    engine.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), sink=sink)
    with pytest.raises(RuntimeError, match="already has requests"):
        warm_up(engine)
    while engine.has_work:
        engine.step()
    deltas = []
    while not sink.empty():
        deltas.append(sink.get())
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 3


def test_warm_row_gathers_runs_the_gathers_of_a_launched_pass_at_every_kept_count(monkeypatch):
    from engine.shell import logits

    taken = []
    take = logits._take_rows
    monkeypatch.setattr(
        logits,
        "_take_rows",
        lambda index, *ts: (
            taken.append((index.tolist(), [tuple(t.shape) for t in ts])) or take(index, *ts)
        ),
    )
    logits.warm_row_gathers(torch.device("cpu"), 7, 4)
    assert taken == [
        ([0], [(2, 7), (2,)]),
        ([0, 1], [(3, 7), (3,)]),
        ([0, 1, 2], [(4, 7), (4,)]),
    ]
