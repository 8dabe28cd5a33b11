"""Extend passes eager and from CUDA graphs (`cuda_graph_max_tokens`), side by side in one run.

Two engines with random weights, alike but for `cuda_graph_max_tokens` (0: every extend pass
eager; N: passes of up to N tokens replay graphs), take turns on the same cases; the table
gives each case's median step time (the step's wall clock, its first token read back) and
the eager engine's time over the graph engine's (and each engine's start-up, the graphs'
capture included):

- prefill: one fresh prompt of each `--lengths` length, nothing else running (its
  time to the first token, less admission);
- mixed: the same prompt arriving while `--decoding` requests decode: the step that
  prefills it carries their decode tokens too (a long prompt: its first chunk of
  `mixed_chunk_size` tokens).

  python3 benchmarks/bench_prefill.py                  # CUDA: smollm2_135m, float32
  python3 benchmarks/bench_prefill.py --preset llama3_8b --dtype bfloat16
  .venv/bin/python benchmarks/bench_prefill.py --device cpu --preset tiny --lengths 16,64
      (on a CPU neither engine captures graphs: the columns should agree)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.shell.engine import Engine
from engine.shell.request import Request
from engine.state import SamplingParams


def make_engine(args: argparse.Namespace, graph_tokens: int) -> Engine:
    return Engine(
        random_weights=args.preset,
        device=args.device,
        dtype=args.dtype,
        kv_cache_slots=args.slots,  # two engines share the device: neither takes it all
        max_running_requests=max(args.decoding + 1, 8),
        cuda_graph_max_tokens=graph_tokens,
    )


def first_token_step(engine: Engine, prompt: list[int]) -> float:
    """Seconds of the step that prefills `prompt` (its last chunk: the one that samples)."""
    request = engine.inbox.add(prompt, SamplingParams(max_tokens=1, ignore_eos=True), None, None)
    seconds = 0.0
    while not request.done:
        engine.step()
        mode, took = engine.step_times[-1]
        if mode == "extend":
            seconds = took
    return seconds


def run(args: argparse.Namespace) -> tuple[list[tuple[str, int, float, float]], dict]:
    engines, startup = {}, {}
    for name, tokens in (("eager", 0), ("graphs", args.graph_tokens)):
        start = time.perf_counter()
        engines[name] = make_engine(args, tokens)
        startup[name] = time.perf_counter() - start
    vocab = engines["eager"].runtime.vocab_size
    rng = np.random.default_rng(0)

    def fresh(n: int) -> list[int]:  # no cached prefix
        return rng.integers(3, vocab, n).tolist()

    lengths = [int(x) for x in args.lengths.split(",")]
    for engine in engines.values():  # first uses (compiles, cuBLAS loads) out of the timing
        for n in lengths:
            first_token_step(engine, fresh(n))
    rows = []
    background = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for case in ("prefill", "mixed"):
        if case == "mixed" and not args.decoding:
            continue
        decoding: dict[str, list[Request]] = {name: [] for name in engines}
        if case == "mixed":
            for name, engine in engines.items():
                decoding[name] = [
                    engine.inbox.add(fresh(32), background, None, None)
                    for _ in range(args.decoding)
                ]
                for _ in range(4):  # their prefill done, decoding
                    engine.step()
        for n in lengths:
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, engine in engines.items():  # alternating: the machine's drift shared
                    times[name].append(first_token_step(engine, fresh(n)))
            eager, graphs = (statistics.median(times[name]) for name in engines)
            rows.append((case, n, eager, graphs))
        for name, engine in engines.items():
            for request in decoding[name]:
                engine.abort(request.request_id)
            while engine.has_work:
                engine.step()
    return rows, startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--preset", default="smollm2_135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", default="16,64,256,1024,2048", help="prompt lengths")
    parser.add_argument("--graph-tokens", type=int, default=1024, help="the graph engine's N")
    parser.add_argument("--decoding", type=int, default=8, help="requests decoding (mixed)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--slots", type=int, default=65536, help="KV slots of each engine")
    args = parser.parse_args()
    rows, startup = run(args)
    where = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    print(
        f"\nrandom {args.preset}, {args.dtype}, {where}; graphs up to {args.graph_tokens} "
        f"tokens; mixed: with {args.decoding} requests decoding; median of {args.repeats}"
    )
    print("| case | prompt tokens | eager ms | graphs ms | eager / graphs |")
    print("|---|---|---|---|---|")
    for case, n, eager, graphs in rows:
        print(f"| {case} | {n} | {eager * 1e3:.2f} | {graphs * 1e3:.2f} | {eager / graphs:.2f}x |")
    print(f"\nstart-up: eager {startup['eager']:.1f} s, graphs {startup['graphs']:.1f} s")


if __name__ == "__main__":
    main()
