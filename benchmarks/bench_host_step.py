"""The host's own work per decode step and per verify step, this tree's engine against another
commit's, stepped in lockstep in one process (CPU, `tiny` random weights, the model stubbed
out).

    .venv/bin/python benchmarks/bench_host_step.py --baseline d04f8de [--rounds 5]
    .venv/bin/python benchmarks/bench_host_step.py            # this tree alone
    .venv/bin/python benchmarks/bench_host_step.py --spec-against-plain   # what drafting
                                                   # nothing costs a step, with speculation
    .venv/bin/python benchmarks/bench_host_step.py --gaps --baseline d04f8de   # the host's
                                                   # time the device waits around verify passes

With a small model on a GPU a decode step is mostly host work (scheduling, planning the next
pass, sampling inputs, the commit, outputs), so that work decides its speed. On a shared
machine a process's speed moves by tens of percent from one run to the next, more than the
changes this measures; so both engines run in one process, their steps interleaved (each
round alternating which goes first), and the ratio is taken round by round.

The model's forward returns at once and its logits are rows of a fixed random table, so a
step's time is the host's; the time inside them is subtracted anyway. The speculation cost
model fits modelled pass times (a GPU's), not the stub's, so both engines draft alike. The
baseline's `engine` package is read from git (`git archive`) and imported as `engine_base`
(its imports rewritten). Regimes: greedy, sampled at temperature 1 (seeded), sampled with n-gram
speculation (most steps draft nothing), and greedy with speculation on repetitive text (the
prompt repeats a pattern and the stub's logits favour continuing it, so n-gram drafts are
proposed and mostly accepted); batch 1 and 8. Each prints both engines' median time per round
of each kind of step the regime ran (decode, verify), their ratio, whether they emitted the
same tokens and accepted as many drafts, and the mean drafts accepted a verify step (its
requests together).

`--gaps`: the engines launch ahead as on a GPU (`launch_ahead=True`), greedy with speculation
on repetitive text, and the host's time is taken where a GPU would wait for it around a verify
pass: "decode, then verify", from the read of a decode pass's tokens to the verify pass's
forward call (that step's commit, the proposer's trees, the verify pass's plan); "verify, then
decode" and "verify, then verify", from the verify walk's read of the pass's tokens to the
next pass's forward call (the walk, the commit, the next pass's plan, and before a verify
pass the proposer's trees). A decode pass launched ahead leaves no such gap.

`--launch-ahead`: the steps' host time as above, the engines launching ahead as on a GPU,
greedy with speculation on repetitive text: where the host's work is the step (a small model
on a GPU), the work done while a pass launched ahead runs counts too.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
REGIMES = {
    "greedy": dict(speculative=False, sampled=False, repetitive=False),
    "sampled": dict(speculative=False, sampled=True, repetitive=False),
    "speculative, sampled": dict(speculative=True, sampled=True, repetitive=False),
    "speculative, greedy": dict(speculative=True, sampled=False, repetitive=True),
}
# a decode step whose drafts wait for the next step (a pass launched ahead ran it): apart
# from the other decode steps, which `--launch-ahead` has most of
WAITING = "decode, drafts waiting"
STEP_KINDS = ("decode", WAITING, "verify")
GAP_KINDS = ("decode, then verify", "verify, then decode", "verify, then verify")
PERIOD = 12  # tokens in the pattern a repetitive prompt repeats
FAVOUR = 4.0  # added to the logit of the pattern's next token: it wins most rows, not all


def baseline_package(commit: str, into: Path) -> str:
    """`engine` at `commit`, unpacked under `into` as the package `engine_base`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "engine"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "engine").rename(into / "engine_base")
    renamed = re.compile(r"\b(from|import) engine\b|(?<=[\"'])engine(?=\.)")
    for path in (into / "engine_base").rglob("*.py"):
        text = path.read_text()
        path.write_text(renamed.sub(lambda m: m.group(0).replace("engine", "engine_base"), text))
    sys.path.insert(0, str(into))
    return "engine_base"


