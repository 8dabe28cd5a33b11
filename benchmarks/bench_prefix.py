"""The prefix cache and mixed prefill+decode passes, each on against off, side by side in one run.

    python benchmarks/bench_prefix.py                                # default model
    python benchmarks/bench_prefix.py --random-weights llama3_8b     # on a GPU
    python benchmarks/bench_prefix.py --random-weights tiny --system-tokens 200 --requests 8

(a) shared system prompt: --requests prompts of one --system-tokens prefix plus a
--question-tokens question each, all submitted at once. (b) multi-turn chat: --conversations
run at once; each turn's prompt is the previous prompt + its answer + a new message, submitted
when the previous turn finishes. (a) and (b): throughput and time to first token (TTFT), prefix
cache on vs off. (c) a long prompt arrives while --decodes requests decode: the gaps between
their tokens and the long prompt's TTFT, mixed passes on vs off (prefix cache on in both).
Prompts are random token ids (seeded: each setting gets the same ones), greedy, `ignore_eos`.
Each row is a fresh engine, warmed up with a tiny request first; the KV pool holds each
workload without any sharing unless --kv-cache-slots says otherwise. A token's time is when
the step that made it returned.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import platform
import queue
import statistics
import subprocess
import time
from collections.abc import Callable

import numpy as np
import torch

from engine import Engine


@dataclasses.dataclass
class Trace:
    """One request as this script saw it: when it was submitted and when each token came."""

    prompt: list[int]
    submitted: float
    on_finish: Callable[[Trace], None] | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    stamps: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.submitted


class Driver:
    """Steps one engine in this thread; stamps each request's tokens as its sink delivers them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.live: dict[str, tuple[queue.SimpleQueue, Trace]] = {}
        self.passes: collections.Counter = collections.Counter()

    def submit(self, prompt: list[int], params: dict, on_finish=None) -> Trace:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        trace = Trace(prompt, time.perf_counter(), on_finish)
        self.live[self.engine.submit(prompt, params, sink=sink)] = (sink, trace)
        return trace

    def run(self, after_step: Callable[[], None] | None = None) -> None:
        while self.engine.has_work:
            times = self.engine.step_times
            last = times[-1] if times else None
            self.engine.step()
            now = time.perf_counter()
            if times and times[-1] is not last:  # a pass ran: count its kind
                self.passes[times[-1][0]] += 1
            self._drain(now)
            if after_step is not None:
                after_step()

    def _drain(self, now: float) -> None:
        for request_id, (sink, trace) in list(self.live.items()):
            while not sink.empty():
                delta = sink.get()
                trace.token_ids += delta.token_ids
                trace.stamps += [now] * len(delta.token_ids)
                if delta.finish_reason is not None:
                    trace.finish_reason = delta.finish_reason
                    trace.cached_tokens = delta.usage.cached_tokens if delta.usage else 0
                    del self.live[request_id]
                    if trace.on_finish is not None:
                        trace.on_finish(trace)  # may submit the next turn


def random_ids(rng: np.random.Generator, vocab: int, count: int) -> list[int]:
    return rng.integers(3, min(vocab, 32000), count).tolist()  # above the usual special ids


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def warm_up(engine: Engine, vocab: int) -> None:
    """A prefill, decodes, a prompt that extends a cached one while the first decodes."""
    driver = Driver(engine)
    first = random_ids(np.random.default_rng(12345), vocab, 48)
    trace = driver.submit(first, greedy(8))
    extended: list[Trace] = []

    def extend() -> None:
        if not extended and trace.stamps:
            extended.append(driver.submit(first + first[:16], greedy(4)))

    driver.run(extend)


def summarize(traces: list[Trace], started: float, driver: Driver) -> dict:
    tokens = sum(len(t.token_ids) for t in traces)
    ttfts = [t.ttft for t in traces if t.stamps]
    return dict(
        tok_s=tokens / (max(s for t in traces for s in t.stamps) - started),
        ttft=statistics.median(ttfts),
        ttft_p90=float(np.percentile(ttfts, 90)),
        cached=sum(t.cached_tokens for t in traces),
        prompt=sum(len(t.prompt) for t in traces),
        passes=dict(driver.passes),
    )


def shared_prompt(driver: Driver, vocab: int, args: argparse.Namespace) -> dict:
    """(a): one system prompt, a question each, all at once."""
    rng = np.random.default_rng(1)
    system = random_ids(rng, vocab, args.system_tokens)
    prompts = [system + random_ids(rng, vocab, args.question_tokens) for _ in range(args.requests)]
    started = time.perf_counter()
    traces = [driver.submit(p, greedy(args.new_tokens)) for p in prompts]
    driver.run()
    return summarize(traces, started, driver)


