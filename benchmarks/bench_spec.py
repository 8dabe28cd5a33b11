"""N-gram speculative decoding (default model, batch 1; CPU fp32 unless told): tokens/s without and
with speculation, and HF transformers greedy / prompt lookup on the same prompts; accepted
tokens per verify step; the same engine with adaptive drafting on acceptance alone (drafts
counted free); tokens/s of the decode phase alone (steps after prefill), which speculation
speeds up; where the engine multiplies on AMX tiles, its plain decoding on AVX-512 FMAs too
(the faster plain path at batch 1 there); plots docs/spec_accepted.png and
docs/spec_throughput.png.

Run: .venv/bin/python benchmarks/bench_spec.py [--max-tokens 128] [--long-max-tokens 512]
     [--quick] [--threads 1] [--only WORKLOAD] [--row-major-weights] [--no-plots]
     [--device cuda --dtype float32]   (on a GPU: no plots; the docs' plots are the CPU's)
     [--profile] [--without-run-limit]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
from spec_systems import (  # benchmarks/, beside this script
    HF,
    OnFmas,
    Ours,
    freeze,
    split_options,
    timed,
    variant,
)
from spec_workloads import PARTS, workloads

from engine import cpu_kernels
from engine.model.tokenizer import Tokenizer
from engine.spec import SpecConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def rates(results: dict, plain: Ours, spec: Ours, which: range | None = None) -> dict:
    """tokens/s per system over the prompts `which` (default: all), and of the decode phase
    (every token but each request's first, over the steps after prefill) for ours."""
    picked = range(len(results["ours"][1])) if which is None else which
    rate = {}
    for key, (seconds, outputs) in results.items():
        rate[key] = sum(len(outputs[i]) for i in picked) / sum(seconds[i] for i in picked)
    for key, system in (("ours", plain), ("ours+spec", spec)):
        outputs = results[key][1]
        rate[f"{key}, decode phase"] = sum(len(outputs[i]) - 1 for i in picked) / sum(
            system.decode_seconds[i] for i in picked
        )
    return rate


def what_2x_needs(results: dict, plain: Ours, spec: Ours, parts: dict[str, range]) -> str:
    """From this run's times: the share of plain decoding's time that prefill takes (the same
    with speculation), the decode-phase speedup 2x end to end needs, and, per kind of prompt,
    the most the workload could reach end to end if the other kinds decoded in no time."""
    seconds = results["ours"][0]
    total = sum(seconds)
    prefill = total - sum(plain.decode_seconds)
    decoding = total - prefill
    needed = decoding / (total / 2 - prefill) if total / 2 > prefill else float("inf")
    text = (
        f"prefill is {prefill / total:.0%} of plain decoding's time: 2x end to end needs "
        f"{needed:.2f}x in the decode phase"
    )
    for part, which in parts.items():
        alone = sum(spec.decode_seconds[i] for i in which)  # only this kind's decoding left
        text += f"; at most {total / (prefill + alone):.2f}x with {part} as measured"
    return text


def replay(
    prompts: list[list[int]],
    outputs: list[list[int]],
    budget: int = 12,
    draft_cost: float | None = None,
) -> float:
    """Replays the real greedy outputs through a fresh proposer, no model in the loop; each
    step accepts the longest tree path that matches the output, plus the bonus token.

    draft_cost None: the proposer's ceiling, tokens per verify step at a fixed budget.
    draft_cost c: the decode-phase speedup over plain decoding with adaptive drafting judged
    at c, if a pass with d drafts cost 1 + c * d decode passes (as the engine's cost model
    says): emitted tokens / that cost."""
    from engine.spec import NgramProposer, SpecStats

    adaptive = draft_cost is not None
    config = SpecConfig(draft_budget=budget, adaptive=adaptive)
    steps = tokens = 0
    cost = 0.0
    for rid, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if not output:
            continue
        proposer, stats = NgramProposer(config), SpecStats(config)
        proposer.add_request(rid, [*prompt, output[0]])  # the first output is the pending one
        stats.add(rid)
        position = 1
        while position < len(output):
            room = len(output) - position - 1  # the engine's budgets stop at max_tokens too
            tree = proposer.propose(rid, budget=min(stats.budget(rid), room))
            node, accepted = 0, 0
            while position + accepted < len(output):
                want = output[position + accepted]
                children = [c for c, p in enumerate(tree.parents) if p == node]
                match = next((c for c in children if tree.tokens[c] == want), None)
                if match is None:
                    break
                node, accepted = match, accepted + 1
            drafted = len(tree.tokens) - 1
            stats.record(rid, drafted, accepted, draft_cost or 0.0)
            emitted = min(accepted + 1, len(output) - position)
            proposer.extend(rid, output[position : position + emitted])
            position += emitted
            steps += 1
            cost += 1 + (draft_cost or 0.0) * drafted
        tokens += len(output) - 1
    if not steps:
        return 0.0
    return tokens / cost if adaptive else tokens / steps


REPLAY_COSTS = (0.0, 0.05, 0.1, 0.2)
# adaptive drafting without the run's loss limit and the probes' backoff (`--without-run-limit`)
ENDLESS_RUNS = {"max_run_loss": math.inf, "max_probe_interval": SpecConfig().probe_interval}


def step_profile(system: Ours) -> str:
    """Mean and median step time per mode (ms) over the steps of the workload: two decimals,
    as a small model's steps on a GPU (about 1 ms) differ by tenths of a millisecond. A
    decode step right after a verify step counts apart ("decode after verify"), and so do the
    verify passes walked on the device and those of them whose walk the host's contradicted
    (the decode pass launched on it dropped)."""
    by_mode: dict[str, list[float]] = {}
    previous = None
    for mode, seconds in system.steps:
        kind = "decode after verify" if mode == "decode" and previous == "verify" else mode
        by_mode.setdefault(kind, []).append(seconds * 1e3)
        previous = mode
    times = ", ".join(
        f"{mode} {statistics.mean(v):.2f} ms (median {statistics.median(v):.2f}) x{len(v)}"
        for mode, v in sorted(by_mode.items())
    )
    walks = system.since_clear("walks_ahead")
    if not walks:
        return times
    dropped = system.since_clear("walks_ahead_dropped")
    return f"{times}; verify passes walked on the device x{walks} (dropped x{dropped})"


def run(args: argparse.Namespace) -> None:
    chosen = workloads(args.quick, args.max_tokens, args.long_max_tokens)
    unknown = set(args.only) - set(chosen)
    if unknown:
        raise SystemExit(f"--only: no workload {sorted(unknown)}; there are {sorted(chosen)}")
    torch.set_num_threads(args.threads)
    # the layout A/B is about dense weights: it loads them dequantized (no block kernel)
    blocks = not args.row_major_weights
    on = {"device": args.device, "dtype": args.dtype, **dict(args.engine_option)}
    plain, spec = Ours(False, blocks, **on), Ours(True, blocks, **on)
    # A/B of adaptive drafting: budgets judged on acceptance alone (drafts counted free)
    acceptance_only = Ours(True, blocks, draft_cost=0.0, **on)
    # A/B of the run's loss limit and the probes' backoff: drafting as before them
    endless = (
        Ours(True, blocks, spec_overrides=ENDLESS_RUNS, **on) if args.without_run_limit else None
    )
    if args.row_major_weights:  # A/B of the CPU weight layout (the engines share the model)
        for weight in plain.engine.runtime.model.parameters():
            weight.data = weight.data.contiguous()
    tokenizer = plain.engine.tokenizer
    if tokenizer is None:
        raise SystemExit(
            "bench_spec.py needs the model's tokenizer for its chat prompts: "
            "no --engine-option random_weights"
        )
    speculator = spec.engine.spec
    assert speculator is not None  # Ours(True) builds a speculative engine
    hf_model = HF.load(args.device, args.dtype)
    systems: dict[str, Ours | HF] = {
        "ours": plain,
        "ours+spec": spec,
        "spec, acceptance only": acceptance_only,
        "HF": HF(None, hf_model),
        "HF+lookup": HF(args.lookup, hf_model),
    }
    if endless is not None:
        systems["spec, no run limit"] = endless
    # A/B of engine settings with speculation, in the same turns (`--spec-variant`)
    variants = {}
    for name, options in args.spec_variant:
        spec_options, engine_options = split_options(options)
        variants[f"spec, {name}"] = Ours(
            True, blocks, spec_overrides=spec_options, **{**on, **engine_options}
        )
    systems.update(variants)
    if (
        args.device == "cpu"
        and blocks
        and cpu_kernels.usable("cpu", torch.float32)
        and (cpu_kernels.amx())
    ):
        systems["ours on FMAs"] = OnFmas(False, blocks, **on)
    warm = [tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])]
    if args.device != "cpu":  # Triton compiles per shape: every kind of step, before timing
        warm += [tokenizer.apply_chat_template(chats[0]) for chats, _ in chosen.values()]
    for ids in warm:
        for system in systems.values():
            system.generate(ids, 8 if len(warm) == 1 else 64)
    freeze([system.engine for system in systems.values() if isinstance(system, Ours)])
    rows, part_rows, accepted_per_workload = [], [], {}
    for name, (chats, max_tokens) in chosen.items():
        if args.only and name not in args.only:
            continue
        prompts = [tokenizer.apply_chat_template(chat) for chat in chats]
        for ours in (plain, spec, acceptance_only, endless, *variants.values()):
            if ours is not None:
                ours.clear()
        results = timed(systems, prompts, max_tokens)
        accepted_per_workload[name] = (list(spec.accepted), list(spec.boundaries))
        outputs = results["ours"][1]
        same = all(
            results[key][1] == outputs
            for key in ("ours+spec", "spec, acceptance only", "spec, no run limit", *variants)
            if key in results
        )
        rate = rates(results, plain, spec)
        parts = {} if args.quick else PARTS.get(name, {})  # quick: fewer prompts, no kinds
        for part, which in parts.items():
            part_rows.append((name, part, rates(results, plain, spec, which)))
        print(f"[{name}] {what_2x_needs(results, plain, spec, parts)}", flush=True)
        mean_accepted = statistics.mean(spec.accepted) if spec.accepted else 0.0
        print(
            f"[{name}] steps: plain {step_profile(plain)}; "
            f"spec {step_profile(spec)}; measured draft cost "
            f"{speculator.last_draft_cost:.3f} decoded tokens per draft row, verify "
            f"premium {speculator.cost.verify_premium(1):.2f} decoded tokens a pass",
            flush=True,
        )
        if endless is not None:
            print(
                f"[{name}] without the run limit and probe backoff: "
                f"{rate['spec, no run limit'] / rate['ours']:.2f}x no-spec, "
                f"{rate['ours+spec'] / rate['spec, no run limit']:.2f}x of it with them; "
                f"steps {step_profile(endless)}",
                flush=True,
            )
        for key, other in variants.items():
            decode_phase = sum(len(o) - 1 for o in results[key][1]) / sum(other.decode_seconds)
            print(
                f"[{name}] {key}: {rate[key] / rate['ours']:.2f}x no-spec end to end, "
                f"{decode_phase / rate['ours, decode phase']:.2f}x in the decode phase; "
                f"ours+spec {rate['ours+spec'] / rate[key]:.2f}x of it; "
                f"steps {step_profile(other)}",
                flush=True,
            )
        ceiling = replay(prompts, outputs)
        if "ours on FMAs" in results:
            rate["plain paths agree"] = results["ours on FMAs"][1] == outputs
        rows.append((name, len(prompts), max_tokens, mean_accepted, rate, same, ceiling))
        print(
            f"[{name}] proposer ceiling on these outputs (no model, outputs known): "
            f"{ceiling:.2f} tokens per verify step",
            flush=True,
        )
        speedups = ", ".join(
            f"{replay(prompts, outputs, draft_cost=c):.2f}x at {c}" for c in REPLAY_COSTS
        )
        print(
            f"[{name}] decode-phase speedup the adaptive proposer reaches on these outputs "
            f"if a draft row costs c decoded tokens: {speedups}",
            flush=True,
        )
    print_table(rows, args)
    print_paths(rows)
    print_parts(part_rows)
    if args.profile:
        profile_host(spec, tokenizer, chosen[args.only[0] if args.only else "copy-heavy"])
    if not (args.no_plots or args.only or args.device != "cpu"):  # the docs' show every one
        plot(accepted_per_workload, rows, args)


