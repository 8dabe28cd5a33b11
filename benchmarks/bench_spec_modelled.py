"""Speculation's speed-up on a GPU, modelled on a CPU: the default model runs here (fp32, batch
1, greedy, the prompts of `bench_spec.py`), and each engine's steps are timed as a GPU would
run them, from a table of its pass times and the host's gaps.

    .venv/bin/python benchmarks/bench_spec_modelled.py [--only nothing-to-copy] [--quick]
        [--gap-ms 0.45] [--verify-gap-ms 0] [--variant FIELD=VALUE ...]

Why: the policies that decide what speculation drafts (`SpecConfig`, the engine's launches)
change which passes run, not how long a pass takes; a GPU session is short, and its run to
run noise (tens of percent between processes) hides changes of a few percent. The tokens,
trees and launches here are the engine's own; only the clock is modelled.

The model of the device: passes run one after another. A decode pass takes `--decode-ms`; a
verify pass the time of the verify graph its widest tree replays (`graphs.verify_widths`:
trees of up to 4, 8 and 13 nodes, `--verify-ms`; a fourth value times a 16-node graph, which
a draft budget of 13 to 15 makes). Where a pass's tokens are read on the host
and no later pass was launched yet (nothing queued on the device), the device waits for the
host's work up to the next launch: `--gap-ms` (the commit, the proposer, the plan). A pass
launched ahead (before the last one's tokens are read) leaves no such wait; neither a plain
engine's decode steps nor a speculative engine's where no request will draft wait at all.
`--verify-gap-ms` sets the wait after a verify pass's read apart: 0 models the next pass
launched before the host's walk of the verify pass's trees (a walk on the device), the ceiling
of that design; the "best path" column says how often such a walk along each tree's best path
would have found the accepted drafts (`best_path_outcomes`). Prompts' extend passes are left
out (the same in both engines): the figures are the decode phase's. The engines' cost model
(`PassCost`) fits these modelled step times, not the CPU's, so adaptive drafting decides as on
that GPU.

Defaults: the H200's pass times for the default model, fp32, batch 1, CUDA graphs
(`bench_steps.py --tree-nodes`, commits d334021/adb8462: decode 0.61 ms; verify 0.77, 0.84 and
1.31 ms for 4, 8 and 13 rows). The gap, 0.45 ms, lies among the host's times from a pass's read
to the next launch that `bench_host_step.py --gaps` measures on a 2-vCPU VM (0.29-0.51 ms);
with it the modelled ratios fall within those measured on the H200 (chat 0.91-0.97x;
copy-heavy 1.6-1.8x in the decode phase).

`--host-scale S` models the host instead of a constant gap (`HostTimeline`): this process's
own time outside the model's forward, times S, on a clock of its own beside the device's. Where
the host's work per step outlasts a pass (a small model on a fast GPU: the H200's plain decode
steps took 0.68-0.81 ms against a 0.61 ms pass) the device waits on every step, and what
counts is the host's work per token rather than the waits around verify passes. The two
models can disagree: a policy is settled on the GPU, and these runs say which A/Bs to make.

Each variant (`--variant FIELD=VALUE`: a `SpecConfig` field, else an `EngineConfig` field;
`name:FIELD=VALUE,FIELD=VALUE` for several) runs beside the default speculative engine and
the plain one, prompt by prompt; every engine must emit the same tokens (greedy).
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_systems import override_spec, split_options, variant  # noqa: E402  (benchmarks/, beside this)
from spec_workloads import CHATS_MORE, workloads  # noqa: E402

from engine.shell.engine import Engine  # noqa: E402
from engine.shell.graphs import verify_widths  # noqa: E402
from engine.shell.walk import BestPaths  # noqa: E402
from engine.spec import SpecConfig  # noqa: E402
from engine.state import SamplingParams  # noqa: E402

# The tree widths `--verify-ms` times, in order (its first three values are required).
TIMED_WIDTHS = (4, 8, 13, 16)


class DeviceModel:
    """The modelled device of one engine: its passes in launch order (a FIFO of pass times),
    each read taking the oldest; a read that leaves nothing queued costs the gap."""

    def __init__(
        self,
        decode_ms: float,
        verify_ms: dict[int, float],
        gap_ms: float,
        verify_gap_ms: float | None = None,
    ) -> None:
        """`verify_gap_ms`: the wait after a verify pass's read instead (default `gap_ms`)."""
        self.decode_ms, self.gap_ms = decode_ms, gap_ms
        self.verify_gap_ms = gap_ms if verify_gap_ms is None else verify_gap_ms
        self.charged = 0.0  # the wait charged at the last read
        self.widths = sorted(verify_ms)
        self.verify_ms = verify_ms
        self.queued: list[float] = []
        self.step_ms = 0.0  # the modelled time of the step running now
        self.total_ms = 0.0  # of the decode phase so far
        self.passes: dict[str, int] = {}
        self.waited: str | None = None  # the kind of pass whose read left the device idle
        self.wait_kinds: dict[str, int] = {}  # "read kind > next launch kind" -> count

    def pass_ms(self, batch) -> tuple[str, float]:
        if batch.trees is not None:
            nodes = int(batch.trees.sizes.lens.max())
            width = self.widths[bisect.bisect_left(self.widths, nodes)]
            return f"verify {width}", self.verify_ms[width]
        if batch.mode.name == "DECODE":
            return "decode", self.decode_ms
        return "extend", 0.0  # the prompt's: left out

    def launched(self, batch) -> None:
        kind, ms = self.pass_ms(batch)
        if self.waited is not None and kind == "extend":  # between two requests: not counted
            self.total_ms -= self.charged
        elif self.waited is not None:
            key = f"{self.waited} > {kind.split()[0]}"
            self.wait_kinds[key] = self.wait_kinds.get(key, 0) + 1
        self.waited = None
        self.passes[kind] = self.passes.get(kind, 0) + 1
        self.queued.append(ms)

    def read(self, kind: str = "decode") -> None:
        ms = self.queued.pop(0) if self.queued else 0.0
        self.charged = 0.0
        if ms and not self.queued:  # the device waits for the host's next launch
            self.charged = self.verify_gap_ms if kind == "verify" else self.gap_ms
            ms += self.charged
            self.waited = kind
        self.step_ms += ms
        self.total_ms += ms

    def request_done(self) -> None:
        """Passes launched ahead for a request that then finished are dropped unread."""
        self.queued.clear()


