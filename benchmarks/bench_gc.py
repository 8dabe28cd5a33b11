"""What a full garbage collection costs the engine loop, with the process's start-up objects
tracked and frozen (`engine.shell.startup.freeze_startup_objects`, which `engine serve` calls).

A full (generation 2) collection scans every object the collector tracks and holds the thread
that triggered it, here the engine loop. The script builds an engine, serves a batch of
requests, then times `gc.collect()` (median of 5) before and after the freeze, and prints the
tracked objects beside each.

  .venv/bin/python benchmarks/bench_gc.py                  # the default model, on the CPU
  .venv/bin/python benchmarks/bench_gc.py --random tiny    # random weights of a preset
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from engine.shell.engine import Engine
from engine.shell.startup import freeze_startup_objects
from engine.state import SamplingParams


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--random", default=None, help="random weights of this preset")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    overrides = {"random_weights": args.random} if args.random else {}
    engine = Engine(device="cpu", **overrides)
    prompts = [f"Tell me about topic number {i}." for i in range(args.requests)]
    engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    rows = [("engine ready, requests served", len(gc.get_objects()), full_collection_ms())]
    frozen = freeze_startup_objects(engine)
    state = f"after the freeze ({frozen} frozen)"
    rows.append((state, len(gc.get_objects()), full_collection_ms()))
    engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    rows.append(("frozen, requests served again", len(gc.get_objects()), full_collection_ms()))
    print(f"\n{args.random or 'default model'}, {args.requests} requests of 16 tokens each")
    print("| state | tracked objects | full collection ms |")
    print("|---|---|---|")
    for state, tracked, ms in rows:
        print(f"| {state} | {tracked} | {ms:.1f} |")


if __name__ == "__main__":
    main()
