"""Where a GPU step's time goes: torch.profiler over engine steps, summarised per step mode.

For each profiled step (`Engine.step` wrapped in a `step` annotation): its wall time on the
host, the device's busy time inside it (the union of kernel and copy intervals that start in
the step), kernels per step; over the whole window: the device's idle fraction, the longest
device gaps (with the kernels around them), the top kernels and the top host ops.

  python benchmarks/profile_steps.py decode   # random llama3_8b, batch 64, decode-heavy
  python benchmarks/profile_steps.py spec     # random smollm2_135m, batch 1, speculative
  python benchmarks/profile_steps.py decode --prefill --steps 300 --max-tokens 256
      # a whole decode-heavy run: the prompts' prefill and every decode step after it
  python benchmarks/profile_steps.py summarise --trace t.json.gz   # a trace kept by --trace
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import _gpu_engine  # noqa: E402

from engine.shell.engine import Engine
from engine.shell.startup import freeze_startup_objects
from engine.shell.startup import warm_up as serve_warm_up
from engine.state import SamplingParams

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarise(trace: dict, modes: list[str], top: int = 12) -> str:
    """The report of one chrome trace whose `step` annotations ran in the order of `modes`."""
    events = trace["traceEvents"]
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e),
        key=lambda e: e["ts"],
    )
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e.get("name") == "step"),
        key=lambda e: e["ts"],
    )
    lines = []
    if not device or not steps:
        return f"no device events ({len(device)}) or steps ({len(steps)}) in the trace"
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in device])
    lines.append(
        f"window {span / 1e3:.2f} ms, device busy {busy / 1e3:.2f} ms, "
        f"idle {1 - busy / span:.3f}, {len(device)} device events, {len(steps)} steps"
    )
    # per step: device work that starts inside the step's host interval (up to the next step)
    per_mode: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
    ends = [s["ts"] for s in steps[1:]] + [float("inf")]
    index = 0
    for step, mode, stop in zip(steps, modes, ends, strict=False):
        inside = []
        while index < len(device) and device[index]["ts"] < stop:
            if device[index]["ts"] >= step["ts"]:
                inside.append(device[index])
            index += 1
        work = union_us([(e["ts"], e["ts"] + e["dur"]) for e in inside])
        per_mode[mode].append((step["dur"], work, len(inside)))
    for mode, rows in per_mode.items():
        walls, works, counts = zip(*rows, strict=True)
        lines.append(
            f"{mode}: {len(rows)} steps, median wall {statistics.median(walls) / 1e3:.3f} ms, "
            f"median device busy {statistics.median(works) / 1e3:.3f} ms, "
            f"median device events {statistics.median(counts):.0f}"
        )
    gaps = []
    for before, after in zip(device, device[1:], strict=False):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap > 0:
            gaps.append((gap, before["name"][:60], after["name"][:60], after["ts"]))
    gaps.sort(reverse=True)
    sizes = [g[0] for g in gaps]
    lines.append(
        f"device gaps: {len(sizes)} in all, {sum(sizes) / 1e3:.2f} ms; "
        + ", ".join(f">{t} us: {sum(1 for s in sizes if s > t)}" for t in (5, 20, 100, 1000))
    )
    host_long = [  # what the host did during a gap: its phases and long ops (> 0.3 ms)
        e
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation")
        and e.get("dur", 0) > 300
        and e.get("name") != "step"
    ]
    for gap, before, after, at in gaps[: top + 4]:
        lines.append(f"  gap {gap:.1f} us after {before!r} before {after!r}")
        start = at - gap
        inside = sorted((e for e in host_long if start - 50 <= e["ts"] < at), key=lambda e: e["ts"])
        for e in inside[:6]:
            lines.append(
                f"    host {e['name'][:40]} from +{(e['ts'] - start) / 1e3:.2f} ms "
                f"for {e['dur'] / 1e3:.2f} ms"
            )
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for e in device:
        kernels[e["name"][:90]].append(e["dur"])
    lines.append("top device work (total ms, count, mean us, share of busy):")
    for name, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(
            f"  {sum(durs) / 1e3:8.2f} {len(durs):6d} {statistics.mean(durs):8.1f} "
            f"{sum(durs) / busy:.3f}  {name}"
        )
    phases: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase:"):
            phases[e["name"][6:]].append(e["dur"])
    if phases:
        lines.append("host phases (count, median us, total ms):")
        for name, durs in sorted(phases.items(), key=lambda kv: -sum(kv[1])):
            lines.append(
                f"  {len(durs):6d} {statistics.median(durs):9.1f} {sum(durs) / 1e3:8.2f}  {name}"
            )
    host: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver") and "dur" in e:
            host[f"{e['cat']}:{e['name'][:70]}"].append(e["dur"])
    lines.append("top host events by total (not self) time (total ms, count, mean us):")
    for name, durs in sorted(host.items(), key=lambda kv: -sum(kv[1]))[: 2 * top]:
        lines.append(
            f"  {sum(durs) / 1e3:8.2f} {len(durs):6d} {statistics.mean(durs):8.1f}  {name}"
        )
    return "\n".join(lines)


PHASES = (
    ("engine", ("_drain_inbox", "_admit", "_prepare_next", "_commit_pass")),
    ("passes", ("launch", "fetch")),
    ("runner", ("prepare", "launch")),
    ("spec", ("propose", "verify", "record", "observe")),
    ("book", ("apply",)),
)


def annotate_phases(engine: Engine) -> None:
    """Wrap the engine's step phases (instance attributes only) in `phase:` annotations."""

    def wrap(owner: object, name: str, label: str) -> None:
        method = getattr(owner, name)

        def annotated(*args, **kwargs):
            with record_function(f"phase:{label}"):
                return method(*args, **kwargs)

        setattr(owner, name, annotated)

    for part, names in PHASES:
        owner = engine if part == "engine" else getattr(engine, part, None)
        if owner is None:
            continue
        for name in names:
            wrap(owner, name, f"{part}.{name}")


