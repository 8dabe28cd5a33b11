"""Decoding under a busy neighbour (issue 16, item 6): the engine and HF transformers `generate`,
idle and with one busy process beside them, side by side in one run.

    python benchmarks/bench_contention.py [--tokens 64] [--reps 3] [--neighbours 1]

Default model, greedy, fp32, batch 1. Systems: `engine fixed` (torch's thread count, the
kernels' too, as set: the CPU count), `engine gov` (each step inside a
`cpu_kernels.ThreadGovernor`'s `threads()`: that count cut to the CPUs others leave free; the
engine's own governor where it has one, `Engine.cpu_threads`) and `HF`. The
neighbour is a pure-Python busy loop (one process per --neighbours, pinned to nothing) that
this script starts and stops, and that stops itself after --neighbour-limit seconds anyway.
The systems take turns, one generate each, --reps times per phase (a system past --budget
seconds in a phase sits the rest out); the table gives the median tokens/s (prefill included,
as `engine generate` would see it). `others` is the CPU (in CPUs)
that processes other than this one and its neighbour took during the phase: anything well
above 0 means the machine was not otherwise idle and the row measured that too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch

from engine import Engine, SamplingParams, cpu_kernels
from engine.model import default_model_path

if TYPE_CHECKING:  # transformers is imported only where HF runs
    from transformers import GenerationMixin

BUSY = (
    "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"
)
PROMPT = [{"role": "user", "content": "Write a short story about the sea."}]


def cpu_seconds_of(pid: int) -> float:
    """utime + stime of a process (its threads together), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:  # it has ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Others:
    """CPUs' worth of time taken by processes other than this one and `exclude` while the
    context is open."""

    def __init__(self, exclude: list[int]) -> None:
        self.exclude, self.value = exclude, float("nan")

    def _read(self) -> tuple[float, float]:
        every = set(range(os.cpu_count() or 1))
        mine = cpu_seconds_of(os.getpid()) + sum(cpu_seconds_of(p) for p in self.exclude)
        return cpu_kernels._busy_seconds(every) - mine, time.monotonic()

    def __enter__(self) -> Others:
        self._start = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        (busy, at), (busy0, at0) = self._read(), self._start
        self.value = max(0.0, (busy - busy0) / (at - at0))


def engine_system(engine: Engine, ids: list[int], governed: bool):
    """The engine's generate with a governor around each step, or with torch's count as it is.
    An engine that governs its own steps (`Engine.cpu_threads`) keeps its governor or has it
    off; one that does not gets `ThreadGovernor().threads()` around its steps here."""
    own = getattr(engine, "cpu_threads", None)
    governor = own or cpu_kernels.ThreadGovernor()

    def step() -> None:
        with governor.threads():
            Engine.step(engine)

    def generate(tokens: int) -> int:
        if own is not None:
            engine.cpu_threads = own if governed else None
        elif governed:
            # the instance's steps only; Engine.generate calls self.step
            engine.step = step  # type: ignore[method-assign]
        try:
            out = engine.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
        finally:
            engine.__dict__.pop("step", None)
            if own is not None:
                engine.cpu_threads = own
        return len(out[0].token_ids)

    return generate, governor


def hf_system(model: GenerationMixin, ids: list[int], pad: int):
    input_ids = torch.tensor([ids])

    def generate(tokens: int) -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=pad,
            )
        return out.shape[1] - input_ids.shape[1]

    return generate


def phase(
    systems: dict, tokens: int, reps: int, exclude: list[int], budget: float
) -> tuple[dict, float]:
    """Median tokens/s per system, the systems taking turns; and the others' CPU use. A
    system that has taken `budget` seconds in the phase is not run again (the run's bound)."""
    speeds: dict[str, list[float]] = {name: [] for name in systems}
    spent = dict.fromkeys(systems, 0.0)
    with Others(exclude) as others:
        for _ in range(reps):
            for name, generate in systems.items():
                if spent[name] >= budget:
                    continue
                started = time.perf_counter()
                made = generate(tokens)
                seconds = time.perf_counter() - started
                spent[name] += seconds
                speeds[name].append(made / seconds)
    return {name: statistics.median(v) for name, v in speeds.items()}, others.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--neighbours", type=int, default=1)
    parser.add_argument(
        "--budget",
        type=float,
        default=15.0,
        help="seconds per system and phase after which it is not repeated",
    )
    parser.add_argument(
        "--neighbour-limit",
        type=float,
        default=240.0,
        help="seconds after which a neighbour stops by itself",
    )
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()

    load = os.getloadavg()
    cpus = sorted(os.sched_getaffinity(0))
    print(
        f"{len(cpus)} CPUs usable of {os.cpu_count()}; load average before loading "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; torch threads {torch.get_num_threads()}; "
        f"kernels: {cpu_kernels.status().reason}"
    )
    with Others([]) as before:
        time.sleep(1.0)
    print(f"others' CPU use over 1 s before starting: {before.value:.2f} CPUs")

    engine = Engine(device="cpu", dtype="float32")
    tokenizer = engine.tokenizer
    assert tokenizer is not None and tokenizer.eos_token_id is not None  # the default model's
    ids = tokenizer.apply_chat_template(PROMPT)
    systems = {"engine fixed": engine_system(engine, ids, False)[0]}
    systems["engine gov"], governor = engine_system(engine, ids, True)
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        systems["HF"] = hf_system(model, ids, tokenizer.eos_token_id)
    for generate in systems.values():  # warm-up: kernels built, first-call costs paid
        generate(4)

    idle, idle_others = phase(systems, args.tokens, args.reps, [], args.budget)
    neighbours = [
        subprocess.Popen([sys.executable, "-c", BUSY, str(args.neighbour_limit)])
        for _ in range(args.neighbours)
    ]
    try:
        time.sleep(0.3)  # running before the first pass
        busy, busy_others = phase(
            systems, args.tokens, args.reps, [p.pid for p in neighbours], args.budget
        )
        chosen = governor.choose(torch.get_num_threads())
        print(f"governor under load: others {governor.others:.2f} CPUs -> {chosen} thread(s)")
    finally:
        for p in neighbours:
            p.kill()
            p.wait()

    print(
        f"\n{args.tokens} tokens, batch 1, greedy, fp32, median of {args.reps}; "
        f"{args.neighbours} busy neighbour(s) in the busy phase"
    )
    print(
        f"others' CPU use (not this process, not the neighbour): idle phase "
        f"{idle_others:.2f} CPUs, busy phase {busy_others:.2f} CPUs"
    )
    print(
        f"{'system':<14}{'idle tok/s':>12}{'busy tok/s':>12}{'busy/idle':>11}"
        + (f"{'busy/HF busy':>14}" if "HF" in systems else "")
    )
    for name in systems:
        line = f"{name:<14}{idle[name]:>12.1f}{busy[name]:>12.1f}{busy[name] / idle[name]:>11.2f}"
        if "HF" in systems:
            line += f"{busy[name] / busy['HF']:>14.2f}"
        print(line)


if __name__ == "__main__":
    main()