def profile_host(spec: Ours, tokenizer: Tokenizer, workload: tuple[list, int]) -> None:
    """The speculative engine's Python functions by their own time, over one workload (where
    a step's host time goes: on a GPU it is most of a small model's step)."""
    import cProfile
    import pstats

    chats, max_tokens = workload
    profile = cProfile.Profile()
    profile.enable()
    for chat in chats:
        spec.generate(tokenizer.apply_chat_template(chat), max_tokens)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


def print_table(rows: list, args: argparse.Namespace) -> None:
    where = (
        f"{args.threads} torch thread(s)"
        if args.device == "cpu"
        else torch.cuda.get_device_name(args.device)
    )
    print(
        f"\nbatch 1, {args.dtype}, {args.device} ({where}), "
        f"HF prompt_lookup_num_tokens={args.lookup}"
    )
    print(
        "| workload | prompts | max tokens | accepted/step | ours tok/s | ours+spec tok/s | "
        "HF tok/s | HF+lookup tok/s | spec/no-spec | spec/HF-lookup | spec == no-spec | "
        "proposer ceiling | acceptance-only adaptation / no-spec | "
        "decode phase: ours / ours+spec tok/s (spec/no-spec) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, count, max_tokens, mean_accepted, rate, same, ceiling in rows:
        print(
            f"| {name} | {count} | {max_tokens} | {mean_accepted:.2f} | {rate['ours']:.1f} | "
            f"{rate['ours+spec']:.1f} | {rate['HF']:.1f} | {rate['HF+lookup']:.1f} | "
            f"{rate['ours+spec'] / rate['ours']:.2f}x | "
            f"{rate['ours+spec'] / rate['HF+lookup']:.2f}x | {'yes' if same else 'NO'} | "
            f"{ceiling:.2f} tokens/step | "
            f"{rate['spec, acceptance only'] / rate['ours']:.2f}x | "
            f"{rate['ours, decode phase']:.1f} / {rate['ours+spec, decode phase']:.1f} "
            f"({rate['ours+spec, decode phase'] / rate['ours, decode phase']:.2f}x) |"
        )


def print_paths(rows: list) -> None:
    """Where the engine multiplies on AMX tiles: its plain decoding against the same engine on
    AVX-512 FMAs (the faster plain path at batch 1), and speculation against both."""
    if not rows or "ours on FMAs" not in rows[0][4]:
        return
    print(
        "\n| workload | ours (AMX) tok/s | ours on FMAs tok/s | ours+spec (AMX) tok/s | "
        "spec / no-spec on FMAs | FMA tokens == AMX tokens |"
    )
    print("|---|---|---|---|---|---|")
    for name, _, _, _, rate, _, _ in rows:
        print(
            f"| {name} | {rate['ours']:.1f} | {rate['ours on FMAs']:.1f} | "
            f"{rate['ours+spec']:.1f} | {rate['ours+spec'] / rate['ours on FMAs']:.2f}x | "
            f"{'yes' if rate['plain paths agree'] else 'no'} |"
        )


def print_parts(part_rows: list) -> None:
    """The copy-heavy workloads by kind of prompt, from the same runs."""
    if not part_rows:
        return
    print(
        "\n| workload | prompts | ours tok/s | ours+spec tok/s | spec/no-spec | "
        "decode phase: ours / ours+spec tok/s (spec/no-spec) |"
    )
    print("|---|---|---|---|---|---|")
    for name, part, rate in part_rows:
        print(
            f"| {name} | {part} | {rate['ours']:.1f} | {rate['ours+spec']:.1f} | "
            f"{rate['ours+spec'] / rate['ours']:.2f}x | "
            f"{rate['ours, decode phase']:.1f} / {rate['ours+spec, decode phase']:.1f} "
            f"({rate['ours+spec, decode phase'] / rate['ours, decode phase']:.2f}x) |"
        )


def plot(
    accepted: dict[str, tuple[list[int], list[int]]], rows: list, args: argparse.Namespace
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    DOCS.mkdir(exist_ok=True)
    figure, all_axes = plt.subplots(
        len(accepted), 1, figsize=(9, 2.4 * len(accepted)), sharey=True, squeeze=False
    )
    for axes, (name, (lens, bounds)) in zip(all_axes[:, 0], accepted.items(), strict=True):
        axes.bar(range(len(lens)), lens, width=1.0)
        for bound in bounds[:-1]:
            axes.axvline(bound - 0.5, color="grey", linewidth=0.6, linestyle=":")
        mean = statistics.mean(lens) if lens else 0.0
        axes.set_title(
            f"{name}: {mean:.2f} accepted drafts per verify step (dotted lines: next prompt)",
            fontsize=9,
        )
        axes.set_ylabel("accepted")
    all_axes[-1, 0].set_xlabel("verify step (batch 1, draft budget 12)")
    figure.tight_layout()
    figure.savefig(DOCS / "spec_accepted.png", dpi=110)
    figure, axes = plt.subplots(figsize=(8, 3.5))
    keys = ["ours", "ours+spec", "HF", "HF+lookup"]
    width = 0.2
    for k, key in enumerate(keys):
        values = [rate[key] for _, _, _, _, rate, *_ in rows]
        xs = [i + (k - 1.5) * width for i in range(len(rows))]
        bars = axes.bar(xs, values, width, label=key)
        axes.bar_label(bars, fmt="%.1f", fontsize=7)
    axes.set_xticks(range(len(rows)), [name for name, *_ in rows])
    axes.set_ylabel("tokens/s")
    axes.set_title(f"Batch 1 greedy, SmolLM2-135M fp32, CPU ({args.threads} thread(s))")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(DOCS / "spec_throughput.png", dpi=110)
    print(f"wrote {DOCS / 'spec_accepted.png'} and {DOCS / 'spec_throughput.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--long-max-tokens",
        type=int,
        default=512,
        help="max tokens of the copy-heavy, long workload",
    )
    parser.add_argument(
        "--only", action="append", default=[], help="run only this workload (repeatable)"
    )
    parser.add_argument("--quick", action="store_true", help="one or two prompts per workload")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument(
        "--row-major-weights",
        action="store_true",
        help="dense weights (no block kernel), stored row-major (the layout before column-major)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--without-run-limit",
        action="store_true",
        help="also time speculation without the run's loss limit and the probes' backoff "
        "(SpecConfig max_run_loss=inf, max_probe_interval=probe_interval)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (ours and HF alike)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then profile the speculative engine's host code over one "
        "workload (the first --only, else copy-heavy)",
    )
    parser.add_argument(
        "--engine-option",
        type=engine_option,
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an engine setting every engine here takes (an EngineConfig field, its value "
        "as JSON: e.g. cuda_graph_max_tokens=1024); repeatable",
    )
    parser.add_argument(
        "--spec-variant",
        type=variant,
        action="append",
        default=[],
        metavar="[NAME:]FIELD=VALUE[,FIELD=VALUE]",
        help="also time the speculative engine with these settings (EngineConfig fields, or "
        "SpecConfig fields that are no engine option, values as JSON), in the same turns "
        "(e.g. verify_ahead=false); repeatable, one engine each",
    )
    run(parser.parse_args())


def engine_option(text: str) -> tuple[str, object]:
    """`FIELD=VALUE` -> (field, value), the value read as JSON (a bare word as a string)."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=VALUE")
    try:
        return field, json.loads(value)
    except json.JSONDecodeError:
        return field, value


if __name__ == "__main__":
    main()
