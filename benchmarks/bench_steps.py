"""Verify step vs decode step on the GPU (random Llama-3-8B bf16, captured graphs), and the
tokens/s that speculation gives as a function of the accepted length per step.

    python benchmarks/bench_steps.py [--context 1024] [--accepted 0,0.5,1,1.5,2,3,4]
    python benchmarks/bench_steps.py --preset smollm2_135m --dtype float32 --batches 1 --profile
    python benchmarks/bench_steps.py --preset smollm2_135m --dtype float32 --tree-nodes 2,4,8,13

"forward" is `ModelRunner.forward` (plan + replay) one at a time; "replay" is the device's
time a pass, planned once and replayed back to back. `--pdl off,auto,late` times the passes
under each programmatic dependent launch setting named (`engine.pdl`: `auto`, the engine's
default, chooses per pass), one after the other in one process; `--pdl-kinds` does the same
for the kinds of launch PDL is kept to (`pdl.only_kinds`: e.g. `--pdl top --pdl-kinds
"all;products;attention,merge"`, to find which launches' overlap a pass gains or loses).
`--tree-nodes` times verify
passes of trees of those sizes in one engine (draft budget: the largest - 1), each replaying
the verify graph of the narrowest width it fits (`engine.shell.graphs.verify_widths`).
`--output-layer "cublas;package"` times the output layer's product as cuBLAS's and as the op
set's (or with an all-rows launch given as a JSON dict). `--timeline` prints each batch-1
pass's kernels as they lie on the device's timeline (torch.profiler): what each adds to the
pass's end and how long it runs beside the kernel before it (with PDL), to find which launches
a setting speeds or slows. `--verify-attention 'policy;{"BLOCK_N": 64, "num_warps": 4,
"num_stages": 3}'` times the verify passes with the attention's launch as the policy chooses it
(`decode_policy.choose_verify_config`) and with those settings laid over its choice.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

from engine import pdl
from engine.backends import decode_policy
from engine.model import LlamaModel
from engine.ops import gemv_policy
from engine.shell.engine import Engine
from engine.state import DraftTrees, FinishRules, Running, schedule_decode, schedule_verify


def tree_parents(nodes: int) -> list[int]:
    """A 12-draft tree of three branches of four, the shape the proposer makes for a
    short match (root, then chains)."""
    parents = [-1]
    for node in range(1, nodes):
        parents.append(0 if (node - 1) % 4 == 0 else node - 1)
    return parents


def batches(engine: Engine, batch: int, context: int, nodes: int):
    book = engine.book
    rows = [book.table.alloc_row() for _ in range(batch)]
    slots = book.slots.alloc(batch * context)
    cols = np.tile(np.arange(context), batch)
    book.table.write(np.repeat(rows, context), cols, slots)
    rules = FinishRules(
        np.full(batch, 10**6),
        np.zeros(batch),
        -np.ones(batch),
        np.zeros((batch, 0), dtype=np.int64),
    )
    last = np.arange(batch) + 5
    running = Running.admitted(
        np.arange(batch) + 10**6,
        rows,
        np.full(batch, context + 1),
        np.full(batch, context + 1),
        last,
        rules,
        engine.max_context,
        kv_lens=np.full(batch, context),
    )
    decode = schedule_decode(running, book.slots.alloc(batch))
    parents = tree_parents(nodes)
    trees = DraftTrees.from_lists([[int(t)] + [7] * (nodes - 1) for t in last], [parents] * batch)
    verify = schedule_verify(running, trees, book.slots.alloc(batch * nodes))
    return decode, verify


def release(engine: Engine, decode, verify) -> None:
    """Give back everything `batches` took (no transition commits these passes)."""
    book = engine.book
    for batch in (decode, verify):
        book.slots.free(batch.out_slots)
    for row, length in zip(
        decode.running.rows.tolist(), decode.running.kv_lens.tolist(), strict=True
    ):
        book.slots.free(book.table.host[row, :length])
        book.table.release_row(row)


def time_forward(engine: Engine, batch, repeats: int = 30) -> float:
    for _ in range(3):
        engine.runner.forward(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        engine.runner.forward(batch)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def time_replay(engine: Engine, batch, repeats: int = 50) -> float:
    """The device's time a pass: planned once, then launched `repeats` times back to back."""
    runner = engine.runner
    prepared = runner.prepare(batch)
    for _ in range(3):
        runner.launch(prepared, batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        runner.launch(prepared, batch)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def profile_passes(engine: Engine, context: int, nodes: int) -> None:
    """Top CUDA kernels of one graph-replayed batch-1 decode forward and one verify forward
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    decode, verify = batches(engine, 1, context, nodes)
    for name, batch in (("decode", decode), (f"verify ({nodes}-node tree)", verify)):
        time_forward(engine, batch, repeats=3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.runner.forward(batch)
            torch.cuda.synchronize()
        print(f"\none batch-1 {name} forward, CUDA kernels by total time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    release(engine, decode, verify)


def timeline(engine: Engine, batch, repeats: int = 20) -> list[str]:
    """Table rows of one pass's kernels on the device's timeline (torch.profiler, `repeats`
    replays of a planned pass): by kernel and grid, its launches a pass, mean duration, the
    time it adds to the pass's end (`step`: its end past every earlier kernel's end), the
    idle time before it starts (past every earlier end), and how long it runs beside the
    kernel before (with PDL, a kernel starts before the one before it ends)."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    prepared = runner.prepare(batch)
    for _ in range(3):
        runner.launch(prepared, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            runner.launch(prepared, batch)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    last_end = kernels[0]["ts"]
    for event in kernels:
        start, end = event["ts"], event["ts"] + event["dur"]
        grid = "x".join(str(g) for g in event.get("args", {}).get("grid", ()))
        entry = sums[event["name"][:48], grid]
        entry[0] += 1
        entry[1] += event["dur"]
        entry[2] += max(0.0, end - last_end)
        entry[3] += max(0.0, start - last_end)
        entry[4] += max(0.0, last_end - start)
        last_end = max(last_end, end)
    rows = []
    for (name, grid), (count, busy, step, idle, beside) in sorted(
        sums.items(), key=lambda item: -item[1][2]
    ):
        rows.append(
            f"| {name} | {grid} | {count / repeats:g} | {busy / count:.2f} | "
            f"{step / repeats:.1f} | {idle / repeats:.1f} | {beside / count:.2f} |"
        )
    total = sum(entry[2] + entry[3] for entry in sums.values()) / repeats
    rows.append(f"| all | | {len(kernels) / repeats:g} | | {total:.1f} | | |")
    return rows


def print_timelines(engine: Engine, context: int, tree_nodes: list[int], label: str) -> None:
    for nodes in tree_nodes:
        decode, verify = batches(engine, 1, context, nodes)
        for name, batch in (("decode", decode), (f"verify, {nodes} nodes", verify)):
            if name == "decode" and nodes != tree_nodes[0]:
                continue
            print(f"\n{label}: one batch-1 {name} pass on the device's timeline (us)")
            print(
                "| kernel | grid | launches | mean us | step a pass | idle before, a pass "
                "| mean beside the kernel before |"
            )
            print("|---|---|---|---|---|---|---|")
            print("\n".join(timeline(engine, batch)))
        release(engine, decode, verify)


def _cublas_logits(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, model.lm_head).float()


@contextlib.contextmanager
def output_layer(name: str) -> Iterator[None]:
    """Engines built in this block run the output layer as `name` says (`--output-layer`):
    'package', a JSON dict (the all-rows launch for float32 rows), or 'cublas'."""
    wide = gemv_policy.ROWS_WIDE_CONFIG
    with contextlib.ExitStack() as stack:
        if name == "cublas":
            stack.enter_context(mock.patch.object(LlamaModel, "logits", _cublas_logits))
        elif name != "package":
            gemv_policy.ROWS_WIDE_CONFIG = dict(json.loads(name))
        gemv_policy.linear_config.cache_clear()
        try:
            yield
        finally:
            gemv_policy.ROWS_WIDE_CONFIG = wide
            gemv_policy.linear_config.cache_clear()


# what `--verify-attention` may lay over the policy's choice: a verify launch's settings,
# positive ints, and whether its last split program merges the splits (a JSON boolean;
# verify passes run the merge kernel by default, `decode_policy.FUSED_MERGE_MAX_SPLITS`)
VERIFY_KEYS = frozenset(key for config, _ in decode_policy.VERIFY_CONFIGS for key in config)
VERIFY_SWITCHES = frozenset({"FUSED_MERGE"})


def verify_settings(name: str) -> dict:
    """`--verify-attention`'s entry as settings over the policy's choice ({} for 'policy');
    ValueError for anything but 'policy' or a JSON dict of VERIFY_KEYS to positive ints and
    VERIFY_SWITCHES to booleans."""
    if name == "policy":
        return {}
    try:
        settings = json.loads(name)
    except ValueError as error:
        raise ValueError(f"{name!r} is not 'policy' or a JSON dict: {error}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{name!r} is not 'policy' or a JSON dict")
    unknown = sorted(set(settings) - VERIFY_KEYS - VERIFY_SWITCHES)
    if unknown:
        raise ValueError(
            f"{name!r}: unknown key(s) {unknown}; they are {sorted(VERIFY_KEYS | VERIFY_SWITCHES)}"
        )
    checks = (
        (VERIFY_KEYS, lambda value: type(value) is int and value >= 1, "positive integers"),
        (VERIFY_SWITCHES, lambda value: type(value) is bool, "true or false"),
    )
    for keys, allowed, wording in checks:
        bad = {key: value for key, value in settings.items() if key in keys and not allowed(value)}
        if bad:
            raise ValueError(f"{name!r}: values of {sorted(keys)} must be {wording}; got {bad}")
    return settings


@contextlib.contextmanager
def verify_attention(name: str) -> Iterator[None]:
    """Engines built and passes run in this block launch the verify attention as `name` says
    (`--verify-attention`): 'policy' (`decode_policy.choose_verify_config`'s choice), or a
    JSON dict of launch settings laid over that choice. The graphs captured in the block
    keep the launch they captured."""
    settings = verify_settings(name)
    chosen = decode_policy.choose_verify_config

    def laid_over(programs: int, num_sms: int, rows: int) -> dict:
        return {**chosen(programs, num_sms, rows), **settings}

    # `decode_policy.decode_launch`, which every decode_attention call asks, looks it up
    with mock.patch.object(decode_policy, "choose_verify_config", laid_over):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="the engine's max_context (its request table's width; default: context + 64)",
    )
    parser.add_argument("--draft-budget", type=int, default=12)
    parser.add_argument(
        "--tree-nodes",
        default=None,
        help="verify tree sizes, comma-separated (default: the draft budget + 1); the "
        "engine's draft budget becomes the largest - 1",
    )
    parser.add_argument("--accepted", default="0,0.5,1,1.5,2,3,4")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print the kernel breakdown of one batch-1 decode and verify forward",
    )
    parser.add_argument(
        "--preset", default="llama3_8b", help="random weights of this shape (smollm2_135m, ...)"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--batches", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument(
        "--pdl",
        default="auto",
        help=f"programmatic dependent launch settings, comma-separated, of {sorted(pdl.SETTINGS)}",
    )
    parser.add_argument(
        "--pdl-kinds",
        default="all",
        help=f"the kinds of launch PDL runs on, sets separated by ';' (each 'all' or kinds of "
        f"{list(pdl.KINDS)} separated by commas), each timed in turn",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also print each batch-1 pass's kernels on the device's timeline: what each adds "
        "to the pass's end, and how long it runs beside the one before (PDL)",
    )
    parser.add_argument(
        "--output-layer",
        default="package",
        help="the output layer's product, launches separated by ';', each timed in turn: "
        "'package' (the op set's: `gemv_policy.ROWS_WIDE_CONFIG` for float32 rows), a JSON "
        "dict (the op set's with that all-rows launch), or 'cublas' (F.linear at every row "
        "count)",
    )
    parser.add_argument(
        "--verify-attention",
        default="policy",
        help="the verify attention's launch, entries separated by ';', each timed in turn: "
        "'policy' (the engine's choice) or a JSON dict of settings laid over it, of "
        f"{sorted(VERIFY_KEYS)} (positive integers) and {sorted(VERIFY_SWITCHES)} (booleans)",
    )
    args = parser.parse_args()
    tree_nodes = [int(n) for n in (args.tree_nodes or str(args.draft_budget + 1)).split(",")]
    if min(tree_nodes) < 2:
        parser.error(
            f"--tree-nodes: sizes must be at least 2 (a root and a draft); got {tree_nodes}"
        )
    nodes = max(tree_nodes)
    settings = args.pdl.split(",")
    unknown = sorted(set(settings) - set(pdl.SETTINGS))
    if unknown:  # before any engine is built
        parser.error(f"--pdl: unknown setting(s) {unknown}; they are {sorted(pdl.SETTINGS)}")
    kind_sets = args.pdl_kinds.split(";")
    for kinds in kind_sets:  # before any engine is built
        try:
            with pdl.only_kinds(kinds):
                pass
        except ValueError as error:
            parser.error(f"--pdl-kinds: {error}")
    layers = args.output_layer.split(";")
    for layer in layers:
        if layer not in ("package", "cublas"):
            try:
                dict(json.loads(layer))
            except (ValueError, TypeError) as error:
                parser.error(
                    f"--output-layer: {layer!r} is not 'package', 'cublas' or a dict: {error}"
                )
    attentions = args.verify_attention.split(";")
    for attention in attentions:
        try:
            verify_settings(attention)
        except ValueError as error:
            parser.error(f"--verify-attention: {error}")
    # (PDL setting, kinds, output layer, verify attention) -> [(batch, tree nodes, forward
    # decode, verify, replay decode, verify)]
    results: dict[tuple[str, str, str, str], list[tuple]] = {}
    runs = [(o, k, w, a) for o in settings for k in kind_sets for w in layers for a in attentions]
    for on, kinds, layer, attention in runs:
        with (
            pdl.using(on),
            pdl.only_kinds(kinds),
            output_layer(layer),
            verify_attention(attention),
        ):
            engine = Engine(
                random_weights=args.preset,
                device="cuda",
                dtype=args.dtype,
                speculative=True,
                draft_budget=nodes - 1,
                max_running_requests=64,
                cuda_graph_max_batch=64,
                max_context=args.max_context or args.context + 64,
                kv_cache_fraction=0.3,
            )
            results[on, kinds, layer, attention] = []
            for batch in (int(b) for b in args.batches.split(",")):
                decode_times = None
                for size in tree_nodes:
                    decode, verify = batches(engine, batch, args.context, size)
                    if decode_times is None:
                        decode_times = time_forward(engine, decode), time_replay(engine, decode)
                    f_verify, r_verify = time_forward(engine, verify), time_replay(engine, verify)
                    results[on, kinds, layer, attention].append(
                        (batch, size, decode_times[0], f_verify, decode_times[1], r_verify)
                    )
                    release(engine, decode, verify)
                    engine.check()
            if args.profile:
                profile_passes(engine, args.context, nodes)
            if args.timeline:
                label = f"PDL {on}, kinds {kinds}, output layer {layer}, verify {attention}"
                print_timelines(engine, args.context, tree_nodes, label)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    accepted = [float(a) for a in args.accepted.split(",")]
    print(
        f"\n{torch.cuda.get_device_name()}, random {args.preset} {args.dtype}, "
        f"context {args.context}, max_context {args.max_context or args.context + 64}, "
        f"draft budget {nodes - 1}, CUDA graphs"
    )
    print(
        "| PDL | PDL kinds | output layer | verify attention | batch | tree nodes | forward: "
        "decode ms | verify ms | verify/decode | replay: decode ms | verify ms | verify/decode |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (on, kinds, layer, attention), rows in results.items():
        for batch, size, f_decode, f_verify, r_decode, r_verify in rows:
            print(
                f"| {on} | {kinds} | {layer} | {attention} | {batch} | {size} | {f_decode:.3f} | "
                f"{f_verify:.3f} | "
                f"{f_verify / f_decode:.2f} | {r_decode:.3f} | {r_verify:.3f} | "
                f"{r_verify / r_decode:.2f} |"
            )
    print("\ntokens/s with speculation at a mean accepted length a (tokens/step = 1 + a)")
    print("| batch | tree nodes | no spec | " + " | ".join(f"a={a:g}" for a in accepted) + " |")
    print("|---|---|---|" + "---|" * len(accepted))
    for batch, size, t_decode, t_verify, _, _ in next(iter(results.values())):
        cells = [f"{batch * (1 + a) / t_verify * 1e3:.0f}" for a in accepted]
        print(f"| {batch} | {size} | {batch / t_decode * 1e3:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
