"""`benchmarks/bench_sampling.py`'s decode rate runs on any preset's vocabulary."""

from __future__ import annotations

from engine.shell.engine import Engine


def test_the_decode_rate_runs_on_a_small_vocabulary(bench_script):
    """The prompts' ids fit the model's vocabulary (`tiny` has 256 tokens; the prompts
    reached 257, which the engine refused)."""
    bench_sampling = bench_script("bench_sampling")
    engine = Engine(random_weights="tiny", device="cpu", max_running_requests=8)
    assert bench_sampling.decode_rate(engine, 8, 4, {"temperature": 1.0}) > 0
