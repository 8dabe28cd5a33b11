"""`benchmarks/bench_structured_host.py`'s stand-in for the model: the engine drives it as it
drives its own runner (the same `launch` call), so the script's tables measure the host."""

from __future__ import annotations

import pytest

from engine.shell.engine import Engine
from engine.state import SamplingParams


@pytest.fixture
def bench(bench_script):
    return bench_script("bench_structured_host")


@pytest.mark.parametrize("speculative", [False, True])
def test_the_copy_runner_serves_the_engines_passes(bench, speculative):
    """Each request emits its target, then ends at EOS: every pass the engine launched ran on
    the copy runner (before its launch took the engine's `shift`, every pass failed)."""
    engine = Engine(random_weights="tiny", device="cpu", speculative=speculative)
    runner = bench.CopyRunner(engine, {})
    engine.runner = runner
    target = [5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(max_tokens=16)
    request = engine.inbox.add([9, 10, 11], params, None, None)
    runner.targets[request.uid] = target
    while not request.done:
        engine.step()
    assert request.output_ids == [*target, engine.runtime.eos_id]
    # the prompt's pass gave the first token, a decode pass each after it; with speculation
    # a verify pass (its trees' rows) stands in for some of them
    assert runner.passes["extend"] == 1
    if speculative:
        assert runner.passes["verify"] > 0
    else:
        assert runner.passes["decode"] == len(target)