class HostTimeline(DeviceModel):
    """`--host-scale`: the host's own time measured instead of a constant gap. Two clocks:
    the host's (this process's time outside the model's forward, which on a GPU would be the
    device's, times `scale`) and the device's. A launch starts its pass once the device is
    free and the host has got there; a read waits for its pass to end. So the device waits
    wherever the host's work between a read and the next launch, or between launches, is
    longer than the passes queued (a step whose host work outlasts its pass included), and
    the host's proposals, plans and walks are charged as they took here."""

    def __init__(self, decode_ms: float, verify_ms: dict[int, float], scale: float) -> None:
        super().__init__(decode_ms, verify_ms, 0.0)
        self.scale = scale
        self.device_free_ms = 0.0
        self.ends: list[float] = []  # the queued passes' modelled ends
        self.mark = time.perf_counter()

    @property
    def host_ms(self) -> float:
        """The host's clock: every modelled millisecond is the host's, working or waiting."""
        return self.total_ms

    def _host_work(self) -> None:
        now = time.perf_counter()
        spent = (now - self.mark) * 1e3 * self.scale
        self.step_ms += spent
        self.total_ms += spent
        self.mark = now

    def launched(self, batch) -> None:
        self._host_work()
        kind, ms = self.pass_ms(batch)
        self.passes[kind] = self.passes.get(kind, 0) + 1
        start = max(self.device_free_ms, self.host_ms)
        if start > self.device_free_ms and self.device_free_ms and ms:  # the device waited
            key = f"{self.waited or 'launch'} > {kind.split()[0]}"  # launch: the host was late
            self.wait_kinds[key] = self.wait_kinds.get(key, 0) + 1
        self.waited = None
        self.device_free_ms = start + ms
        self.ends.append(self.device_free_ms)

    def resume(self) -> None:
        """The model's forward returned (its time on this CPU is no host's work)."""
        self.mark = time.perf_counter()

    def read(self, kind: str = "decode") -> None:
        self._host_work()
        end = self.ends.pop(0) if self.ends else self.host_ms
        if not self.ends:
            self.waited = kind
        if end > self.host_ms:  # the host waits for the pass
            waited = end - self.host_ms
            self.step_ms += waited
            self.total_ms += waited
        self.mark = time.perf_counter()

    def request_done(self) -> None:
        self._host_work()
        self.ends.clear()
        self.waited = None


