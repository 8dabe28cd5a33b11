"""What sampling costs a decode step: the engine (default model unless told) at batch 1 and 8,
greedy against temperature 1 with no filter and with top-p 0.9, and the sampler alone (a
step's inputs built, then sampled from) on a [batch, vocabulary] block of random logits
(standard normal x 8: peaked like a model's). On a GPU, temperature 1 also runs with the
unfused draw (`--no-unfused`: not) in the same process: the dozen launches that
`engine.ops.draw` makes one.

Run: .venv/bin/python benchmarks/bench_sampling.py [--threads 1] [--tokens 48]
     python3 benchmarks/bench_sampling.py   (a GPU: the default model's shape, random weights)
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from engine.model.sampling import SamplingTensors, draw_unfused, sample
from engine.ops import draw as draw_module
from engine.shell.engine import Engine
from engine.state import SamplingParams

REGIMES = {
    "greedy": {},
    "temperature 1": {"temperature": 1.0},
    "temperature 1, top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
}
UNFUSED = "temperature 1, unfused draw"


@contextlib.contextmanager
def unfused_draw(on: bool):
    """`sample` on a GPU draws through `engine.ops.draw.draw`: the unfused draw in its place."""
    fused = draw_module.draw
    if on:
        draw_module.draw = draw_unfused  # unfiltered: the draw's own arguments
    try:
        yield
    finally:
        draw_module.draw = fused


def decode_rate(engine: Engine, batch: int, tokens: int, regime: dict) -> float:
    """Generated tokens per second of the decode steps (prefill left out)."""
    vocab = engine.runtime.vocab_size  # (ids past a small vocabulary wrap around)
    prompts = [[t % vocab for t in (5 + i, 17, 99, 250 + i)] * 8 for i in range(batch)]
    params = [
        SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **regime) for i in range(batch)
    ]
    engine.generate(prompts, params)  # warm
    engine.step_times.clear()
    engine.generate(prompts, params)
    decode = [seconds for mode, seconds in engine.step_times if mode == "decode"]
    return batch * len(decode) / sum(decode)


def sampler_ms(batch: int, vocab: int, regime: dict, device: str) -> float:
    # peaked like a model's rows (top-p 0.9 then holds tens of tokens, not thousands)
    logits = torch.randn(batch, vocab, device=device) * 8
    params = [SamplingParams(seed=i, **regime) for i in range(batch)]
    for step in range(3):
        sample(logits, SamplingTensors.build(params, [step] * batch, vocab, device))
    repeats = 30
    if device != "cpu":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(repeats):  # a step's inputs are built, then sampled from
        out = sample(logits, SamplingTensors.build(params, [step] * batch, vocab, device))
    out.cpu()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--unfused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, also temperature 1 with the unfused draw",
    )
    parser.add_argument(
        "--random-weights",
        default=None,
        help="a preset (default: the default model on a CPU, its shape with "
        "random weights, smollm2_135m, on a GPU)",
    )
    args = parser.parse_args()
    if args.random_weights is None and args.device != "cpu":
        args.random_weights = "smollm2_135m"
    torch.set_num_threads(args.threads)
    engine = Engine(
        device=args.device,
        dtype="float32",
        random_weights=args.random_weights,
        max_running_requests=8,
    )
    vocab = engine.runtime.vocab_size
    rows = []
    regimes = dict(REGIMES)
    if args.device != "cpu" and args.unfused:
        regimes[UNFUSED] = REGIMES["temperature 1"]
    for batch in (1, 8):
        rates, ms = {}, {}
        for name, regime in regimes.items():
            with unfused_draw(name == UNFUSED):
                rates[name] = decode_rate(engine, batch, args.tokens, regime)
                ms[name] = sampler_ms(batch, vocab, regime, args.device)
        for name in regimes:
            rows.append((batch, name, rates[name], rates[name] / rates["greedy"], ms[name]))
    print(
        f"\n{args.device}, {args.threads} thread(s), vocabulary {vocab}, "
        f"{args.tokens} tokens a request\n"
    )
    print("| batch | sampling | decode tok/s | / greedy | sampler alone, build + sample (ms) |")
    print("|---|---|---|---|---|")
    for batch, name, rate, ratio, alone_ms in rows:
        print(f"| {batch} | {name} | {rate:.1f} | {ratio:.2f}x | {alone_ms:.2f} |")


if __name__ == "__main__":
    main()