class StubbedModel:
    """Wraps an engine's model: a forward that returns at once, logits from a fixed table;
    `seconds` counts the time spent inside both. With `following` (the token favoured after
    each token, -1: none) the forward's hidden state is its input id and each row's logits
    favour that token's follower by `FAVOUR`."""

    def __init__(self, engine, table: torch.Tensor, following: torch.Tensor | None) -> None:
        model = engine.runner.model
        self.seconds, self.calls = 0.0, 0

        def forward(input_ids, *rest):
            if GapClock.current is not None:
                GapClock.current.device_work()
            started = time.perf_counter()
            if following is None:
                out = torch.zeros(input_ids.shape[0], 1)
            else:
                out = input_ids.to(torch.float32)[:, None]
            self.seconds += time.perf_counter() - started
            return out

        def logits(hidden):
            started = time.perf_counter()
            self.calls += 1
            start = (self.calls * 7) % (table.shape[0] - hidden.shape[0])
            out = table[start : start + hidden.shape[0]]
            if following is not None:
                favoured = following[hidden[:, 0].long()]
                out = out.clone()
                out[torch.arange(out.shape[0]), favoured] += FAVOUR
            self.seconds += time.perf_counter() - started
            return out

        model.forward, model.logits = forward, logits


class GapClock:
    """Times the host's gaps around verify passes in one engine (`--gaps`): from a pass's
    read (hooks on its passes' reads and on its speculator's greedy read of a verify pass)
    to the model's next forward call (`StubbedModel`), where a GPU's work would start; its
    passes' forward calls say which kind of pass that is. A gap that spans two steps counts the
    time inside them only (`pause`, `resume`: the other engine steps in between). The
    engine being stepped sets `GapClock.current` (a package's speculator module is shared
    by the engines of that package)."""

    current: GapClock | None = None
    _hooked: set[str] = set()

    def __init__(self, engine, package: str) -> None:
        self.read: tuple[str, float] | None = None  # the last pass read: its kind, when
        self.carried = 0.0  # a gap's time in earlier steps
        self.launching = "decode"  # the kind of pass launched last
        self.gaps: list[tuple[str, float]] = []
        passes = engine.passes
        passes.forward = self._on_forward(passes.forward)  # `Passes.launch` calls it too
        passes.tokens = GapClock._reading(passes.tokens, "decode")
        if package not in GapClock._hooked:
            # the package is named at run time: its module's attributes are not known here
            speculator: Any = importlib.import_module(f"{package}.shell.speculator")
            speculator.greedy_tokens = GapClock._reading(speculator.greedy_tokens, "verify")
            GapClock._hooked.add(package)

    @staticmethod
    def _reading(read, kind: str):
        """`read`, noting the time it returned at as a read of a `kind` pass's tokens."""

        def noted(*args, **kwargs):
            out = read(*args, **kwargs)
            if GapClock.current is not None:
                GapClock.current.read = (kind, time.perf_counter())
            return out

        return noted

    def _on_forward(self, forward):
        def launched(batch, *args, **kwargs):
            self.launching = "decode" if batch.trees is None else "verify"
            return forward(batch, *args, **kwargs)

        return launched

    def device_work(self) -> None:
        """The model's forward was called: the first since a read ends a gap."""
        if self.read is not None:
            read_kind, at = self.read
            seconds = self.carried + time.perf_counter() - at
            if read_kind == "verify" or self.launching == "verify":
                self.gaps.append((f"{read_kind}, then {self.launching}", seconds))
            self.read, self.carried = None, 0.0

    def pause(self) -> None:
        """The engine's step ended: a gap open now goes on at its next step."""
        if self.read is not None:
            kind, at = self.read
            self.carried += time.perf_counter() - at
            self.read = (kind, math.inf)

    def resume(self) -> None:
        if self.read is not None:
            self.read = (self.read[0], time.perf_counter())

    def take(self) -> list[tuple[str, float]]:
        """The gaps timed since the last call."""
        gaps, self.gaps = self.gaps, []
        return gaps


def modelled_pass_times(cost) -> None:
    """Have `cost` (a PassCost) fit a GPU's pass times (1.4 ms a pass, 0.02 ms a row, 2 ms
    more a verify pass) instead of the stubbed passes' measured ones: the fit still runs
    every verify step, but adaptive drafting decides alike in both engines, whose times
    differ (the drafts and accepted counts are then comparable)."""
    observe = cost.observe

    def modelled(rows: int, seconds: float, verify: bool = False) -> None:
        observe(rows, 0.0014 + 0.00002 * rows + 0.002 * verify, verify)

    cost.observe = modelled


