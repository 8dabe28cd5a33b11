"""The first client's wait after start-up, with and without `engine serve`'s warm-up
(`engine.shell.startup.warm_up`): each run a fresh process that makes the engine, warms it up
or not, then times two requests of its own (different prompts from the warm-up's).

Run: .venv/bin/python benchmarks/bench_warm_up.py            # CPU: the default model
     python3 benchmarks/bench_warm_up.py --random-weights smollm2_135m   # a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def child(args: argparse.Namespace) -> None:
    from engine.shell.engine import Engine
    from engine.shell.startup import warm_up
    from engine.state import SamplingParams

    started = time.perf_counter()
    engine = Engine(device=args.device, random_weights=args.random_weights)
    made = time.perf_counter()
    if args.child == "warm":
        warm_up(engine)
    warmed = time.perf_counter()
    generator = torch.Generator().manual_seed(1)
    times = []
    for _ in range(2):  # two clients' requests, one after the other
        prompt = torch.randint(40, 2000, (args.prompt_len,), generator=generator).tolist()
        begun = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        times.append(time.perf_counter() - begun)
    print(
        json.dumps(
            {
                "start": made - started,
                "warm_up": warmed - made,
                "first": times[0],
                "second": times[1],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--random-weights", default=None, help="a preset (default: the model)")
    parser.add_argument("--runs", type=int, default=3, help="processes per variant")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--child", choices=["warm", "cold"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.runs):  # alternating, so that drift in the machine's speed is shared
        for variant in results:
            command = [sys.executable, __file__, "--child", variant, "--device", args.device]
            command += ["--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
            if args.random_weights:
                command += ["--random-weights", args.random_weights]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    model = args.random_weights or "the default model"
    print(
        f"\n{args.device}, {model}, {args.prompt_len}-token prompts, {args.max_tokens} new "
        f"tokens, {args.runs} processes a variant (median, range)\n"
    )
    print("| start-up | engine made s | warm-up s | first request ms | second request ms |")
    print("|---|---|---|---|---|")
    for variant, runs in results.items():

        def cell(key: str, scale: float, digits: int, runs: list[dict] = runs) -> str:
            values = [r[key] * scale for r in runs]
            return (
                f"{statistics.median(values):.{digits}f} "
                f"({min(values):.{digits}f}-{max(values):.{digits}f})"
            )

        name = "warm-up (`engine serve`)" if variant == "warm" else "none (`--skip-warm-up`)"
        warm = cell("warm_up", 1, 2) if variant == "warm" else "-"
        print(
            f"| {name} | {cell('start', 1, 1)} | {warm} | {cell('first', 1e3, 0)} "
            f"| {cell('second', 1e3, 0)} |"
        )


if __name__ == "__main__":
    main()
