"""The n-gram proposer's cost a draft tree on the host, per kind of token stream: one token
repeated, an indentation-like pattern, a document repeated, random text, a small-vocabulary
Zipf stream; beside it (`--trie REV`) the trie-based proposer of git revision REV.

Run: .venv/bin/python benchmarks/bench_spec_proposer.py [--tokens 3000] [--steps 200]
     [--budget 12] [--trie 0bdfc9e]

Each stream's first `tokens - steps` tokens are the prompt; then each of the last `steps`
tokens is added (not timed) and a tree proposed from the whole history (timed), as a
decoding request does. The table shows the median of `--repeats` such runs, us a call.
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


def time_per_call(proposer_class: Any, stream: list[int], steps: int, budget: int) -> float:
    """Seconds a `propose` call, over the last `steps` tokens of `stream` added one by one."""
    proposer = proposer_class(SpecConfig(draft_budget=budget))
    proposer.add_request(0, stream[: len(stream) - steps])
    spent = 0.0
    for token in stream[len(stream) - steps :]:
        proposer.extend(0, [token])
        start = time.perf_counter()
        proposer.propose(0)
        spent += time.perf_counter() - start
    return spent / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trie", metavar="REV", help="also time the trie proposer of REV")
    args = parser.parse_args()
    systems = {"index": NgramProposer}
    if args.trie:
        systems[f"trie ({args.trie})"] = trie_proposer(args.trie)
    print(f"propose, us a call ({args.tokens} tokens, budget {args.budget}, median of runs)")
    print(f"{'stream':<28}" + "".join(f"{name:>16}" for name in systems))
    for name, stream in streams(args.tokens).items():
        cells = []
        for proposer_class in systems.values():
            runs = [
                time_per_call(proposer_class, stream, args.steps, args.budget)
                for _ in range(args.repeats)
            ]
            cells.append(f"{statistics.median(runs) * 1e6:>16.1f}")
        print(f"{name:<28}" + "".join(cells))


if __name__ == "__main__":
    main()
