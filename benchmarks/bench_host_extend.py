"""Host cost of the steps that run extend (prefill) passes: milliseconds per phase per step,
on the CPU with the tiny random model (the model's compute left out), for a batch of prompts
prefilled in chunk_size-token passes as on the GPU (64 prompts of 512 tokens, 8192-token
chunks, the prefix cache on). On a GPU this host work is where the device waits between two
extend passes.

Run: .venv/bin/python benchmarks/bench_host_extend.py [--batch 64] [--prompt-len 512]
     [--repeats 5] [--admitting] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np

from engine import Engine
from engine.state import SamplingParams

# (owner, method): the host phases between two extend passes (`profile_steps.PHASES`, and
# the parts of them that took time); each is timed whole, less the model's compute inside it
PHASES = (
    ("engine", "_admit"),
    ("engine", "_candidates"),
    ("book", "acquire"),
    ("engine", "_run_extend"),
    ("passes", "launch"),
    ("runner", "prepare"),
    ("engine", "_write_early"),
    ("engine", "_commit_pass"),
    ("engine", "_share_prefills"),
    ("book", "apply"),
    ("machine", "extend"),
    ("model", "forward"),  # the compute: left out of every other phase
)
COMPUTE = "model.forward"
HOST = "host (step - model)"
GAP = "host - prepare - early"


class Timers:
    """Time per phase, inclusive of nested phases but not of the model's compute."""

    def __init__(self) -> None:
        self.spent: MutableMapping[str, Any] = collections.Counter()  # label -> seconds
        self.compute = 0.0  # seconds in the model's forward, since start
        self.labels: list[str] = []  # the phases wrapped

    def wrap(self, owner: Any, name: str, label: str) -> None:
        method = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started, compute = time.perf_counter(), self.compute
            try:
                return method(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - started
                if label == COMPUTE:
                    self.compute += seconds
                    self.spent[label] += seconds
                else:
                    self.spent[label] += seconds - (self.compute - compute)

        setattr(owner, name, timed)


def build(batch: int, prompt_len: int, max_tokens: int, chunk_size: int) -> Engine:
    return Engine(
        random_weights="tiny",
        device="cpu",
        dtype="float32",
        max_running_requests=batch,
        max_context=prompt_len + max_tokens + 8,
        chunk_size=chunk_size,
        # as the GPU run's pool: far more slots than the batch needs
        kv_cache_slots=max(300_000, 2 * batch * (prompt_len + max_tokens)),
    )


def instrument(engine: Engine) -> Timers:
    timers = Timers()
    owners = {
        "engine": engine,
        "machine": engine.machine,
        "book": engine.book,
        "passes": engine.passes,
        "runner": engine.runner,
        "model": engine.runtime.model,
    }
    for owner, name in PHASES:
        target = owners[owner]
        if target is not None and hasattr(target, name):  # (a phase the commit lacks: none)
            timers.wrap(target, name, f"{owner}.{name}")
            timers.labels.append(f"{owner}.{name}")
    return timers


def extend_steps(
    engine: Engine,
    prompts: list,
    params: SamplingParams,
    timers: Timers | None,
    admitting: bool = False,
) -> list[MutableMapping[str, Any]]:
    """Submit `prompts`, step until none waits or prefills; each extend step's phase times
    (`admitting`: only the steps that began with prompts waiting, whose passes are full)."""
    for prompt in prompts:
        engine.submit(prompt, params)
    steps = []
    while engine.has_work:
        if timers is not None:
            timers.spent.clear()
        waiting = bool(engine.waiting) or not engine.inbox.empty
        started = time.perf_counter()
        engine.step()
        mode = engine.step_times[-1][0] if engine.step_times else "none"
        if mode != "extend" or (admitting and not waiting):
            if not engine.waiting and mode == "decode":
                break
            continue
        if timers is not None:
            spent: MutableMapping[str, Any] = collections.Counter(timers.spent)
            host = time.perf_counter() - started - spent[COMPUTE]
            spent[HOST] = host
            # what a GPU waits for: less the CPU backend's plan and the work done meanwhile
            spent[GAP] = host - spent["runner.prepare"] - spent["engine._write_early"]
            steps.append(spent)
    while engine.has_work:
        engine.step()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--admitting",
        action="store_true",
        help="only the steps that began with prompts waiting (the full passes)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the extend steps")
    args = parser.parse_args()
    engine = build(args.batch, args.prompt_len, args.max_tokens, args.chunk_size)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)

    def prompts() -> list:
        return rng.integers(3, 250, (args.batch, args.prompt_len)).tolist()

    extend_steps(engine, prompts(), params, None)  # warm-up: every code path once
    timers = instrument(engine)
    labels = [f"{o}.{n}" for o, n in PHASES if f"{o}.{n}" in timers.labels]
    labels += [HOST, GAP]
    rows: dict[str, list[float]] = collections.defaultdict(list)
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(args.repeats):
        if profiler is not None:
            profiler.enable()
        steps = extend_steps(engine, prompts(), params, timers, args.admitting)
        if profiler is not None:
            profiler.disable()
        for spent in steps:
            for label in labels:
                rows[label].append(spent[label] * 1e3)
    engine.check()
    median: Callable[[list[float]], float] = statistics.median
    print(
        f"{args.batch} prompts x {args.prompt_len} tokens, chunk {args.chunk_size}, "
        f"{len(rows[COMPUTE])} {'admitting ' if args.admitting else ''}extend steps over "
        f"{args.repeats} runs; ms per step, "
        "each phase with what it calls, less the model's compute"
    )
    print(f"{'phase':<26}{'median':>9}{'mean':>9}{'min':>9}{'max':>9}")
    for label in labels:
        values = rows[label]
        print(
            f"{label:<26}{median(values):>9.3f}{statistics.fmean(values):>9.3f}"
            f"{min(values):>9.3f}{max(values):>9.3f}"
        )
    print(
        "runner.prepare here is the CPU backend's plan (a GPU's backend plans otherwise); "
        f"engine._write_early runs while the device computes the pass; '{GAP}': the host "
        "step less those two"
    )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
