"""Where a speculative step's time goes on the host: the engine with random weights, with and
without speculation, per kind of step, and per stage of the speculative step (the proposer,
the budgets, the statistics, the verify walk, the transition, the cost fit). With a small
model on a GPU a step is mostly host work; on a CPU the `tiny` preset shows the same.

Run: .venv/bin/python benchmarks/bench_spec_host.py   (CPU: the `tiny` preset)
     python3 benchmarks/bench_spec_host.py   (GPU: `smollm2_135m`, the default model's shape)

Two regimes, batch 1 and 8, `--tokens` tokens a request: greedy (a random model repeats
itself: drafts are accepted, most steps verify) and sampled at temperature 1 (little
repeats: most steps draft nothing).

The last table is each kind of step's host time: its wall time less the time spent in the
model's forward (and logits) calls, median over the run. On a CPU that is the host's own
work (scheduling, planning, inputs, sampling, commit, outputs); on a GPU the model's calls
only launch (or a CUDA graph replays without them) and a step also waits for its tokens, so
there it is not the host's work alone.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from typing import Any

import numpy as np
import torch

from engine.shell import speculator
from engine.shell.engine import Engine
from engine.shell.passes import Passes
from engine.spec import NgramProposer, PassCost, SpecStats
from engine.state import SamplingParams

# (owner, attribute, label): the stages timed, each its own calls' wall time
STAGES = [
    (speculator.Speculator, "budgets", "budgets"),
    (NgramProposer, "draft_batch", "draft_batch"),
    (SpecStats, "record_batch", "stats.record_batch"),
    (speculator.Speculator, "extend", "history extend"),
    (speculator.Speculator, "_verify", "verify walk (+ argmax fetch)"),
    (PassCost, "observe", "cost.observe"),
    (PassCost, "fit", "cost.fit"),
    (Engine, "_commit", "commit (transition effects)"),
    (Engine, "_decode_step", "decode step (whole)"),
    (Passes, "forward", "verify forward (whole)"),
]
STATE_FUNCS = ["schedule_verify", "verify"]  # engine.state functions the speculator calls


class Timers:
    """Wraps the stages' functions; `totals[label]` = (calls, seconds) while enabled."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        self.on = False
        for owner, name, label in STAGES:
            setattr(owner, name, self._wrap(getattr(owner, name), label))
        for name in STATE_FUNCS:
            setattr(
                speculator.state, name, self._wrap(getattr(speculator.state, name), f"state.{name}")
            )

    def _wrap(self, function: Any, label: str) -> Any:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                entry = self.totals[label]
                entry[0] += 1
                entry[1] += time.perf_counter() - started

        return timed


class HostClock:
    """Each step's wall time less the time its engine spent in the model's forward and
    logits calls: `steps[engine]` = [(mode, host seconds)] while `on`."""

    def __init__(self, engines: list[Engine]) -> None:
        self.forward_seconds = 0.0
        self.on = False
        self.steps: dict[Engine, list[tuple[str, float]]] = collections.defaultdict(list)
        for engine in engines:
            model = engine.runtime.model  # the runner's
            # the model's calls timed, to be taken from the step's
            model.forward = self._forward(model.forward)  # type: ignore[method-assign]
            model.logits = self._forward(model.logits)  # type: ignore[method-assign]
        step = Engine.step

        @functools.wraps(step)
        def timed_step(engine: Engine) -> None:
            if not self.on:
                return step(engine)
            last = engine.step_times[-1] if engine.step_times else None
            started, forward = time.perf_counter(), self.forward_seconds
            step(engine)
            seconds = time.perf_counter() - started - (self.forward_seconds - forward)
            if engine.step_times and engine.step_times[-1] is not last:  # it ran a pass
                self.steps[engine].append((engine.step_times[-1][0], seconds))

        Engine.step = timed_step  # type: ignore[method-assign, assignment]

    def _forward(self, function: Any) -> Any:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.forward_seconds += time.perf_counter() - started

        return timed


