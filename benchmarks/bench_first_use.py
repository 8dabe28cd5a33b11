"""A product's first call at a new token count: how long the host spends in it (the device
idles meanwhile when a pass meets it), after `LlamaModel.warm_products` at every `step`
token counts, each variant in a fresh process: first at the counts rounded up to the step
(as `ModelRunner` pads eager passes to TOKEN_ALIGN tokens), then at the counts as they are.

cuBLAS chooses a kernel for each new shape (a fraction of a millisecond) and loads that
kernel the first time it is chosen (milliseconds). One layer of the preset's shape (its
products and output layer), random weights; the token counts tried are those of
`profile_steps.py --prefill`'s extend passes at batch 64 and random ones.

Run: python3 benchmarks/bench_first_use.py               # a CUDA device
     python3 benchmarks/bench_first_use.py --steps 0,64,16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import attrs
import torch

# the extend passes of profile_steps.py --prefill (batch 64, 512-token prompts, chunk 8192)
PASS_TOKENS = (8176, 4112, 6168, 7204, 3634, 1849, 1084, 574, 319)
SLOW_MS = 1.0  # a first call over this loaded a kernel


def child(args: argparse.Namespace) -> None:
    from engine import ops as op_sets
    from engine.model.config import ModelConfig
    from engine.model.llama import LlamaModel

    config = attrs.evolve(getattr(ModelConfig, args.preset)(), num_layers=1)
    model = LlamaModel(config, torch.bfloat16, "cuda").init_random(0)
    ops = op_sets.load(model.op_set)
    most = args.chunk_size + args.batch
    begun = time.perf_counter()
    ran = 0
    if args.step:
        ran = model.warm_products(
            range(args.step, most + args.step, args.step), range(1, args.batch + 1)
        )
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - begun
    rng = random.Random(0)
    counts = list(PASS_TOKENS) + [rng.randint(2, most) for _ in range(40)]
    counts += [rng.randint(2, 300) for _ in range(30)]
    weights = model.layer_products()  # the one layer's qkv, o_proj, gate_up, down
    inputs = {
        w.shape[1]: torch.randn(most, w.shape[1], dtype=torch.bfloat16, device="cuda")
        for w in weights
    }

    def first_calls(counts: list[int]) -> list[float]:
        host_ms = []
        for count in counts:
            for weight in weights:
                torch.cuda.synchronize()
                start = time.perf_counter()
                ops.linear(inputs[weight.shape[1]][:count], weight)
                host_ms.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        return host_ms

    # the counts rounded up to the step, as the runner pads eager passes, then the counts
    align = args.step
    padded = first_calls([-(-count // align) * align for count in counts]) if align else []
    print(
        json.dumps(
            {"warm_s": warm_s, "products": ran, "padded": padded, "raw": first_calls(counts)}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3_8b")
    parser.add_argument("--steps", default="0,256,64,16", help="0: no warm-up")
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64, help="max_running_requests")
    parser.add_argument("--step", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step is not None:
        child(args)
        return
    print(
        f"\n{torch.cuda.get_device_name()}, {args.preset} (one layer), bf16, token counts up to "
        f"{args.chunk_size} + {args.batch}; first calls of 4 products at "
        f"{len(PASS_TOKENS) + 70} token counts\n"
    )
    print(
        "| warm-up step | products warmed | warm-up s | first calls over 1 ms | their total ms "
        "| median first call ms |"
    )
    print("|---|---|---|---|---|---|")
    for step in (int(s) for s in args.steps.split(",")):
        command = [
            sys.executable,
            __file__,
            "--step",
            str(step),
            "--preset",
            args.preset,
            "--chunk-size",
            str(args.chunk_size),
            "--batch",
            str(args.batch),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])

        def slow(key: str, result: dict = result) -> str:
            times = [ms for ms in result[key] if ms > SLOW_MS]
            return f"{len(times)} of {len(result[key])} ({sum(times):.1f})"

        print(
            f"| {step or 'none'} | {result['products']} | {result['warm_s']:.2f} | "
            f"{slow('padded') if step else '-'} | {slow('raw')} | "
            f"{statistics.median(result['raw']):.3f} |"
        )


if __name__ == "__main__":
    main()
