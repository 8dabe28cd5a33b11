"""Replaying a scheduler trace against running the engine that recorded it.

    python benchmarks/bench_replay.py                              # default model, CPU
    python benchmarks/bench_replay.py --random-weights tiny        # the tiny random model

Each workload runs once with `trace_path` set (the run's time is its steps, recording
included, after a warm-up request), then `engine.shell.replay.replay_file` replays the file
(no model, no device; every transition, effect and `KVBook.check` after every step). Prompts
are random token ids (seeded), `ignore_eos`. The workloads: (plain) a batch of requests
decoding; (spec) copy-heavy prompts with n-gram speculation; (pressure) a pool small enough
that requests are retracted and cached prefixes evicted, with a shared system prompt and
speculation. The table gives what each run went through (verify passes, retractions, cached
slots evicted), both times and their ratio.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import tempfile
import time

import numpy as np

from engine import Engine
from engine.shell.replay import replay_file


def prompts(kind: str, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "spec":  # a window repeated: the n-gram proposer drafts from it
        return [rng.integers(3, 250, size=max(length // 4, 4)).tolist() * 4 for _ in range(count)]
    if kind == "pressure":
        system = rng.integers(3, 250, size=length // 2).tolist()
        return [system + rng.integers(3, 250, size=length // 2).tolist() for _ in range(count)]
    return [rng.integers(3, 250, size=length).tolist() for _ in range(count)]


def run(args: argparse.Namespace, kind: str, path: str) -> tuple[float, int]:
    """Record one workload to `path`; returns the run's seconds and its engine steps."""
    options = dict(device="cpu", dtype="float32", trace_path=path, random_seed=0)
    if args.random_weights:
        options["random_weights"] = args.random_weights
    if kind != "plain":
        options["speculative"] = True
    if kind == "pressure":
        options["kv_cache_slots"] = args.requests * (args.prompt_tokens + args.max_tokens) // 4
    engine = Engine(args.model, **options)
    engine.generate([[5, 6, 7]], dict(max_tokens=2))  # warm-up (recorded too, replayed too)
    batch = prompts(kind, args.requests, args.prompt_tokens, seed=1)
    for prompt in batch:
        engine.submit(prompt, dict(max_tokens=args.max_tokens, ignore_eos=True))
    started, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return time.perf_counter() - started, steps


def counts(path: str) -> str:
    """What the run went through: verify passes, retractions, evicted slots, aborts."""
    ops: collections.Counter = collections.Counter()
    with open(path) as lines:
        next(lines)
        for line in lines:
            record = json.loads(line)
            ops[record["op"]] += 1
            ops["evicted"] += record.get("evicted", 0)
    return f"{ops['verify']} / {ops['retract']} / {ops['evicted']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--random-weights", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workloads", default="plain,spec,pressure")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {commit}")
    print(f"# model: {args.random_weights or args.model or 'default'}, {args.requests} requests")
    print(
        "| workload | engine steps | verify / retract / evicted | run (s) | trace records "
        "| replay (s) | replay faster |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.workloads.split(","):
            path = os.path.join(folder, f"{kind}.jsonl")
            seconds, steps = run(args, kind, path)
            report = replay_file(path)
            print(
                f"| {kind} | {steps} | {counts(path)} | {seconds:.2f} | {report.steps} | "
                f"{report.seconds:.3f} | {seconds / report.seconds:.1f}x |"
            )


if __name__ == "__main__":
    main()