def best_path_outcomes(trees, outcome) -> list[str]:
    """Per tree that drafted, where its accepted drafts lie against its best path (from the
    root, each node's first child: the proposer ranks siblings best first): "none" accepted,
    "all" of it, "part" of it (a prefix), or "off" it (another branch). The walk on the
    device (`walk_ahead`, `engine.shell.walk.BestPaths`) knows the next pass's input before
    the host's walk in every case but "off"."""
    paths = BestPaths.of(trees)
    bounds = outcome.accepted_lens.indptr().tolist()
    out = []
    for i, (size, length) in enumerate(
        zip(trees.sizes.lens.tolist(), paths.lens.tolist(), strict=True)
    ):
        if size == 1:
            continue
        path = paths.nodes[i, 1 : 1 + length].tolist()
        accepted = outcome.accepted_nodes[bounds[i] : bounds[i + 1]].tolist()
        if accepted != path[: len(accepted)]:
            out.append("off")
        else:
            out.append("none" if not accepted else "all" if accepted == path else "part")
    return out


def modelled_engine(
    device: DeviceModel, spec: bool, options: dict, outcomes: dict[str, int]
) -> Engine:
    """An engine launching as on a GPU (`launch_ahead`), its reads and launches hooked to
    `device`, its cost model fed the modelled step times; its verify outcomes counted in
    `outcomes` (`best_path_outcomes`)."""
    spec_options, engine_options = split_options(options)
    engine = Engine(speculative=spec, launch_ahead=True, **engine_options)
    passes = engine.passes
    forward = passes.forward

    def launched(batch, *args, **kwargs):
        device.launched(batch)
        try:
            return forward(batch, *args, **kwargs)
        finally:
            if isinstance(device, HostTimeline):
                device.resume()

    passes.forward = launched  # type: ignore[method-assign]  # the device's launches
    tokens = passes.tokens

    def read_tokens(*args, **kwargs):
        out = tokens(*args, **kwargs)
        device.read()
        return out

    passes.tokens = read_tokens  # type: ignore[method-assign]  # the device's reads
    if engine.spec is not None:
        override_spec(engine, spec_options)
        spec_state = engine.spec
        verify = spec_state._verify

        def read_verify(batch, *args, **kwargs):
            out = verify(batch, *args, **kwargs)
            device.read("verify")
            for kind in best_path_outcomes(batch.trees, out):
                outcomes[kind] = outcomes.get(kind, 0) + 1
            return out

        spec_state._verify = read_verify  # type: ignore[method-assign]  # a verify pass's read

        def observe(rows: int, started: float, verify: bool = False) -> None:
            if spec_state.config.draft_cost is None and spec_state.config.adaptive:
                spec_state.cost.observe_step(rows, device.step_ms / 1e3, verify)

        # the cost model fits the modelled step times, not the CPU's
        spec_state.observe = observe  # type: ignore[method-assign]
    elif spec_options:
        raise SystemExit(f"{sorted(spec_options)}: speculation settings need speculation")
    step = engine.step

    def modelled_step():
        device.step_ms = 0.0
        return step()

    engine.step = modelled_step  # type: ignore[method-assign]  # each step's time from 0
    return engine


def graph_times(widths: list[int], times: tuple[float, ...]) -> dict[int, float]:
    """Each verify graph's width -> its pass time: `times` (`--verify-ms`) holds the passes
    of trees of up to TIMED_WIDTHS nodes in order, and a graph takes the time of the
    narrowest of those it fits."""
    table = dict(zip(TIMED_WIDTHS, times, strict=False))
    if widths[-1] > max(table):
        raise SystemExit(f"--verify-ms times trees of up to {max(table)} nodes")
    return {w: table[min(t for t in table if t >= w)] for w in widths}