def run_once(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    timers: Timers | None,
    clock: HostClock | None = None,
) -> tuple[float, int, dict[str, list[float]], dict[str, list[float]]]:
    """Seconds, tokens, and each kind of step's wall times and host times (`HostClock`)."""
    engine.step_times.clear()
    if timers is not None:
        timers.on = True
    if clock is not None:
        clock.steps[engine].clear()
        clock.on = True
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    if timers is not None:
        timers.on = False
    modes: dict[str, list[float]] = collections.defaultdict(list)
    for mode, step_seconds in engine.step_times:
        modes[mode].append(step_seconds)
    host: dict[str, list[float]] = collections.defaultdict(list)
    if clock is not None:
        clock.on = False
        for mode, step_seconds in clock.steps[engine]:
            host[mode].append(step_seconds)
    return seconds, sum(len(o.token_ids) for o in outputs), modes, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset",
        default=None,
        help="random weights (default: smollm2_135m on a GPU, tiny on a CPU)",
    )
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.preset is None:
        args.preset = "tiny" if args.device == "cpu" else "smollm2_135m"
    common = dict(random_weights=args.preset, device=args.device, max_running_requests=8)
    if args.device != "cpu":
        common["kv_cache_slots"] = 16384  # two engines share the GPU
    engines = {
        "plain": Engine(speculative=False, **common),
        "spec": Engine(speculative=True, **common),
    }
    timers = Timers()
    clock = HostClock(list(engines.values()))
    vocab = engines["plain"].runtime.vocab_size
    rng = np.random.default_rng(0)
    regimes = {
        "greedy": SamplingParams(max_tokens=args.tokens, ignore_eos=True),
        "sampled": SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=1),
    }
    rows, stage_rows, host_rows = [], [], []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [rng.integers(3, vocab, 48).tolist() for _ in range(batch)]
        for regime, params in regimes.items():
            results, host = {}, {}
            for name, engine in engines.items():  # warm up every kind of step, then time
                run_once(engine, prompts, params, None)
                host[name] = run_once(engine, prompts, params, None, clock)[3]  # no stage timers
                results[name] = run_once(
                    engine, prompts, params, timers if name == "spec" else None
                )
            (plain_s, plain_n, plain_modes, _), (spec_s, spec_n, spec_modes, _) = (
                results["plain"],
                results["spec"],
            )
            host_rows.append((batch, regime, _median_ms(host["plain"]), _median_ms(host["spec"])))
            rows.append(
                (
                    batch,
                    regime,
                    plain_n / plain_s,
                    spec_n / spec_s,
                    _modes(plain_modes),
                    _modes(spec_modes),
                )
            )
            for label, (calls, seconds) in sorted(timers.totals.items()):
                stage_rows.append((batch, regime, label, int(calls), 1e3 * seconds / calls))
            timers.totals.clear()
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"\nrandom weights {args.preset}, {device}, {args.tokens} tokens a request\n")
    print("| batch | regime | stage | calls | ms a call |")
    print("|---|---|---|---|---|")
    for batch, regime, label, calls, ms in stage_rows:
        print(f"| {batch} | {regime} | {label} | {calls} | {ms:.3f} |")
    print(
        "\n| batch | regime | plain tok/s | spec tok/s | spec/plain | plain steps (ms) | "
        "spec steps (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for batch, regime, plain_rate, spec_rate, plain_steps, spec_steps in rows:
        print(
            f"| {batch} | {regime} | {plain_rate:.0f} | {spec_rate:.0f} | "
            f"{spec_rate / plain_rate:.2f}x | {plain_steps} | {spec_steps} |"
        )
    print("\nhost time a step (its wall time less the model's forward and logits calls):\n")
    print("| batch | regime | plain steps, host (ms) | spec steps, host (ms) |")
    print("|---|---|---|---|")
    for batch, regime, plain, spec in host_rows:
        print(f"| {batch} | {regime} | {plain} | {spec} |")


def _median_ms(modes: dict[str, list[float]]) -> str:
    return ", ".join(
        f"{mode} {1e3 * statistics.median(v):.3f} x{len(v)}" for mode, v in sorted(modes.items())
    )


def _modes(modes: dict[str, list[float]]) -> str:
    return ", ".join(
        f"{mode} {1e3 * statistics.mean(v):.3f} x{len(v)}" for mode, v in sorted(modes.items())
    )


if __name__ == "__main__":
    main()