def multi_turn(driver: Driver, vocab: int, args: argparse.Namespace) -> dict:
    """(b): conversations whose next turn is submitted when the last one finishes."""
    rng = np.random.default_rng(2)
    histories = [
        random_ids(rng, vocab, int(rng.integers(args.history_min, args.history_max + 1)))
        for _ in range(args.conversations)
    ]
    messages = [
        [random_ids(rng, vocab, args.message_tokens) for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    traces: list[Trace] = []

    def start(conv: int, turn: int, prompt: list[int]) -> None:
        def follow(done: Trace) -> None:
            if turn + 1 < args.turns:
                start(conv, turn + 1, done.prompt + done.token_ids + messages[conv][turn + 1])

        traces.append(driver.submit(prompt, greedy(args.turn_tokens), follow))

    started = time.perf_counter()
    for conv in range(args.conversations):
        start(conv, 0, histories[conv] + messages[conv][0])
    driver.run()
    return summarize(traces, started, driver)


def long_arrival(driver: Driver, vocab: int, args: argparse.Namespace) -> dict:
    """(c): --decodes requests decode; a --long-tokens prompt arrives once each has
    --decode-warm tokens."""
    rng = np.random.default_rng(3)
    shorts = [random_ids(rng, vocab, args.short_tokens) for _ in range(args.decodes)]
    long_prompt = random_ids(rng, vocab, args.long_tokens)
    running = [driver.submit(p, greedy(args.decode_tokens)) for p in shorts]
    arrived: list[Trace] = []

    def arrive() -> None:
        if not arrived and all(len(t.stamps) >= args.decode_warm for t in running):
            arrived.append(driver.submit(long_prompt, greedy(args.long_new_tokens)))

    driver.run(arrive)
    (long_trace,) = arrived
    gaps = np.concatenate([np.diff(t.stamps) for t in running])
    prefill = (long_trace.submitted, long_trace.stamps[0])
    during = sum(prefill[0] < s <= prefill[1] for t in running for s in t.stamps)
    if any(t.stamps[-1] < prefill[1] for t in running):
        print("  note: a running request ended before the long prompt's first token")
    return dict(
        max_gap=float(gaps.max()),
        median_gap=float(np.median(gaps)),
        during=during,
        ttft=long_trace.ttft,
        passes=dict(driver.passes),
    )


WORKLOADS = {
    "a": ("shared system prompt", shared_prompt, "prefix_cache"),
    "b": ("multi-turn chat", multi_turn, "prefix_cache"),
    "c": ("long prompt among decodes", long_arrival, "mixed_passes"),
}


def pool_slots(name: str, args: argparse.Namespace) -> int:
    """KV slots for a workload's requests all at once, nothing shared, plus the warm-up's."""
    if name == "a":
        need = args.requests * (args.system_tokens + args.question_tokens + args.new_tokens)
    elif name == "b":
        per_turn = args.message_tokens + args.turn_tokens
        need = args.conversations * (args.history_max + args.turns * per_turn)
    else:
        need = args.decodes * (args.short_tokens + args.decode_tokens) + args.long_tokens
        need += args.long_new_tokens
    return need + 256


def run_one(name: str, setting: bool, args: argparse.Namespace, max_context: int) -> dict:
    title, workload, option = WORKLOADS[name]
    names = ("device", "dtype", "random_weights", "chunk_size", "mixed_chunk_size")
    overrides = {k: getattr(args, k) for k in names}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    options = {"prefix_cache": True, "mixed_passes": True, option: setting}
    engine = Engine(
        args.model,
        max_context=max_context,
        kv_cache_slots=args.kv_cache_slots or pool_slots(name, args),
        **overrides,
        **options,
    )
    vocab = engine.runtime.vocab_size
    warm_up(engine, vocab)
    started = time.perf_counter()
    result = workload(Driver(engine), vocab, args)
    seconds = time.perf_counter() - started
    metrics = {
        k: v for k, v in engine.metrics().items() if k.startswith(("prefix_cache", "cached_"))
    }
    result["metrics"] = metrics
    result["engine"] = f"{engine.runtime.device} {str(engine.runtime.dtype).split('.')[-1]}"
    print(f"  ({name}) {option}={setting}: {seconds:.1f} s, {title}")
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def machine(device_option: str | None) -> str:
    """The device's name, torch and Python versions, and the commit."""
    if torch.cuda.is_available() and (device_option or "cuda").startswith("cuda"):
        device = torch.cuda.get_device_name()
    else:
        names = [ln for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        device = f"{names[0].split(':', 1)[1].strip() if names else platform.processor()}"
        device += f", {torch.get_num_threads()} torch threads"
    git = ["git", "-C", __file__.rsplit("/", 2)[0]]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "engine"], capture_output=True, text=True
    )
    changed = " (+ uncommitted changes under engine/)" if dirty.stdout.strip() else ""
    return (
        f"{device}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"commit {commit.stdout.strip() or '?'}{changed}"
    )


def print_cache_table(on: dict, off: dict) -> None:
    print("| prefix cache | output tok/s | median TTFT s | p90 TTFT s | cached / prompt tokens |")
    print("|---|---|---|---|---|")
    for label, r in (("on", on), ("off", off)):
        print(
            f"| {label} | {r['tok_s']:.1f} | {r['ttft']:.3f} | {r['ttft_p90']:.3f} | "
            f"{r['cached']} / {r['prompt']} |"
        )
    print(
        f"| on / off | {on['tok_s'] / off['tok_s']:.2f}x | {on['ttft'] / off['ttft']:.2f}x | "
        f"{on['ttft_p90'] / off['ttft_p90']:.2f}x | |"
    )
    print(f"passes: on {on['passes']}; off {off['passes']}")
    print(
        f"engine metrics, warm-up included: on {on['metrics'] or '-'}; off {off['metrics'] or '-'}"
    )


def print_gap_table(on: dict, off: dict) -> None:
    print(
        "| mixed passes | max gap ms | median gap ms | max / median | their tokens from the "
        "long prompt's submit to its first | long prompt TTFT s |"
    )
    print("|---|---|---|---|---|---|")
    for label, r in (("on", on), ("off", off)):
        print(
            f"| {label} | {r['max_gap'] * 1e3:.1f} | {r['median_gap'] * 1e3:.1f} | "
            f"{r['max_gap'] / r['median_gap']:.1f} | {r['during']} | {r['ttft']:.3f} |"
        )
    print(
        f"| on / off | {on['max_gap'] / off['max_gap']:.2f}x | "
        f"{on['median_gap'] / off['median_gap']:.2f}x | | | {on['ttft'] / off['ttft']:.2f}x |"
    )
    print(f"passes: on {on['passes']}; off {off['passes']}")
    print(
        f"engine metrics, warm-up included: on {on['metrics'] or '-'}; off {off['metrics'] or '-'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default=None, help="HF directory or GGUF file; default: the default model")
    add("--random-weights", default=None, help="llama3_8b, smollm2_135m or tiny")
    add("--device", default=None)
    add("--dtype", default=None)
    add("--chunk-size", type=int, default=None)
    add("--mixed-chunk-size", type=int, default=None)
    add("--max-context", type=int, default=None, help="default: the longest request, >= 8192")
    add("--kv-cache-slots", type=int, default=None, help="default: each workload unshared")
    add("--workloads", default="a,b,c")
    add("--requests", type=int, default=64, help="(a)")
    add("--system-tokens", type=int, default=2000, help="(a)")
    add("--question-tokens", type=int, default=50, help="(a)")
    add("--new-tokens", type=int, default=64, help="(a)")
    add("--conversations", type=int, default=16, help="(b)")
    add("--turns", type=int, default=4, help="(b)")
    add("--history-min", type=int, default=200, help="(b)")
    add("--history-max", type=int, default=500, help="(b)")
    add("--message-tokens", type=int, default=50, help="(b)")
    add("--turn-tokens", type=int, default=32, help="(b)")
    add("--decodes", type=int, default=8, help="(c)")
    add("--short-tokens", type=int, default=32, help="(c) the decoding requests' prompts")
    add("--decode-tokens", type=int, default=128, help="(c)")
    add("--decode-warm", type=int, default=16, help="(c) their tokens before the long prompt")
    add("--long-tokens", type=int, default=8000, help="(c)")
    add("--long-new-tokens", type=int, default=8, help="(c)")
    args = parser.parse_args()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads {unknown} unknown; choose from {sorted(WORKLOADS)}")
    if "c" in names and args.decode_warm >= args.decode_tokens:
        parser.error("--decode-warm must be below --decode-tokens")
    longest = 1 + max(
        args.system_tokens + args.question_tokens + args.new_tokens,
        args.history_max + args.turns * (args.message_tokens + args.turn_tokens),
        args.long_tokens + args.long_new_tokens if "c" in names else 0,
        args.short_tokens + args.decode_tokens,
    )
    max_context = args.max_context or max(longest, 8192)
    if max_context < longest:
        parser.error(f"--max-context {max_context} is below the longest request ({longest})")
    print(machine(args.device))
    model = args.model or (f"random {args.random_weights}" if args.random_weights else "default")
    print(f"model: {model}; max_context {max_context}\n")
    results = {}
    for name in names:
        results[name] = [run_one(name, setting, args, max_context) for setting in (True, False)]
    for name in names:
        on, off = results[name]
        print(f"\n({name}) {WORKLOADS[name][0]} [{on['engine']}]")
        if name == "a":
            print(
                f"{args.requests} requests: {args.system_tokens}-token system prompt + "
                f"{args.question_tokens}-token question, {args.new_tokens} new tokens each"
            )
            print_cache_table(on, off)
        elif name == "b":
            print(
                f"{args.conversations} conversations x {args.turns} turns: history "
                f"{args.history_min}-{args.history_max} tokens, +{args.message_tokens}-token "
                f"message per turn, {args.turn_tokens} new tokens per turn"
            )
            print_cache_table(on, off)
        else:
            print(
                f"{args.decodes} requests ({args.short_tokens}-token prompts, "
                f"{args.decode_tokens} new tokens); a {args.long_tokens}-token prompt arrives "
                f"after {args.decode_warm} of their tokens"
            )
            print_gap_table(on, off)


if __name__ == "__main__":
    main()