class System:
    """One engine and its modelled device; per workload: tokens, accepted drafts."""

    def __init__(self, name: str, spec: bool, options: dict, args: argparse.Namespace) -> None:
        budget = options.get("draft_budget", SpecConfig().draft_budget)
        verify_ms = graph_times(verify_widths(budget + 1), args.verify_ms)
        self.name = name
        self.device = (
            DeviceModel(args.decode_ms, verify_ms, args.gap_ms, args.verify_gap_ms)
            if args.host_scale is None
            else HostTimeline(args.decode_ms, verify_ms, args.host_scale)
        )
        self.outcomes: dict[str, int] = {}
        self.engine = modelled_engine(self.device, spec, options, self.outcomes)

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        if isinstance(self.device, HostTimeline):
            self.device.mark = time.perf_counter()
        out = self.engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
        self.device.request_done()
        return list(out.token_ids)

    def accepted(self) -> int:
        spec = self.engine.spec
        return 0 if spec is None else spec.stats.total().accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--long-max-tokens", type=int, default=512)
    parser.add_argument("--only", action="append", default=[], help="workload (repeatable)")
    parser.add_argument("--quick", action="store_true", help="one or two prompts per workload")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--decode-ms", type=float, default=0.61)
    parser.add_argument(
        "--verify-ms",
        type=lambda t: tuple(float(x) for x in t.split(",")),
        default=(0.77, 0.84, 1.31),
        help="verify passes of trees of up to 4, 8 and 13 nodes, and optionally 16 (a "
        "draft budget of 13 to 15)",
    )
    parser.add_argument("--gap-ms", type=float, default=0.45)
    parser.add_argument(
        "--verify-gap-ms",
        type=float,
        help="the wait after a verify pass's read instead of --gap-ms (0: the next pass "
        "launched before the host's walk, as a walk on the device would)",
    )
    parser.add_argument(
        "--host-scale",
        type=float,
        help="instead of --gap-ms: the host's own time as measured here, times this "
        "(`HostTimeline`)",
    )
    parser.add_argument("--variant", type=variant, action="append", default=[])
    args = parser.parse_args()
    if args.host_scale is not None and args.verify_gap_ms is not None:
        parser.error("--verify-gap-ms is a constant gap's: not with --host-scale")
    if not 3 <= len(args.verify_ms) <= len(TIMED_WIDTHS):
        parser.error(f"--verify-ms takes 3 or 4 times (trees of up to {TIMED_WIDTHS} nodes)")
    torch.set_num_threads(args.threads)
    chosen = workloads(args.quick, args.max_tokens, args.long_max_tokens)
    if not args.quick:
        chats = [[{"role": "user", "content": text}] for text in CHATS_MORE]
        chosen["chat, more"] = (chats, args.long_max_tokens // 2)
    unknown = set(args.only) - set(chosen)
    if unknown:
        raise SystemExit(f"--only: no workload {sorted(unknown)}; there are {sorted(chosen)}")
    systems = [System("plain", False, {}, args), System("spec", True, {}, args)]
    systems += [System(name, True, options, args) for name, options in args.variant]
    tokenizer = systems[0].engine.tokenizer
    assert tokenizer is not None  # the plain engine loads the default model
    print(
        f"modelled device: decode {args.decode_ms} ms, verify {args.verify_ms} ms "
        f"(4/8/13 nodes), gap {args.gap_ms} ms"
        + ("" if args.verify_gap_ms is None else f", after a verify pass {args.verify_gap_ms} ms")
        + "\n"
    )
    print(
        "| workload | engine | decode phase (ms) | plain / this | verify passes (by tree "
        "width) | device waits: after a decode, then a decode / then a verify; after a verify "
        "| accepted drafts | trees' accepted drafts on their best path: none / part / all; "
        "off it | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (chats, max_tokens) in chosen.items():
        if args.only and name not in args.only:
            continue
        before = [
            (
                s.device.total_ms,
                dict(s.device.wait_kinds),
                dict(s.device.passes),
                s.accepted(),
                dict(s.outcomes),
            )
            for s in systems
        ]
        outputs: dict[str, list[list[int]]] = {s.name: [] for s in systems}
        for index, chat in enumerate(chats):
            ids = tokenizer.apply_chat_template(chat)
            order = systems if index % 2 == 0 else list(reversed(systems))
            for system in order:
                outputs[system.name].append(system.generate(ids, max_tokens))
        plain_ms = systems[0].device.total_ms - before[0][0]
        for system, (ms, waits, passes, accepted, outcomes) in zip(systems, before, strict=True):
            device = system.device
            spent = device.total_ms - ms
            new = {k: v - passes.get(k, 0) for k, v in device.passes.items()}
            verify = ", ".join(
                f"{k.split()[1]}: {v}"
                for k, v in sorted(new.items())
                if k.startswith("verify") and v
            )
            waited = {k: v - waits.get(k, 0) for k, v in device.wait_kinds.items()}
            after_verify = waited.get("verify > decode", 0) + waited.get("verify > verify", 0)
            kinds = (
                f"{waited.get('decode > decode', 0)} / {waited.get('decode > verify', 0)}; "
                f"{after_verify}"
            )
            same = outputs[system.name] == outputs["plain"]
            new_outcomes = {k: v - outcomes.get(k, 0) for k, v in system.outcomes.items()}
            paths = "-"
            if new_outcomes:
                paths = " / ".join(str(new_outcomes.get(k, 0)) for k in ("none", "part", "all"))
                paths += f"; {new_outcomes.get('off', 0)}"
            print(
                f"| {name} | {system.name} | {spent:.1f} | {plain_ms / spent:.3f} | "
                f"{verify or '-'} | {kinds} | {system.accepted() - accepted} | {paths} | "
                f"{same} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