def repetitive_prompts(
    rng: np.random.Generator, vocab: int, batch: int, length: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Per request a prompt repeating its own pattern of `PERIOD` distinct tokens, and the
    token favoured after each token: the next one of its pattern (any other token: the first
    of the first pattern, so that a diverted text comes back to a pattern)."""
    tokens = rng.permutation(np.arange(3, vocab))[: batch * PERIOD].reshape(batch, PERIOD)
    following = torch.full((vocab,), int(tokens[0, 0]), dtype=torch.long)
    for pattern in tokens.tolist():
        for position, token in enumerate(pattern):
            following[token] = pattern[(position + 1) % PERIOD]
    prompts = [np.resize(pattern, length).tolist() for pattern in tokens]
    return prompts, following


def run_regime(
    packages: dict,
    batch: int,
    regime: dict,
    tokens: int,
    rounds: int,
    speculative: dict | None = None,
    gaps: bool = False,
    launch_ahead: bool = False,
) -> dict:
    """`speculative`: engine name -> whether it speculates, where not as `regime` says;
    `gaps`: launch ahead, and time the gaps around verify passes (`GapClock`) instead of
    whole steps; `launch_ahead`: launch ahead, timing whole steps."""
    speculative = speculative or {}
    kinds = GAP_KINDS if gaps else STEP_KINDS
    engines, stubs, params = {}, {}, {}
    for name, package in packages.items():
        engine_module = importlib.import_module(f"{package}.shell.engine")
        state = importlib.import_module(f"{package}.state")
        engines[name] = engine_module.Engine(
            random_weights="tiny",
            device="cpu",
            max_running_requests=8,
            speculative=speculative.get(name, regime["speculative"]),
            **(dict(launch_ahead=True) if gaps or launch_ahead else {}),
        )
        sampled = dict(temperature=1.0, seed=1) if regime["sampled"] else {}
        params[name] = state.SamplingParams(max_tokens=tokens, ignore_eos=True, **sampled)
    vocab = next(iter(engines.values())).runtime.vocab_size
    table = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    following = None
    if regime["repetitive"]:
        prompts, following = repetitive_prompts(rng, vocab, batch, 48)
    else:
        prompts = [rng.integers(3, vocab, 48).tolist() for _ in range(batch)]
    stubs = {name: StubbedModel(engine, table, following) for name, engine in engines.items()}
    for engine in engines.values():
        if engine.spec is not None:
            modelled_pass_times(engine.spec.cost)
    # the gaps' hooks only where asked: the steps' times are taken without them
    clocks = {name: GapClock(engine, packages[name]) for name, engine in engines.items() if gaps}
    for name, engine in engines.items():  # warm-up
        engine.generate(prompts, params[name])
    medians: dict = {name: {kind: [] for kind in kinds} for name in engines}
    outputs: dict = {}
    accepted: dict = {name: [] for name in engines}  # per round: accepted drafts, verify steps
    for round_ in range(rounds):
        requests = {
            name: [engine.inbox.add(ids, params[name], None, None) for ids in prompts]
            for name, engine in engines.items()
        }
        times: dict = {name: {kind: [] for kind in kinds} for name in engines}
        verify_steps = dict.fromkeys(engines, 0)
        accepted_before = {name: accepted_total(engine) for name, engine in engines.items()}
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        while not all(r.done for name in engines for r in requests[name]):
            for name in order:
                engine, stub = engines[name], stubs[name]
                if all(r.done for r in requests[name]):
                    continue
                stub.seconds = 0.0
                clock = GapClock.current = clocks.get(name)
                if clock is not None:
                    clock.resume()
                deferred = engine.stats["drafts_deferred"]
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
                kind = engine.step_times[-1][0]
                if kind == "decode" and engine.stats["drafts_deferred"] > deferred:
                    kind = WAITING
                verify_steps[name] += kind == "verify"
                if clock is not None:
                    clock.pause()
                    for gap_kind, seconds in clock.take():
                        times[name][gap_kind].append(seconds)
                elif kind in STEP_KINDS:
                    times[name][kind].append(elapsed - stub.seconds)
        for name, engine in engines.items():
            for kind in kinds:
                if times[name][kind]:
                    medians[name][kind].append(statistics.median(times[name][kind]) * 1e6)
            outputs[name] = [r.output_ids for r in requests[name]]
            drafts = accepted_total(engine) - accepted_before[name]
            accepted[name].append((drafts, verify_steps[name]))
    same_accepted = len({str(a) for a in accepted.values()}) == 1
    drafts, verifies = (sum(column) for column in zip(*accepted[next(iter(engines))], strict=True))
    return dict(
        medians=medians,
        same=len({str(o) for o in outputs.values()}) == 1 and same_accepted,
        accepted=drafts / verifies if verifies else None,
    )


def accepted_total(engine) -> int:
    """Drafts accepted so far (0 without speculation)."""
    return 0 if engine.spec is None else engine.spec.stats.total().accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", help="a commit whose engine runs beside this tree's")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=400, help="new tokens a request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--spec-against-plain",
        action="store_true",
        help="instead: this tree's engine with speculation against without it, greedy on "
        "free text (chat: most speculative steps draft nothing), stepped in lockstep",
    )
    parser.add_argument(
        "--gaps",
        action="store_true",
        help="instead: launching ahead, the host's time the device waits around a verify pass",
    )
    parser.add_argument(
        "--launch-ahead",
        action="store_true",
        help="the steps' host time launching ahead, greedy with speculation on repetitive text",
    )
    args = parser.parse_args()
    if args.gaps and args.launch_ahead:
        parser.error("--gaps launches ahead already and times gaps, not steps: pass one of them")
    torch.set_num_threads(1)
    if args.spec_against_plain:
        spec_against_plain(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        packages = {"this tree": "engine"}
        if args.baseline:
            packages = {args.baseline: baseline_package(args.baseline, Path(scratch))} | packages
        names = list(packages)
        timed = "a gap" if args.gaps else "a step"
        if args.gaps or args.launch_ahead:
            timed += ", launching ahead"
        print(f"host time {timed} (us, median per round; {args.rounds} rounds)")
        header = " | ".join(f"{name} (us)" for name in names)
        ratio = f" | {names[1]} / {names[0]} |" if len(names) == 2 else " |"
        print(f"\n| batch | regime | step | {header}{ratio} same tokens | accepted / verify |")
        print("|---|---|---|" + "---|" * (len(names) + (len(names) == 2) + 2))
        for batch in (int(b) for b in args.batches.split(",")):
            regimes = REGIMES
            if args.gaps or args.launch_ahead:
                regimes = {"speculative, greedy": REGIMES["speculative, greedy"]}
            for regime_name, regime in regimes.items():
                result = run_regime(
                    packages,
                    batch,
                    regime,
                    args.tokens,
                    args.rounds,
                    gaps=args.gaps,
                    launch_ahead=args.launch_ahead,
                )
                for kind in GAP_KINDS if args.gaps else STEP_KINDS:
                    print_row(batch, regime_name, kind, names, result)


def spec_against_plain(args: argparse.Namespace) -> None:
    """What speculation adds to the host's work a decode step where nothing is drafted (the
    proposer, the histories' growth, the statistics, the cost model): two engines of this tree,
    without and with speculation, greedy on random prompts (few n-gram matches, as in chat).
    Their tokens differ once a verify pass draws the stub's logits a different number of
    times."""
    packages = {"plain": "engine", "speculative": "engine"}
    names = list(packages)
    regime = REGIMES["greedy"]  # the speculative engine set apart by `run_regime`
    print(f"host time a step (us, median per round; {args.rounds} rounds), greedy, free text")
    print(
        "\n| batch | regime | step | plain (us) | speculative (us) | speculative / plain "
        "| same tokens | accepted / verify |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        result = run_regime(
            packages, batch, regime, args.tokens, args.rounds, {"speculative": True}
        )
        print_row(batch, "greedy, free text", "decode", names, result)


def print_row(batch: int, regime: str, kind: str, names: list[str], result: dict) -> None:
    """One kind of step's row, if every round of every engine ran that kind."""
    meds = {name: result["medians"][name][kind] for name in names}
    if not all(meds.values()):
        return
    cells = [f"{min(meds[n]):.0f}-{max(meds[n]):.0f}" for n in names]
    if len(names) == 2:
        old, new = meds[names[0]], meds[names[1]]
        if len(old) == len(new):
            ratios = [n / o for o, n in zip(old, new, strict=True)]
            cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}")
        else:
            cells.append("-")
    accepted = result["accepted"]
    per_verify = "-" if kind != "verify" or accepted is None else f"{accepted:.2f}"
    print(
        f"| {batch} | {regime} | {kind} | " + " | ".join(cells) + f" | {result['same']} "
        f"| {per_verify} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
