"""The n-gram proposer's cost a draft tree on the host, per kind of token stream: one token
repeated, an indentation-like pattern, a document repeated, random text, a small-vocabulary
Zipf stream; beside it (`--trie REV`) the trie-based proposer of git revision REV, or
(`--baseline REV`) the proposer of git revision REV's whole `engine` package.

Run: .venv/bin/python benchmarks/bench_spec_proposer.py [--tokens 3000] [--steps 200]
     [--budget 12] [--trie 0bdfc9e | --baseline f1d5e26]

Each stream's first `tokens - steps` tokens are the prompt; then each of the last `steps`
tokens is added (not timed) and a tree proposed from the whole history (timed), as a
decoding request does. The table shows the median of `--repeats` such runs, us a call; the
proposers step in lockstep in one process, taking turns at going first (a shared machine's
speed moves between processes, and within one).
With `--baseline` the baseline's `engine` is read from git (`git archive`) and imported as
`engine_base` (as `bench_host_step.py` does), the trees of both are checked equal, and the
last column is this tree's time over the baseline's, run by run (range).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_host_step import baseline_package  # benchmarks/, beside this script

from engine.spec import NgramProposer, SpecConfig

ROOT = Path(__file__).resolve().parent.parent


def streams(tokens: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    document = rng.integers(0, 50_000, 60).tolist()
    ranks = np.arange(1, 501)
    zipf = rng.choice(500, size=tokens, p=(1 / ranks) / (1 / ranks).sum()).tolist()
    return {
        "one token repeated": [7] * tokens,
        "indentation [1 1 1 1 2]*": ([1, 1, 1, 1, 2] * tokens)[:tokens],
        "60-token document repeated": (document * tokens)[:tokens],
        "random (vocab 50k)": rng.integers(0, 50_000, tokens).tolist(),
        "zipf (vocab 500)": zipf,
    }


def trie_proposer(revision: str) -> Any:
    """The `NgramProposer` class of `engine/spec/proposer.py` at git `revision`."""
    source = subprocess.run(
        ["git", "show", f"{revision}:engine/spec/proposer.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "trie_proposer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("trie_proposer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trie_proposer"] = module
    spec.loader.exec_module(module)
    return module.NgramProposer


def baseline_proposer(revision: str, scratch: Path) -> Any:
    """The `NgramProposer` class of git `revision`'s `engine` package, with that package's
    `SpecConfig` (`config_class`)."""
    spec = importlib.import_module(f"{baseline_package(revision, scratch)}.spec")

    class Baseline(spec.NgramProposer):  # type: ignore[name-defined]
        config_class = spec.SpecConfig

    return Baseline


def time_per_call(
    systems: dict[str, Any], stream: list[int], steps: int, budget: int
) -> dict[str, tuple[float, list[Any]]]:
    """Per proposer: seconds a `propose` call, over the last `steps` tokens of `stream` added
    one by one, and the trees (their tokens and parents). The proposers step in lockstep,
    taking turns at going first, so that a shared machine's load weighs on them alike."""
    proposers = {}
    for name, proposer_class in systems.items():
        config = getattr(proposer_class, "config_class", SpecConfig)
        proposers[name] = proposer_class(config(draft_budget=budget))
        proposers[name].add_request(0, stream[: len(stream) - steps])
    spent = dict.fromkeys(systems, 0.0)
    trees: dict[str, list[Any]] = {name: [] for name in systems}
    for step, token in enumerate(stream[len(stream) - steps :]):
        for name in list(proposers)[:: 1 if step % 2 == 0 else -1]:
            proposer = proposers[name]
            proposer.extend(0, [token])
            start = time.perf_counter()
            tree = proposer.propose(0)
            spent[name] += time.perf_counter() - start
            trees[name].append((list(tree.tokens), list(tree.parents)))
    return {name: (spent[name] / steps, trees[name]) for name in systems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trie", metavar="REV", help="also time the trie proposer of REV")
    parser.add_argument(
        "--baseline", metavar="REV", help="also time the proposer of REV's engine package"
    )
    args = parser.parse_args()
    systems = {"index": NgramProposer}
    if args.trie:
        systems[f"trie ({args.trie})"] = trie_proposer(args.trie)
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline:
            systems[args.baseline] = baseline_proposer(args.baseline, Path(scratch))
        print(f"propose, us a call ({args.tokens} tokens, budget {args.budget}, median of runs)")
        ratio = f"index / {args.baseline}" if args.baseline else ""
        print(f"{'stream':<28}" + "".join(f"{name:>16}" for name in systems) + f"{ratio:>20}")
        for name, stream in streams(args.tokens).items():
            runs: dict[str, list[float]] = {system: [] for system in systems}
            trees: dict[str, list[Any]] = {}
            for _ in range(args.repeats):
                timed = time_per_call(systems, stream, args.steps, args.budget)
                for system, (seconds, trees[system]) in timed.items():
                    runs[system].append(seconds)
            cells = [f"{statistics.median(times) * 1e6:>16.1f}" for times in runs.values()]
            if args.baseline:
                if trees[args.baseline] != trees["index"]:
                    raise SystemExit(f"{name}: the trees differ from {args.baseline}'s")
                ratios = [
                    new / old for new, old in zip(runs["index"], runs[args.baseline], strict=True)
                ]
                cells.append(f"{min(ratios):>14.2f}-{max(ratios):.2f}")
            print(f"{name:<28}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
