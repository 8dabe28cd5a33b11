"""The host's own work per decode step, this tree's engine against another commit's, stepped
in lockstep in one process (CPU, `tiny` random weights, the model stubbed out).

    .venv/bin/python benchmarks/bench_host_step.py --baseline d04f8de [--rounds 5]
    .venv/bin/python benchmarks/bench_host_step.py            # this tree alone

With a small model on a GPU a decode step is mostly host work (scheduling, planning the next
pass, sampling inputs, the commit, outputs), so that work decides its speed. On a shared
machine a process's speed moves by tens of percent from one run to the next, more than the
changes this measures; so both engines run in one process, their steps interleaved (each
round alternating which goes first), and the ratio is taken round by round.

The model's forward returns at once and its logits are rows of a fixed random table, so a
step's time is the host's; the time inside them is subtracted anyway. The baseline's
`engine` package is read from git (`git archive`) and imported as `engine_base` (its
imports rewritten). Regimes: greedy, sampled at temperature 1 (seeded), and sampled with
n-gram speculation (most steps draft nothing); batch 1 and 8; each prints both engines'
median decode-step time per round, their ratio, and whether they emitted the same tokens.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
REGIMES = {
    "greedy": dict(speculative=False, sampled=False),
    "sampled": dict(speculative=False, sampled=True),
    "speculative, sampled": dict(speculative=True, sampled=True),
}


def baseline_package(commit: str, into: Path) -> str:
    """`engine` at `commit`, unpacked under `into` as the package `engine_base`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "engine"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "engine").rename(into / "engine_base")
    renamed = re.compile(r"\b(from|import) engine\b|(?<=[\"'])engine(?=\.)")
    for path in (into / "engine_base").rglob("*.py"):
        text = path.read_text()
        path.write_text(renamed.sub(lambda m: m.group(0).replace("engine", "engine_base"), text))
    sys.path.insert(0, str(into))
    return "engine_base"


class StubbedModel:
    """Wraps an engine's model: a forward that returns at once, logits from a fixed table;
    `seconds` counts the time spent inside both."""

    def __init__(self, engine, table: torch.Tensor) -> None:
        model = engine.runner.model
        self.seconds, self.calls = 0.0, 0

        def forward(input_ids, *rest):
            started = time.perf_counter()
            out = torch.zeros(input_ids.shape[0], 1)
            self.seconds += time.perf_counter() - started
            return out

        def logits(hidden):
            started = time.perf_counter()
            self.calls += 1
            start = (self.calls * 7) % (table.shape[0] - hidden.shape[0])
            out = table[start : start + hidden.shape[0]]
            self.seconds += time.perf_counter() - started
            return out

        model.forward, model.logits = forward, logits


def run_regime(packages: dict, batch: int, regime: dict, tokens: int, rounds: int) -> dict:
    engines, stubs, params = {}, {}, {}
    for name, package in packages.items():
        engine_module = importlib.import_module(f"{package}.shell.engine")
        state = importlib.import_module(f"{package}.state")
        engines[name] = engine_module.Engine(
            random_weights="tiny",
            device="cpu",
            max_running_requests=8,
            speculative=regime["speculative"],
        )
        sampled = dict(temperature=1.0, seed=1) if regime["sampled"] else {}
        params[name] = state.SamplingParams(max_tokens=tokens, ignore_eos=True, **sampled)
    vocab = next(iter(engines.values())).runtime.vocab_size
    table = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))
    stubs = {name: StubbedModel(engine, table) for name, engine in engines.items()}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, 48).tolist() for _ in range(batch)]
    for name, engine in engines.items():  # warm-up
        engine.generate(prompts, params[name])
    medians: dict = {name: [] for name in engines}
    outputs: dict = {}
    for round_ in range(rounds):
        requests = {
            name: [engine.inbox.add(ids, params[name], None, None) for ids in prompts]
            for name, engine in engines.items()
        }
        times: dict = {name: [] for name in engines}
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        while not all(r.done for name in engines for r in requests[name]):
            for name in order:
                engine, stub = engines[name], stubs[name]
                if all(r.done for r in requests[name]):
                    continue
                stub.seconds = 0.0
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
                if engine.step_times[-1][0] == "decode":
                    times[name].append(elapsed - stub.seconds)
        for name in engines:
            medians[name].append(statistics.median(times[name]) * 1e6)
            outputs[name] = [r.output_ids for r in requests[name]]
    return dict(medians=medians, same=len({str(o) for o in outputs.values()}) == 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", help="a commit whose engine runs beside this tree's")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=400, help="new tokens a request")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        packages = {"this tree": "engine"}
        if args.baseline:
            packages = {args.baseline: baseline_package(args.baseline, Path(scratch))} | packages
        names = list(packages)
        print(f"host time a decode step (us, median per round; {args.rounds} rounds)")
        header = " | ".join(f"{name} (us)" for name in names)
        ratio = f" | {names[1]} / {names[0]} |" if len(names) == 2 else " |"
        print(f"\n| batch | regime | {header}{ratio} same tokens |")
        print("|---|---|" + "---|" * (len(names) + (len(names) == 2) + 1))
        for batch in (int(b) for b in args.batches.split(",")):
            for regime_name, regime in REGIMES.items():
                result = run_regime(packages, batch, regime, args.tokens, args.rounds)
                meds = result["medians"]
                cells = [f"{min(meds[n]):.0f}-{max(meds[n]):.0f}" for n in names]
                if len(names) == 2:
                    old, new = meds[names[0]], meds[names[1]]
                    ratios = [n / o for o, n in zip(old, new, strict=True)]
                    cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}")
                print(
                    f"| {batch} | {regime_name} | " + " | ".join(cells) + f" | {result['same']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