def warm_up(engine: Engine, prompts: list, params: SamplingParams | None = None) -> None:
    """The prompts reversed (the same shapes: every kernel compiled for them, no prefix the
    measured run could reuse), two tokens each, in a throwaway profiler session: a process's
    first session starts its tracing (tens of milliseconds in which the device waits), and a
    kernel compiled in the window (a second or more) would count as idle time there.
    `params`: the measured run's instead of two tokens (the whole workload once before it: a
    server's steady state, where every library kernel the workload uses has been loaded)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        reversed_prompts = [list(reversed(p)) for p in prompts]
        params = params or SamplingParams(max_tokens=2, ignore_eos=True)
        engine.generate(reversed_prompts, params)
        torch.cuda.synchronize()


def profile_steps(
    engine: Engine,
    prompts: list,
    params: SamplingParams,
    max_steps: int,
    prefill: bool = False,
    trace_path: str | None = None,
    full_warm_up: bool = False,
) -> str:
    """Admit `prompts`, step until every one is decoding (prefill not profiled), then profile
    up to `max_steps` steps; `prefill`: profile from the admission on (the prompts' extend
    passes and the decode steps after them). `trace_path`: also keep the chrome trace there
    (gzipped where the name ends in .gz). `full_warm_up`: warm up on the whole workload."""
    warm_up(engine, prompts, params if full_warm_up else None)
    engine.step_times.clear()  # the warm-up's last step (a decode) must not end the prefill
    for prompt in prompts:
        engine.submit(prompt, params)
    while not prefill and (
        engine.has_work
        and (engine.waiting or not engine.step_times or engine.step_times[-1][0] == "extend")
    ):
        engine.step()
    for _ in range(0 if prefill else 2):  # past the first decode passes
        if engine.has_work:
            engine.step()
    torch.cuda.synchronize()
    annotate_phases(engine)
    modes = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(max_steps):
            if not engine.has_work:
                break
            with record_function("step"):
                engine.step()
            modes.append(engine.step_times[-1][0])
        torch.cuda.synchronize()
    while engine.has_work:
        engine.step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            trace = json.load(handle)
    if trace_path is not None:
        opener = gzip.open if trace_path.endswith(".gz") else open
        with opener(trace_path, "wt") as handle:
            json.dump(dict(trace, engine_modes=modes), handle)
    return summarise(trace, modes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "which", choices=["decode", "spec", "summarise"], help="summarise: a kept --trace"
    )
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per request (default: 4 x steps + 64, past the window)",
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="profile from the admission on: the prompts' prefill and the steps after it",
    )
    parser.add_argument(
        "--launch-ahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode: the engine's launch_ahead (default: the engine's default)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: bfloat16 for decode, float32 for spec (as bench_spec on the GPU)",
    )
    parser.add_argument("--trace", default=None, help="keep the chrome trace at this path")
    parser.add_argument(
        "--full-warm-up",
        action="store_true",
        help="warm up on the whole workload (prompts reversed), not two tokens a prompt: the "
        "profiled run then uses no library kernel for the first time",
    )
    parser.add_argument(
        "--serve-warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start with `engine serve`'s warm-up (`startup.warm_up`); off: one 8-token "
        "request of the first prompt instead",
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="freeze the start-up objects before profiling, as `engine serve` does",
    )
    args = parser.parse_args()
    if args.which == "summarise":  # a trace kept by --trace, read again (no GPU needed)
        opener = gzip.open if args.trace.endswith(".gz") else open
        with opener(args.trace, "rt") as handle:
            trace = json.load(handle)
        steps = sum(1 for e in trace["traceEvents"] if e.get("name") == "step")
        print(summarise(trace, trace.get("engine_modes") or ["step"] * steps))
        return
    generator = torch.Generator().manual_seed(0)
    if args.which == "decode":
        batch = args.batch or 64
        # the engine bench_engine.py reports on
        engine = _gpu_engine(dtype=args.dtype or "bfloat16", launch_ahead=args.launch_ahead)
        prompts = torch.randint(3, 30000, (batch, args.prompt_len), generator=generator).tolist()
    else:
        batch = args.batch or 1
        engine = Engine(
            random_weights="smollm2_135m",
            device="cuda",
            dtype=args.dtype or "float32",
            max_running_requests=8,
            cuda_graph_max_batch=8,
            max_context=2048,
            kv_cache_fraction=0.3,
            speculative=True,
        )
        # a repeating prompt: n-gram drafts find matches and verify passes run
        period = torch.randint(3, 30000, (64,), generator=generator).tolist()
        prompts = [(period * (args.prompt_len // 64 + 1))[: args.prompt_len]] * batch
    params = SamplingParams(max_tokens=args.max_tokens or args.steps * 4 + 64, ignore_eos=True)
    if args.serve_warm_up:
        serve_warm_up(engine)
    else:
        engine.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    if args.gc_freeze:
        freeze_startup_objects(engine)
    print(
        f"\n== profile {args.which}: batch {batch}, {args.prompt_len}-token prompts, "
        f"{engine.runtime.dtype}, launch_ahead {engine.launch_ahead}, "
        f"{'prefill included' if args.prefill else 'prefill not profiled'}, "
        f"{'start-up objects frozen, ' if args.gc_freeze else ''}"
        f"{'' if args.serve_warm_up else 'without the serve warm-up, '}"
        f"{'warmed up on the whole workload, ' if args.full_warm_up else ''}"
        f"{torch.cuda.get_device_name()}"
    )
    print(
        profile_steps(
            engine, prompts, params, args.steps, args.prefill, args.trace, args.full_warm_up
        )
    )
    engine.step_times.clear()  # the same run again, not profiled: the profiler slows the host
    engine.generate(prompts, params)
    by_mode: dict[str, list[float]] = collections.defaultdict(list)
    for mode, seconds in engine.step_times:
        by_mode[mode].append(seconds * 1e3)
    print(
        "not profiled, median step ms: "
        + ", ".join(f"{m} {statistics.median(v):.3f} x{len(v)}" for m, v in by_mode.items())
    )
    if engine.spec is not None:
        print(f"engine stats: {dict(engine.stats)}")


if __name__ == "__main__":
    main()
